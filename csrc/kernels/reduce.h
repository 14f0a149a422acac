/* Typed reduction kernels: dst[i] = dst[i] OP src[i]. */
#ifndef RINGREDUCE_REDUCE_H
#define RINGREDUCE_REDUCE_H

#include <stddef.h>
#include "kernels/reduce_math.h"

/* Reduce `count` elements of src into dst. RR_AVG reduces as RR_SUM (16-bit
 * floats average with rr_mean_fold instead).
 * Returns 0, or -1 for an unknown dtype or op. */
int rr_reduce(void *dst, const void *src, size_t count, rr_dtype dtype, rr_op op);

/* dst[i] = a[i] OP b[i]; dst may be a (not b). Lets the ring reduce out of
 * place without first copying the input. */
int rr_reduce3(void *dst, const void *a, const void *b, size_t count, rr_dtype dtype, rr_op op);

/* One fold of a 16-bit float average (rr_avg_is_mean): dst = (mean * (k-1)
 * + x) / k, where mean averages k-1 contributions and x is the k-th (k >= 2),
 * computed in double and rounded once. dst may be x or mean. Returns 0, or -1
 * for another dtype or k < 2. */
int rr_mean_fold(void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype, int k);

/* The division that finishes an average: buf[i] /= n. Integers floor-divide,
 * as numpy's //, so every rank and the reference agree. */
int rr_divide(void *buf, size_t count, rr_dtype dtype, int n);

/* out = in[0] OP in[1] OP ... OP in[n-1], folded left to right: the small
 * paths' rank order, so every rank reducing the same inputs gets the same
 * bits, whichever path (and whichever slice of the buffer) it takes. RR_AVG
 * divides by n at the end, 16-bit floats fold a running mean
 * (rr_mean_fold) instead. out may be in[0], never another in[i]: no copy of
 * in[0] first, the first fold reads it in place. Returns 0, or -1 as the
 * kernels do. */
int rr_reduce_in_order(void *out, const void *const *in, int n, size_t count, rr_dtype dtype, rr_op op);

#endif
