/* Every pair of bfloat16 bit patterns through the vector mean folds of
 * csrc/kernels/reduce16_x86.c, against the scalar definition rr_mean16_bf16
 * (reduce_math.h: the mean in double, rounded once).
 *
 *     cc -O2 -Icsrc -o /tmp/bf16_mean_exhaustive tests/bf16_mean_exhaustive.c
 *     /tmp/bf16_mean_exhaustive [STRIDE [K...]]
 *
 * STRIDE (default 1: all 2^16 means) takes every STRIDE-th mean pattern, each
 * against all 2^16 x patterns; K defaults to 2..8. tests/test_kernels.py runs
 * it with a stride; the full run's result is in docs/performance.md. Prints one
 * line per (level, k) and exits 1 on any difference. Two NaN results count as
 * equal whatever their payloads (docs/architecture.md, "16-bit kernels"), and
 * are counted apart.
 */
#include "kernels/reduce16_x86.c"

#include <stdio.h>
#include <stdlib.h>

static int check(const char *level, void (*fold)(uint16_t *, const uint16_t *, const uint16_t *, size_t, int),
                 unsigned stride, int k)
{
    static uint16_t x[1 << 16], m[1 << 16], got[1 << 16];
    for (unsigned i = 0; i < 1u << 16; i++) x[i] = (uint16_t)i;
    unsigned long long pairs = 0, wrong = 0, nan_payloads = 0;
    for (unsigned mean = 0; mean < 1u << 16; mean += stride) {
        for (unsigned i = 0; i < 1u << 16; i++) m[i] = (uint16_t)mean;
        /* An odd length, so the padded tail is checked too. */
        fold(got, x, m, (1u << 16) - 1, k);
        got[(1u << 16) - 1] = rr_mean16_bf16(x[(1u << 16) - 1], (uint16_t)mean, k);
        for (unsigned i = 0; i < 1u << 16; i++) {
            const uint16_t want = rr_mean16_bf16(x[i], (uint16_t)mean, k);
            const int nan_got = (got[i] & 0x7fff) > 0x7f80, nan_want = (want & 0x7fff) > 0x7f80;
            if (got[i] == want) continue;
            if (nan_got && nan_want) { nan_payloads++; continue; }
            if (wrong++ < 5)
                printf("  %s k=%d mean=0x%04x x=0x%04x: got 0x%04x, want 0x%04x\n", level, k, mean, i, got[i], want);
        }
        pairs += 1u << 16;
    }
    printf("%-6s k=%-5d pairs %llu wrong %llu (NaN payloads apart: %llu)\n", level, k, pairs, wrong, nan_payloads);
    return wrong != 0;
}

int main(int argc, char **argv)
{
    const unsigned stride = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 1;
    int ks[64], nk = 0;
    for (int i = 2; i < argc && nk < 64; i++) ks[nk++] = atoi(argv[i]);
    if (nk == 0) for (int k = 2; k <= 8; k++) ks[nk++] = k;
    if (stride == 0) return 2;
#ifdef RR_HAVE_X86
    const rr_kernels16 best = rr_kernels16_best();
    if (best == RR_KERNELS16_PORTABLE) { printf("no vector kernels on this CPU\n"); return 0; }
    int failed = 0;
    for (int i = 0; i < nk; i++) {
        if (ks[i] < 2 || ks[i] >= BF16_MEAN_MAX_K) return 2;
        failed |= check("avx2", bf16_mean, stride, ks[i]);
        if (best == RR_KERNELS16_AVX512) failed |= check("avx512", bf16_mean512, stride, ks[i]);
        fflush(stdout);
    }
    return failed;
#else
    printf("not x86-64: no vector kernels\n");
    return 0;
#endif
}
