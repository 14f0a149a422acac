/* The ring on one host by Cross Memory Attach (process_vm_readv), as
 * MPICH's and Open MPI's CMA paths move large messages inside a node: at
 * each step a rank reads the chunk it needs straight out of its previous
 * neighbour's own buffers (its input at the first step, its output later),
 * one kernel copy, instead of the chunk going through the shared mapping.
 * The shared-memory links carry only 64-byte tokens: "my buffers are at
 * these addresses", then "step g's chunk is ready"; the reader hands each
 * token back (rx_consume) once it has read what it allowed, and a rank
 * rewrites its output, or returns, only after its tokens came back
 * (wait_drained). On by default where the probe at init passes:
 * RINGREDUCE_SHM_CMA (docs/architecture.md,
 * "Cross Memory Attach").
 */
#ifndef RINGREDUCE_CMA_H
#define RINGREDUCE_CMA_H

#include <stddef.h>
#include <stdint.h>

#include "schedule/ring.h"

/* Below this many bytes in the longest chunk the ring keeps its other
 * paths: a step costs two wake-ups here, and every rank sees the same chunk
 * sizes, so all decide alike. */
#define RR_CMA_MIN_CHUNK ((size_t)1 << 20)

/* Whether a host operation over these chunks takes the CMA path. */
int rr_cma_wanted(const rr_ring *ring, const size_t *len);

/* ring_steps (ring.c) by Cross Memory Attach: steps g0 .. g1-1, the same
 * kernels in the same order, so the same bits as the other paths. */
int rr_cma_steps(rr_ring *ring, const char *src, char *buf, const size_t *off, const size_t *len, int g0,
                 int g1, int reduce_until, rr_dtype dtype, rr_op op, rr_error *err);

/* 1 when the n bytes at addr in process pid read back (process_vm_readv)
 * equal expect: the probe at init (EPERM under Yama or a container's
 * seccomp, ESRCH across pid namespaces: 0). */
int rr_cma_probe(int pid, uint64_t addr, const void *expect, size_t n);

#endif
