/* 16-bit float kernels on the CPU's conversion instructions.
 *
 * float16 and bfloat16 reduce by widening to float32 and rounding back once,
 * to nearest even (reduce_math.h). Written element by element that rounding
 * is a chain of branches and the loop stays scalar; here it is F16C's
 * vcvtph2ps/vcvtps2ph for float16 and AVX2 integer arithmetic for bfloat16,
 * eight elements at a time. The instructions are chosen at run time
 * (__builtin_cpu_supports) and compiled with target attributes, so one build
 * runs on every x86-64 and elsewhere falls back to reduce.c's loops. Every
 * level gives the same bits (tests/test_kernels.py checks them against each
 * other and numpy).
 */
#ifndef RINGREDUCE_REDUCE16_H
#define RINGREDUCE_REDUCE16_H

#include <stddef.h>
#include "kernels/reduce_math.h"

typedef enum {
    RR_KERNELS16_PORTABLE = 0, /* reduce.c's loops over reduce_math.h */
    RR_KERNELS16_AVX2 = 1,     /* x86-64 with AVX2 and F16C */
    RR_KERNELS16_AVX512 = 2,   /* and AVX-512F: sixteen elements a step */
} rr_kernels16;

/* The best level this CPU runs. */
rr_kernels16 rr_kernels16_best(void);

/* The level in use: the best unless lowered by rr_kernels16_use. */
rr_kernels16 rr_kernels16_current(void);

/* Use `level`, or the best the CPU runs if that is lower; returns the level
 * now in use. For tests and benchmarks that compare the paths. */
rr_kernels16 rr_kernels16_use(rr_kernels16 level);

/* dst = a OP b (dst may be a) with the vector kernels. Returns 0, or -1 where
 * the level in use has none for this dtype or op (the caller's loop runs). */
int rr_reduce16_vec(void *dst, const void *a, const void *b, size_t count, rr_dtype dtype, rr_op op);

/* rr_mean_fold's arithmetic with the vector kernels; same contract as
 * rr_reduce16_vec. */
int rr_mean_fold16_vec(void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype, int k);

#endif
