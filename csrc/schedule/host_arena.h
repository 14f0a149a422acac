/* A per-host shared arena: when every rank of a ring runs on one host, a
 * small operation needs no ring at all. Each rank writes its blob (header and
 * data) into its own slot of one shared mapping and publishes a round number;
 * every rank waits until all N slots carry that round, then reads all N blobs
 * in place. One write and one wait instead of N-1 hops through the ring, each
 * of which could be a sleep and a wake-up.
 *
 *   file:  [ page 0: magic, nonce (ringreduce/shm.py) | gen | sleepers ]
 *          [ round of rank 0 | round of rank 1 | ...   (a cache line each) ]
 *          [ rank 0 buf 0 | rank 0 buf 1 | rank 1 buf 0 | rank 1 buf 1 | ... ]
 *
 * Round s goes into buffer s % 2. No "consumed" marks are needed: a rank
 * publishes round s+1 only after finishing round s, which needed every rank's
 * round s, which each published only after it had finished reading round
 * s-1. So when any rank writes buffer (s+1) % 2, nobody reads round s-1 any
 * more.
 *
 * Waiting: a brief sched_yield spin (with more ranks than cores, the rank we
 * wait for runs now), then a futex sleep on `gen`, the word every publish
 * bumps. A dead or silent peer is seen through the transport (its control
 * star, csrc/transport/tcp.c), asked between sleeps: the arena knows nothing of sockets.
 *
 * The file is made, checked and unlinked by ringreduce/shm.py (like the
 * links); its layout is fixed here (rr_arena_file_bytes). */
#ifndef RINGREDUCE_HOST_ARENA_H
#define RINGREDUCE_HOST_ARENA_H

#include <stddef.h>

#include "common/error.h"
#include "kernels/reduce_math.h"
#include "transport/transport.h"

#define RR_ARENA_MAGIC "RRARENA1"

typedef struct rr_arena rr_arena;

/* How a small allreduce is reduced once every blob is in the arena (the
 * ring's use_arena; 0 there is "no arena"). DIRECT: each rank folds all N
 * blobs in rank order straight into its output, its own term read from its
 * input. SPLIT: each rank folds only its 1/N slice of all blobs, in the same
 * order, into the arena, and after a second round copies every slice out
 * (less reduction and less reading of other cores' lines per rank, one more
 * wait). COPY: the first version (copy blob 0 out, then fold the rest in),
 * kept to compare. AUTO picks DIRECT or SPLIT by rr_arena_wants_split. All
 * give the same bits. */
typedef enum { RR_ARENA_AUTO = 1, RR_ARENA_COPY = 2, RR_ARENA_DIRECT = 3, RR_ARENA_SPLIT = 4 } rr_arena_mode;

/* Whether `mode` splits the reduction of a `bytes` tensor among `size`
 * ranks: the cost model (docs/performance.md, "The host arena, one at a time"). */
int rr_arena_wants_split(int mode, int size, size_t bytes);

/* Size of the file for `size` ranks whose blobs are up to slot_bytes. */
size_t rr_arena_file_bytes(int size, size_t slot_bytes);

/* Maps the file (taking ownership of fd); its size must be
 * rr_arena_file_bytes(size, slot_bytes). NULL with err filled on failure. */
rr_arena *rr_arena_map(int fd, int rank, int size, size_t slot_bytes, int spin, rr_error *err);
void rr_arena_unmap(rr_arena *a);

/* Largest blob a slot holds. */
size_t rr_arena_slot_bytes(const rr_arena *a);

/* One round: publishes this rank's blob (head then data) and waits until
 * every rank's blob of the round is there. A blob too big for its slot is
 * published as its length alone: *all_fit is then 0 on every rank, and all
 * of them must move this round's blobs another way. Waits ask t->ops->stalled
 * (a lost or silent peer ends the wait with its error). */
int rr_arena_round(rr_arena *a, rr_transport *t, const void *head, size_t hlen, const void *data, size_t dlen,
                   int *all_fit, rr_error *err);

/* DIRECT's fold: out = in[0] OP ... OP in[n-1] in rank order
 * (rr_reduce_in_order), where in[own] is this rank's term and the others
 * are blobs other cores just wrote. Up to 64 KiB it folds 8 KiB at a time
 * and asks for the next 8 KiB of the others' blobs first: those lines come
 * slowly out of the other cores' caches, and asking early overlaps them
 * (docs/performance.md, "The host arena, one at a time"). Same bits. */
int rr_arena_fold(void *out, const void *const *in, int n, int own, size_t count, rr_dtype dtype, rr_op op);

/* Offers the split (SPLIT above) with the next round only; after it,
 * rr_arena_all_split says whether every rank offered it. Every rank reads
 * the same offers, so all of them take the same way. */
void rr_arena_offer_split(rr_arena *a, int split);
int rr_arena_all_split(const rr_arena *a);

/* The split reduction, after a round in which every header agreed and
 * every rank offered it: folds this rank's slice of every blob (past hlen
 * bytes of header) in rank order into its buffer of a second round,
 * publishes that, and copies every rank's slice into out. `data` is this
 * rank's own term (read in place of its blob unless it overlaps out). */
int rr_arena_allreduce_split(rr_arena *a, rr_transport *t, size_t hlen, const void *data, size_t dlen, void *out,
                             rr_dtype dtype, rr_op op, rr_error *err);

/* Rank i's blob of the last round (valid until the next round), *len bytes. */
const void *rr_arena_blob(const rr_arena *a, int i, size_t *len);

#endif
