/* The 16-bit mean folds on random data: float16's double fold against its
 * float32 one (csrc/kernels/reduce16_x86.c, "float16 mean fold in float32"),
 * interleaved in one process, the float16 sum for scale, and the bfloat16
 * fold and sum.
 *
 *     cc -O3 -std=gnu11 -fno-trapping-math -Icsrc -o /tmp/mean_fold_bench benchmarks/mean_fold_bench.c -lm
 *     /tmp/mean_fold_bench [ELEMENTS [ROUNDS [KMAX]]]
 *
 * out = fold(x, m) out of place, x and m normally distributed float16, fixed:
 * `dtype16_bench.py --kernels` folds in place, dst = fold(dst, src) over and
 * over, which drives dst towards src and its means onto exact values, and
 * so leaves out what real gradients cost. AVX-512 level (the machine's best;
 * AVX2 runs the float32 fold for powers of 2 only). G elements/s, best and
 * worst of ROUNDS (default 7), k = 2..KMAX (default 8). The bfloat16 double
 * fold is the one before the float32 fold, for comparison.
 */
#include "kernels/reduce16_x86.c"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* This process's CPU time, not wall time: on a machine shared with other
 * work, time spent descheduled does not count (caches and the sibling
 * hyperthread still do). */
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double gauss(void)
{
    const double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

typedef void fold_fn(uint16_t *, const uint16_t *, const uint16_t *, size_t, int);

static void sum_as_fold(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t n, int k)
{
    (void)k;
    f16_sum512(d, m, x, n);
}

static void bf16_sum_as_fold(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t n, int k)
{
    (void)k;
    bf16_sum512(d, m, x, n);
}

/* The bfloat16 fold before the float32 one (git show c9b1b4e^:csrc/reduce16_x86.c,
 * MEAN_KERNEL512): mean_step512 in double, rounded to odd, then to bfloat16.
 * No tiny-mean check: random data has none. */
AVX512 static void bf16_double_fold(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t n, int k)
{
    const __m512d km1 = _mm512_set1_pd((double)(k - 1)), kd = _mm512_set1_pd((double)k);
    const __m512d inv = _mm512_set1_pd(1.0 / (double)k);
    const int pow2 = (k & (k - 1)) == 0;
    for (size_t i = 0; i + 16 <= n; i += 16)
        store16_bf16(d + i, mean_step512(load16_bf16(x + i), load16_bf16(m + i), km1, kd, inv, pow2));
}

static double rate(fold_fn *f, uint16_t *out, const uint16_t *x, const uint16_t *m, size_t n, int k)
{
    const int iters = (int)(1e8 / (double)n) + 1;
    const double t = now();
    for (int i = 0; i < iters; i++) f(out, x, m, n, k);
    return (double)n * iters / (now() - t) / 1e9;
}

int main(int argc, char **argv)
{
#ifdef RR_HAVE_X86
    const size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 65536;
    const int rounds = argc > 2 ? atoi(argv[2]) : 7;
    const int kmax = argc > 3 ? atoi(argv[3]) : 8;
    if (rr_kernels16_best() != RR_KERNELS16_AVX512) { printf("no AVX-512 on this CPU\n"); return 0; }
    uint16_t *x = malloc(n * 2), *m = malloc(n * 2), *out = malloc(n * 2);
    for (size_t i = 0; i < n; i++) x[i] = rr_f64_to_f16(gauss()), m[i] = rr_f64_to_f16(gauss());
    printf("%zu elements, G elements/s, best / worst of %d rounds\n", n, rounds);
    for (int k = 2; k <= kmax; k++) {
        double lo[3] = {1e9, 1e9, 1e9}, hi[3] = {0, 0, 0};
        fold_fn *fs[3] = {f16_mean512, f16_mean512_f32, sum_as_fold};
        for (int r = 0; r < rounds; r++)
            for (int j = 0; j < 3; j++) {
                const double g = rate(fs[j], out, x, m, n, k);
                lo[j] = g < lo[j] ? g : lo[j], hi[j] = g > hi[j] ? g : hi[j];
            }
        printf("float16  k=%d  double fold %.2f / %.2f   float32 fold %.2f / %.2f   sum %.2f / %.2f\n", k, hi[0],
               lo[0], hi[1], lo[1], hi[2], lo[2]);
    }
    uint16_t *bx = malloc(n * 2), *bm = malloc(n * 2);
    for (size_t i = 0; i < n; i++) bx[i] = rr_f64_to_bf16(gauss()), bm[i] = rr_f64_to_bf16(gauss());
    for (int k = 2; k <= kmax; k++) {
        double lo[3] = {1e9, 1e9, 1e9}, hi[3] = {0, 0, 0};
        fold_fn *fs[3] = {bf16_double_fold, bf16_mean512, bf16_sum_as_fold};
        for (int r = 0; r < rounds; r++)
            for (int j = 0; j < 3; j++) {
                const double g = rate(fs[j], out, bx, bm, n, k);
                lo[j] = g < lo[j] ? g : lo[j], hi[j] = g > hi[j] ? g : hi[j];
            }
        printf("bfloat16 k=%d  double fold %.2f / %.2f   float32 fold %.2f / %.2f   sum %.2f / %.2f\n", k, hi[0],
               lo[0], hi[1], lo[1], hi[2], lo[2]);
    }
#else
    (void)argc, (void)argv;
    printf("not x86-64\n");
#endif
    return 0;
}
