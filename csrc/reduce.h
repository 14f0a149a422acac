/* Typed reduction kernels: dst[i] = dst[i] OP src[i]. */
#ifndef RINGREDUCE_REDUCE_H
#define RINGREDUCE_REDUCE_H

#include <stddef.h>
#include "reduce_math.h"

/* Reduce `count` elements of src into dst. RR_AVG reduces as RR_SUM.
 * Returns 0, or -1 for an unknown dtype or op. */
int rr_reduce(void *dst, const void *src, size_t count, rr_dtype dtype, rr_op op);

/* dst[i] = a[i] OP b[i]; dst may be a (not b). Lets the ring reduce out of
 * place without first copying the input. */
int rr_reduce3(void *dst, const void *a, const void *b, size_t count, rr_dtype dtype, rr_op op);

/* The division that finishes an average: buf[i] /= n. Integers floor-divide,
 * as numpy's //, so every rank and the reference agree. */
int rr_divide(void *buf, size_t count, rr_dtype dtype, int n);

#endif
