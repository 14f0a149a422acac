/* Small operations by recursive doubling, over a transport that reaches any
 * rank (transport.h's optional sendrecv: MPI). Same contracts as the ring's
 * rr_exchange_blobs and rr_allreduce_small (ring.h), which call these when
 * rr_doubling_usable says so; log2 N rounds instead of N-1 hops. */
#ifndef RINGREDUCE_RECURSIVE_DOUBLING_H
#define RINGREDUCE_RECURSIVE_DOUBLING_H

#include "schedule/ring.h"

/* Whether the small operations of this ring run here: its transport can
 * reach any rank and ring->small_algorithm does not force the ring. */
int rr_doubling_usable(const rr_ring *ring);

/* Data-carrying rounds of the busiest rank in rr_allreduce_doubling: log2 P
 * (P the largest power of two <= size), plus one where size is not one. */
int rr_doubling_rounds(int size);

/* rr_exchange_blobs by recursive doubling: every rank's blob reaches every
 * rank; each round a rank sends all the blobs it holds to its partner. */
int rr_exchange_blobs_doubling(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                               void **all, size_t *lens, rr_error *err);

/* rr_allreduce_small by recursive doubling: each round a rank swaps its
 * partial result (and the headers it holds) with its partner. When any
 * header differs, *agreed is 0, nothing is reduced, and *all/lens hold every
 * rank's header (the caller frees *all). Not for 16-bit averages (their
 * running means want rank order: rr_allreduce_small gathers those). */
int rr_allreduce_doubling(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen, void *out,
                          rr_dtype dtype, rr_op op, int *agreed, void **all, size_t *lens, rr_error *err);

#endif
