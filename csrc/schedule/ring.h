/* The ring schedule: allreduce, reduce-scatter, allgather, broadcast and the
 * small-message header exchange, over any rr_transport (ring.c); alltoall
 * (alltoall.c). */
#ifndef RINGREDUCE_RING_H
#define RINGREDUCE_RING_H

#include <stddef.h>
#include "kernels/reduce_math.h"
#include "device/device.h"
#include "schedule/host_arena.h"
#include "memory/peer_map.h"
#include "transport/transport.h"

/* The small operations' algorithm (rr_exchange_blobs, rr_allreduce_small):
 * AUTO takes recursive doubling where the transport reaches any rank
 * (recursive_doubling.h), else the ring; RING forces the ring's N-1 hops. */
typedef enum { RR_SMALL_AUTO = 0, RR_SMALL_RING = 1 } rr_small_algorithm;

/* A staged operation's chunks (ring.c): the host ring runs on a device's
 * pinned mirror and tells the stage when it first touches a chunk
 * (rr_stage_need: its trip down must be done) and when a chunk is final
 * (rr_stage_final: it goes back up). */
typedef struct rr_stage rr_stage;

typedef struct rr_ring {
    uint64_t id;             /* unique in this process: the key of what others keep per ring (device.h) */
    rr_transport *transport; /* owned */
    int rank, size;
    size_t segment;          /* pipeline segment, bytes (a multiple of 64) */
    void *staging;           /* one segment: where received partials land before reduction */
    double phase_times[3];   /* last allreduce: start, ScatterReduce done, end (CLOCK_MONOTONIC s) */
    rr_small_algorithm small_algorithm; /* the same on every rank, or the blob passes never meet */
    rr_arena *arena;         /* owned, or NULL: every rank on one host shares it (host_arena.h) */
    int use_arena;           /* blob exchanges and small allreduces go through it (a switch to compare) */
    int zero_copy;           /* reduce in the transport's windows (ring_steps_zero_copy); its byte
                                order differs, so every rank must set it alike: 0 until
                                ringreduce/shm.py's agree_zero_copy (RINGREDUCE_SHM_ZEROCOPY) */
    unsigned long long zero_copy_ops; /* ring operations that took that path (tests, benchmarks) */
    int cma_pid;             /* prev's pid where every rank agreed on Cross Memory Attach (cma.h), else 0;
                                taken only with zero_copy on, so switching that off stops it too */
    unsigned long long cma_ops; /* ring operations that took the CMA path */
    rr_peer_maps peer_maps;  /* prev's shared regions mapped here (peer_map.h), for the CMA path */
    unsigned long long mapped_ops; /* CMA operations that read prev's data out of such a mapping */
    rr_stage *stage;         /* during a staged operation on a device's buffers (ring.c), else NULL */
} rr_ring;

/* Takes ownership of the transport. NULL on out-of-memory. */
rr_ring *rr_ring_create(rr_transport *t, size_t segment_bytes);
void rr_ring_destroy(rr_ring *ring);
/* A new pipeline segment (autotuning, ringreduce/autotune.py), between
 * operations only. -1 on out-of-memory, the old segment kept. */
int rr_ring_set_segment(rr_ring *ring, size_t segment_bytes);

/* Takes ownership of a host arena every rank of the ring attached, in the
 * same order: header passes and small allreduces go through it from now on.
 * -1 (the arena not taken) when the transport cannot judge its waits. */
int rr_ring_attach_arena(rr_ring *ring, rr_arena *arena);

/* Before each operation: fails (and aborts the transport) when a peer is
 * already known lost, so no rank starts what cannot finish. */
int rr_ring_begin(rr_ring *ring, rr_error *err);

/* How many elements of `count` chunk i holds: the first count % size chunks
 * get one extra element. */
size_t rr_chunk_count(size_t count, int size, int i);

/* The collectives below take buffers in host memory (dev NULL) or in a
 * device's memory (device.h); ranks of either kind share one ring. On a
 * device the host ring runs in place on the device's pinned mirror, each
 * chunk going down once and up once (ring.c, "the staged path"): the same
 * paths, kernels and bits as on the host, and O(N) device operations. */

/* Before the host ring first reads or writes chunk c of the mirror: waits
 * for that chunk's trip down. After chunk c is final in the mirror: queues
 * its trip up. Both do nothing for chunks the operation does not move. */
int rr_stage_need(rr_stage *s, int c, rr_error *err);
int rr_stage_final(rr_stage *s, int c, rr_error *err);

/* dst ends with the reduction of every rank's src, bit-identical on all
 * ranks. dst may be src (in place); src is only read. */
int rr_allreduce(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype, rr_op op,
                 rr_error *err);

/* ScatterReduce only: afterwards chunk `rank` of dst (see rr_chunk_count)
 * holds the reduction; other chunks are undefined (partials, or what was
 * there: zero copy sends partials without keeping them). dst may be src. */
int rr_reduce_scatter(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype, rr_op op,
                      rr_error *err);

/* In place, AllGather only: block i is nbytes[i] bytes at the sum of the
 * blocks before it; this rank's block is filled, the rest get filled. */
int rr_allgather(rr_ring *ring, rr_device *dev, void *buf, const size_t *nbytes, rr_error *err);

/* Root's nbytes flow along the ring, pipelined by segment. */
int rr_broadcast(rr_ring *ring, rr_device *dev, void *buf, size_t nbytes, int root, rr_error *err);

/* Alltoall (alltoall.c): bytes is the N*N matrix of block sizes,
 * bytes[o * N + d] = what origin o sends to d, the same on every rank. src
 * holds this rank's blocks for d = 0 .. N-1 back to back, dst receives every
 * origin's block for this rank, in origin order. */
int rr_alltoall(rr_ring *ring, const void *src, void *dst, const size_t *bytes, rr_error *err);

/* Every rank contributes one blob of any length (up to 64 MiB), given as a
 * header and data; every rank gets all of them, in rank order (through the
 * host arena when every blob fits its slot, else by recursive doubling where
 * rr_doubling_usable, else around the ring). *all is one malloc'ed block holding the
 * blobs back to back; lens[size] their lengths. Used for the headers that
 * precede every operation, and for small operations whose data rides along. */
int rr_exchange_blobs(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                      void **all, size_t *lens, rr_error *err);

/* Allreduce for small buffers: through the host arena when there (reduced
 * straight out of it); else, where rr_doubling_usable, by recursive doubling
 * (rr_allreduce_doubling; 16-bit averages gather by doubling and reduce as
 * below); else every rank's header and data travel in one rr_exchange_blobs
 * pass, and each rank reduces them in rank order into out.
 * If any header differs from ours, *agreed is 0, nothing is reduced, and
 * *all/lens hold every rank's blob (caller frees *all). */
int rr_allreduce_small(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                       void *out, rr_dtype dtype, rr_op op, int *agreed, void **all, size_t *lens,
                       rr_error *err);

#endif
