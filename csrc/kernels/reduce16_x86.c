/* 16-bit float kernels on x86-64: F16C for float16, AVX2 integer rounding
 * for bfloat16, eight elements a step (reduce16.h).
 *
 * Each function carries its own target attribute, so the rest of the library
 * builds for baseline x86-64 and these run only where the CPU says it can.
 * The arithmetic is reduce_math.h's, instruction for instruction:
 *   - widen exactly: vcvtph2ps, or bfloat16 << 16;
 *   - combine in float32 (min/max: the same selects as RR_FMIN/RR_FMAX, so
 *     NaNs and signed zeros come out alike);
 *   - round once to nearest even: vcvtps2ph with an explicit rounding
 *     immediate (MXCSR is not consulted), or bfloat16's u + 0x7fff + lsb,
 *     with NaNs kept quiet as rr_f32_to_bf16 keeps them.
 * The float16 running-mean fold computes in float32 for k < 2^13 ("float16
 * mean fold in float32" below), else in double like rr_mean_step; either
 * rounds the mean *to odd* in float32, then to 16 bits to nearest even: with
 * 24 bits against 11, at least two more, the two roundings give the one
 * rounding rr_f64_to_16 computes (Boldo & Melquiond, "Emulation of FMA and
 * correctly rounded sums: proved algorithms using rounding to odd").
 * The bfloat16 fold gets the same bits from float32 arithmetic alone, with
 * no conversions to and from double ("bfloat16 mean fold in float32" below).
 * Where the CPU has AVX-512F, every kernel runs sixteen a step.
 * AVX-512 BF16's vcvtneps2bf16 is not used: it flushes subnormals to zero.
 */
#include "kernels/reduce16.h"

#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RR_HAVE_X86 1
#include <immintrin.h>
#endif

static int level_in_use = -1; /* rr_kernels16, or -1 until first asked */

rr_kernels16 rr_kernels16_best(void)
{
#ifdef RR_HAVE_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return RR_KERNELS16_PORTABLE;
    return __builtin_cpu_supports("avx512f") ? RR_KERNELS16_AVX512 : RR_KERNELS16_AVX2;
#endif
    return RR_KERNELS16_PORTABLE;
}

rr_kernels16 rr_kernels16_current(void)
{
    int level = __atomic_load_n(&level_in_use, __ATOMIC_RELAXED);
    if (level < 0) { /* racing first callers all store the same answer */
        level = (int)rr_kernels16_best();
        __atomic_store_n(&level_in_use, level, __ATOMIC_RELAXED);
    }
    return (rr_kernels16)level;
}

rr_kernels16 rr_kernels16_use(rr_kernels16 level)
{
    rr_kernels16 best = rr_kernels16_best();
    if (level > best) level = best;
    __atomic_store_n(&level_in_use, (int)level, __ATOMIC_RELAXED);
    return level;
}

#ifdef RR_HAVE_X86

#define AVX2 __attribute__((target("avx2,f16c")))

/* ------------------------------------------------------------ conversions */

AVX2 static inline __m256 load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

AVX2 static inline void store_f16(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

AVX2 static inline __m256 load_bf16(const uint16_t *p)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* rr_f32_to_bf16, eight at a time. */
AVX2 static inline void store_bf16(uint16_t *p, __m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i high = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    out = _mm256_blendv_epi8(out, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    /* 32 -> 16 bits (all values fit), then gather the two lanes' low halves. */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* ------------------------------------------------------------ arithmetic */

/* RR_NAN_FIRST: a NaN in a over r (the compiler may commute the add, and
 * with two NaNs x86 returns the first operand's). */
AVX2 static inline __m256 nan_first(__m256 a, __m256 r)
{
    return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
AVX2 static inline __m256 v_sum(__m256 a, __m256 b) { return nan_first(a, _mm256_add_ps(a, b)); }
AVX2 static inline __m256 v_prod(__m256 a, __m256 b) { return nan_first(a, _mm256_mul_ps(a, b)); }

/* RR_FMIN/RR_FMAX: a NaN in a wins, then a NaN in b, else a < b ? a : b. */
AVX2 static inline __m256 v_min(__m256 a, __m256 b)
{
    __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
    r = _mm256_blendv_ps(r, b, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

AVX2 static inline __m256 v_max(__m256 a, __m256 b)
{
    __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, b, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

/* double -> float32 rounded to odd, in the double itself: drop the 29 low
 * mantissa bits and set the lowest one kept if any dropped bit was set. The
 * result has 24 significant bits, so the conversion to float32 is exact where
 * float32 is normal (|y| >= 2^-126; the caller sees to the rest). NaN stays
 * NaN (the quiet bit is kept), inf stays inf. */
AVX2 static inline __m128 to_float_odd(__m256d y)
{
    const __m256i dropped_bits = _mm256_set1_epi64x((1ll << 29) - 1);
    const __m256i u = _mm256_castpd_si256(y);
    const __m256i exact = _mm256_cmpeq_epi64(_mm256_and_si256(u, dropped_bits), _mm256_setzero_si256());
    const __m256i sticky = _mm256_andnot_si256(exact, _mm256_set1_epi64x(1ll << 29));
    return _mm256_cvtpd_ps(_mm256_castsi256_pd(_mm256_or_si256(_mm256_andnot_si256(dropped_bits, u), sticky)));
}

AVX2 static inline __m256d divide(__m256d a, __m256d k, __m256d one_over_k, int k_is_power_of_2)
{
    return k_is_power_of_2 ? _mm256_mul_pd(a, one_over_k) : _mm256_div_pd(a, k); /* the product is exact then */
}

/* rr_mean_step on eight widened pairs, rounded to odd in float32. */
AVX2 static inline __m256 mean_step(__m256 x, __m256 mean, __m256d k_minus_1, __m256d k, __m256d one_over_k,
                                    int k_is_power_of_2)
{
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(mean)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(mean, 1));
    lo = _mm256_add_pd(_mm256_mul_pd(lo, k_minus_1), _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    hi = _mm256_add_pd(_mm256_mul_pd(hi, k_minus_1), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    lo = divide(lo, k, one_over_k, k_is_power_of_2);
    hi = divide(hi, k, one_over_k, k_is_power_of_2);
    return _mm256_set_m128(to_float_odd(hi), to_float_odd(lo));
}

/* ------------------------------------------------------------ loops */

/* The tail (< 8 elements) goes through a zero-padded block, so it rounds by
 * the same instructions as the rest. */
#define BINARY_KERNEL(NAME, LOAD, STORE, OP)                                          \
    AVX2 static void NAME(uint16_t *d, const uint16_t *x, const uint16_t *y, size_t count) \
    {                                                                                 \
        size_t i = 0;                                                                 \
        for (; i + 16 <= count; i += 16) {                                            \
            __m256 r0 = OP(LOAD(x + i), LOAD(y + i)), r1 = OP(LOAD(x + i + 8), LOAD(y + i + 8)); \
            STORE(d + i, r0);                                                         \
            STORE(d + i + 8, r1);                                                     \
        }                                                                             \
        for (; i + 8 <= count; i += 8) STORE(d + i, OP(LOAD(x + i), LOAD(y + i)));     \
        if (i < count) {                                                              \
            uint16_t bx[8] = {0}, by[8] = {0}, bd[8];                                 \
            memcpy(bx, x + i, (count - i) * 2);                                       \
            memcpy(by, y + i, (count - i) * 2);                                       \
            STORE(bd, OP(LOAD(bx), LOAD(by)));                                        \
            memcpy(d + i, bd, (count - i) * 2);                                       \
        }                                                                             \
    }

BINARY_KERNEL(f16_sum, load_f16, store_f16, v_sum)
BINARY_KERNEL(f16_prod, load_f16, store_f16, v_prod)
BINARY_KERNEL(f16_min, load_f16, store_f16, v_min)
BINARY_KERNEL(f16_max, load_f16, store_f16, v_max)
BINARY_KERNEL(bf16_sum, load_bf16, store_bf16, v_sum)
BINARY_KERNEL(bf16_prod, load_bf16, store_bf16, v_prod)
BINARY_KERNEL(bf16_min, load_bf16, store_bf16, v_min)
BINARY_KERNEL(bf16_max, load_bf16, store_bf16, v_max)

/* The tail (< 8 elements) goes through a zero-padded block. */
AVX2 static void f16_mean(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k)
{
    const __m256d km1 = _mm256_set1_pd((double)(k - 1)), kd = _mm256_set1_pd((double)k);
    const __m256d inv = _mm256_set1_pd(1.0 / (double)k);
    const int pow2 = (k & (k - 1)) == 0;
    uint16_t bx[8] = {0}, bm[8] = {0}, bd[8];
    for (size_t i = 0; i < count; i += 8) {
        const size_t n = count - i < 8 ? count - i : 8;
        if (n < 8) {
            memcpy(bx, x + i, n * 2);
            memcpy(bm, m + i, n * 2);
            store_f16(bd, mean_step(load_f16(bx), load_f16(bm), km1, kd, inv, pow2));
            memcpy(d + i, bd, n * 2);
        } else {
            store_f16(d + i, mean_step(load_f16(x + i), load_f16(m + i), km1, kd, inv, pow2));
        }
    }
}

/* ------------------------------------------------------------ bfloat16 mean fold in float32
 *
 * rr_mean16_bf16 computes Y = (m (k-1) + x) / k in double and rounds it once
 * to bfloat16. bfloat16 has 8 significant bits, float32 24: room enough to
 * get the same bits without double, and with it without the conversions
 * that bound the double fold (k < 2^15; tests/bf16_mean_exhaustive.c checks
 * every pair of bit patterns for k = 2..8):
 *   1. P = m (k-1) is exact (8 + 15 bits at most) and X = x. Where |RN(P +
 *      X)| reaches 2^127 (or is inf or NaN) the block goes again, scaled by
 *      2^-s, 2^s >= k: P = m (k-1) 2^-s and X = x 2^-s are still exact
 *      (bfloat16 is a multiple of 2^-133, float32 holds multiples of 2^-149)
 *      and |P + X| stays within bfloat16's range, where m (k-1) could
 *      overflow float32. (Not scaled always: that saves two multiplies,
 *      and keeps values near 2^-126 out of float32's subnormal range, where
 *      x86 takes slow microcode assists.)
 *   2. hi = RN(P + X), and q = hi * RN(1/k): within 3 float32 ulps of
 *      Y' = (P + X) / k, which is Y or, scaled, Y 2^-s (three roundings of at
 *      most 2^-24: 1/k, the product, and the sum's error lo = P + X - hi,
 *      which TwoSum gives exactly).
 *   3. Rounding to bfloat16 turns only at midpoints: floats whose low 16 bits
 *      are 0x8000. If q's low 16 bits are more than 8 from 0x8000, no
 *      midpoint lies between q and Y', and q rounds as Y' does (the
 *      careful path's test; for k not a power of 2 the fast path takes
 *      "fast step 4" below instead). (k a power of 2: q = hi / k exactly and
 *      Y' - q = lo / k, at most half an ulp; only q on a midpoint with
 *      lo != 0 is in doubt. k = 2, unscaled, has none: lo != 0 only where
 *      x and m are 2^16 or more apart, and then q lies within a float32 ulp
 *      of half the larger, a bfloat16 value (normal: the refold threshold
 *      keeps q above 2^-124) 2^15 ulps from any midpoint, where Y rounds
 *      too.)
 *   4. Near a midpoint M, Y''s side of it is the sign of r = (hi - k M) + lo:
 *      k M is exact (9 + 15 bits), hi - k M is exact (Sterbenz), and so is r
 *      wherever it is small. One catch: the double fold rounds the sum
 *      m (k-1) + x to 53 bits before dividing, so where |r| is at most half
 *      a double ulp of k M (the sum held a tiny x against a huge m), it
 *      lands on k M and Y on M: a tie. q becomes M - 1 ulp, M or M + 1 ulp
 *      (in magnitude) on that side, which rounds as Y' does. (Dividing the
 *      53-bit sum by k rounds again, but never onto a midpoint.)
 *   5. Scale back by 2^s if scaled (exact) and round to nearest even; NaNs,
 *      which got here from bfloat16 NaNs or inf - inf, have their low 16
 *      bits clear and keep their payload, quiet, like rr_f32_to_bf16's.
 * Fast step 4, every k not a power of 2, branch-free: on real data means
 * land exactly on midpoints often (k = 3: 4% of normally distributed pairs,
 * a block of 16 in two), so step 3's window took the careful path in most
 * blocks. With M = (|q| & 0xffff0000) | 0x8000, the midpoint above |q|'s
 * bfloat16 truncation, r = |hi| - k M is exact (k M has 9 + 15 bits; |hi|
 * is within a factor 1 + 2^-7 of k M: Sterbenz), and Y' rounds up from M where r > 0,
 * down where r < 0: rounding is monotonic and k M a float32, so |hi| and
 * |P + X| lie on the same side of it, and |Y'| lies within 3 ulps of |q|,
 * between the midpoints below and above M's neighbours. The 53-bit sum of
 * step 4 moves no side there either (|P + X| is at least half a float32
 * ulp from k M). So |q| becomes M + 1 ulp, M - 1 ulp, or, where r = 0 and
 * the sum is exact (Y' = M, a tie), M. Only r = 0 with an inexact sum (lo
 * needed) takes the careful path. A zero q uses M = MID_FLOOR for k M (r <
 * 0: M - 1 ulp rounds to zero, signed) so no subnormal is computed.
 * Steps 2-4 need q in float32's normal range: a block with a nonzero |hi|
 * below 2^(s-124) (means below about 2^-124, near 1e-37) is folded again by
 * the scalar rr_mean16_bf16. The products here are exact, so a compiler that
 * fuses them with the adds (FMA) changes no bit. */
#define BF16_MEAN_MAX_K (1 << 15)
#define MIDPOINT_WINDOW 8 /* float32 ulps either side of a bfloat16 midpoint, > step 2's 3 */
#define MID_FLOOR 0x00808000 /* fast step 4's M for q = 0: normal, so k M is no subnormal (slow on x86) */

typedef struct {
    float k, one_over_k, km1, km1_down, down, up; /* down = 2^-s, up = 2^s */
    int32_t tiny;                                 /* bits of 2^(s-124) */
    int pow2;
} bf16_mean_consts;

static bf16_mean_consts bf16_mean_consts_for(int k)
{
    int s = 0;
    while ((1 << s) < k) s++;
    const float down = rr_bits_f32((uint32_t)(127 - s) << 23);
    return (bf16_mean_consts){(float)k, 1.0f / (float)k, (float)(k - 1), (float)(k - 1) * down, down,
                              rr_bits_f32((uint32_t)(127 + s) << 23), (127 + s - 124) << 23, (k & (k - 1)) == 0};
}

/* What a block's float32 pass found (step 1, and the tiny means). */
enum { BLOCK_DONE, BLOCK_HUGE, BLOCK_TINY };
#define HUGE_BITS 0x7f000000 /* 2^127 */

/* The bfloat16 rounding of store_bf16, for floats whose NaNs have clear low
 * bits (step 5). */
AVX2 static inline void store_bf16_plain(uint16_t *p, __m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i out = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* TwoSum (Knuth): the exact error of hi = RN(p + x). */
AVX2 static inline __m256 sum_error(__m256 p, __m256 x, __m256 hi)
{
    const __m256 xv = _mm256_sub_ps(hi, p), pv = _mm256_sub_ps(hi, xv);
    return _mm256_add_ps(_mm256_sub_ps(p, pv), _mm256_sub_ps(x, xv));
}

/* Step 4 where `near` (all ones) is set: q moved next to, or onto, its
 * midpoint on Y''s side. */
AVX2 static inline __m256 midpoint_side(__m256 q, __m256 hi, __m256 lo, __m256i near, const bf16_mean_consts *c)
{
    const __m256i qi = _mm256_castps_si256(q);
    const __m256i mid = _mm256_or_si256(_mm256_andnot_si256(_mm256_set1_epi32(0xffff), qi), _mm256_set1_epi32(0x8000));
    const __m256 km = _mm256_mul_ps(_mm256_castsi256_ps(mid), _mm256_set1_ps(c->k));
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(hi, km), lo);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 binade = _mm256_and_ps(km, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)));
    const __m256 r_scaled = _mm256_mul_ps(_mm256_andnot_ps(sign, r), _mm256_set1_ps(0x1p53f));
    const __m256 lost = _mm256_cmp_ps(r_scaled, binade, _CMP_LE_OQ);
    /* > 0 where Y' is above M in magnitude */
    const __m256 side = _mm256_andnot_ps(lost, _mm256_xor_ps(r, _mm256_and_ps(q, sign)));
    const __m256i above = _mm256_castps_si256(_mm256_cmp_ps(side, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(side, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256i moved = _mm256_add_epi32(_mm256_sub_epi32(mid, above), below); /* the masks are -1 */
    return _mm256_blendv_ps(q, _mm256_castsi256_ps(moved), _mm256_castsi256_ps(near));
}

/* Steps 1-4 on eight pairs into *z, scaled (a compile-time constant where
 * inlined) or not; or BLOCK_HUGE (unscaled only) or BLOCK_TINY. */
AVX2 static inline int bf16_mean_lanes(__m256 x, __m256 m, const bf16_mean_consts *c, int scaled, __m256 *z)
{
    const __m256 p = _mm256_mul_ps(m, _mm256_set1_ps(scaled ? c->km1_down : c->km1));
    const __m256 xs = scaled ? _mm256_mul_ps(x, _mm256_set1_ps(c->down)) : x;
    const __m256 hi = _mm256_add_ps(p, xs);
    const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(hi), _mm256_set1_epi32(0x7fffffff));
    if (!scaled) {
        const __m256i huge = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(HUGE_BITS - 1));
        if (!_mm256_testz_si256(huge, huge)) return BLOCK_HUGE;
    }
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(c->tiny), magnitude);
    const __m256i tiny = _mm256_andnot_si256(_mm256_cmpeq_epi32(magnitude, _mm256_setzero_si256()), small);
    if (!_mm256_testz_si256(tiny, tiny)) return BLOCK_TINY;

    const __m256 q = _mm256_mul_ps(hi, _mm256_set1_ps(c->one_over_k));
    const __m256i low = _mm256_and_si256(_mm256_castps_si256(q), _mm256_set1_epi32(0xffff));
    const __m256i half = _mm256_set1_epi32(0x8000);
    *z = q;
    if (c->pow2) {
        const __m256 lo = sum_error(p, xs, hi);
        const __m256i inexact = _mm256_castps_si256(_mm256_cmp_ps(lo, _mm256_setzero_ps(), _CMP_NEQ_OQ));
        const __m256i near = _mm256_and_si256(_mm256_cmpeq_epi32(low, half), inexact);
        if (!_mm256_testz_si256(near, near)) *z = midpoint_side(q, hi, lo, near, c);
    } else {
        const __m256i off = _mm256_abs_epi32(_mm256_sub_epi32(low, half));
        const __m256i near = _mm256_cmpgt_epi32(_mm256_set1_epi32(MIDPOINT_WINDOW + 1), off);
        if (!_mm256_testz_si256(near, near)) *z = midpoint_side(q, hi, sum_error(p, xs, hi), near, c);
    }
    if (scaled) *z = _mm256_mul_ps(*z, _mm256_set1_ps(c->up));
    return BLOCK_DONE;
}

/* The fast path's exactness test of hi = RN(p + x): p + x = hi exactly iff
 * hi - p == x and hi - x == p (of |p|, |x| the larger one's difference is
 * exact, so an inexact sum fails one of the two). Four instructions, where
 * TwoSum's error takes six. */
AVX2 static inline __m256i sum_is_exact(__m256 p, __m256 x, __m256 hi)
{
    return _mm256_castps_si256(_mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(hi, p), x, _CMP_EQ_OQ),
                                             _mm256_cmp_ps(_mm256_sub_ps(hi, x), p, _CMP_EQ_OQ)));
}

/* Steps 1-5 on eight elements at x and m into d (d may be either); returns
 * nonzero, storing nothing, where the block is tiny. The fast path is the
 * unscaled step 1, step 3, and step 4 without lo ("fast step 4" above); one
 * branch leaves it, for a sum at 2^127 or past it, a tiny mean, or a q on a
 * midpoint (k M = hi) with an inexact sum. */
AVX2 static inline int bf16_mean_block(uint16_t *d, const uint16_t *x, const uint16_t *m, const bf16_mean_consts *c)
{
    const __m256 xv = load_bf16(x), mv = load_bf16(m);
    const __m256 p = _mm256_mul_ps(mv, _mm256_set1_ps(c->km1));
    const __m256 hi = _mm256_add_ps(p, xv);
    __m256 q = _mm256_mul_ps(hi, _mm256_set1_ps(c->one_over_k));
    const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(hi), _mm256_set1_epi32(0x7fffffff));
    const __m256i huge = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(HUGE_BITS - 1));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(c->tiny), magnitude);
    const __m256i tiny = _mm256_andnot_si256(_mm256_cmpeq_epi32(magnitude, _mm256_setzero_si256()), small);
    const __m256i qi = _mm256_castps_si256(q);
    const __m256i low = _mm256_and_si256(qi, _mm256_set1_epi32(0xffff));
    const __m256i half = _mm256_set1_epi32(0x8000);
    __m256i doubt;
    if (c->k == 2.0f) {
        doubt = _mm256_setzero_si256(); /* step 3: q = RN(m + x) / 2 rounds as Y does */
    } else if (c->pow2) {
        /* q = hi / k exactly: on a midpoint it is Y, a tie, where the sum is exact */
        doubt = _mm256_andnot_si256(sum_is_exact(p, xv, hi), _mm256_cmpeq_epi32(low, half));
    } else {
        /* Fast step 4: M the midpoint above |q|'s bfloat16 truncation */
        const __m256i mid = _mm256_or_si256(_mm256_and_si256(qi, _mm256_set1_epi32(0x7fff0000)), half);
        const __m256 kmid = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_max_epu32(mid, _mm256_set1_epi32(MID_FLOOR))),
                                          _mm256_set1_ps(c->k));
        const __m256 r = _mm256_sub_ps(_mm256_castsi256_ps(magnitude), kmid);
        const __m256i off = _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_NEQ_OQ));
        const __m256i step = _mm256_and_si256(off, _mm256_or_si256(_mm256_srai_epi32(_mm256_castps_si256(r), 31),
                                                                    _mm256_set1_epi32(1)));
        const __m256i sign = _mm256_and_si256(qi, _mm256_set1_epi32((int)0x80000000u));
        q = _mm256_castsi256_ps(_mm256_or_si256(_mm256_add_epi32(mid, step), sign));
        doubt = _mm256_andnot_si256(_mm256_or_si256(off, sum_is_exact(p, xv, hi)), _mm256_cmpeq_epi32(off, off));
    }
    const __m256i odd = _mm256_or_si256(_mm256_or_si256(huge, tiny), doubt);
    if (_mm256_testz_si256(odd, odd)) {
        store_bf16_plain(d, q);
        return 0;
    }
    __m256 z;
    int found = bf16_mean_lanes(xv, mv, c, 0, &z);
    if (found == BLOCK_HUGE) found = bf16_mean_lanes(xv, mv, c, 1, &z);
    if (found == BLOCK_TINY) return 1;
    store_bf16_plain(d, z);
    return 0;
}

/* The tail (< LANES elements) through a zero-padded block; a tiny block is
 * folded again by the scalar arithmetic. */
#define BF16_MEAN_KERNEL(NAME, TARGET, LANES, BLOCK)                                  \
    TARGET static void NAME(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k) \
    {                                                                                 \
        const bf16_mean_consts c = bf16_mean_consts_for(k);                           \
        uint16_t bx[LANES] = {0}, bm[LANES] = {0}, bd[LANES];                         \
        for (size_t i = 0; i < count; i += LANES) {                                   \
            const size_t n = count - i < LANES ? count - i : LANES;                   \
            const uint16_t *xi = x + i, *mi = m + i;                                  \
            uint16_t *di = d + i;                                                     \
            if (n < LANES) {                                                          \
                memcpy(bx, xi, n * 2);                                                \
                memcpy(bm, mi, n * 2);                                                \
                xi = bx, mi = bm, di = bd;                                            \
            }                                                                         \
            if (BLOCK(di, xi, mi, &c)) {                                              \
                for (size_t j = 0; j < LANES; j++) bd[j] = rr_mean16_bf16(xi[j], mi[j], k); \
                if (n == LANES) memcpy(di, bd, sizeof bd);                            \
            }                                                                         \
            if (n < LANES) memcpy(d + i, bd, n * 2);                                  \
        }                                                                             \
    }

BF16_MEAN_KERNEL(bf16_mean, AVX2, 8, bf16_mean_block)

/* ------------------------------------------------------------ float16 mean fold in float32
 *
 * f16_mean above computes Y = (m (k-1) + x) / k in double and rounds it to
 * float16. For k < 2^13 that is RN16(Y), Y rounded once: the double sum is
 * exact (11 + 13 significant bits, between 2^28 and 2^-24), and Y, a multiple
 * of 2^-24 / k, is over a double ulp away from every float16 midpoint it is
 * not on, so the double quotient rounds as Y does. The same bits come from
 * float32 arithmetic, without the four conversions to and from double per
 * element that bound the double fold (tests/f16_mean_exhaustive.c checks
 * every pair of bit patterns for k = 2..8):
 *   1. P = m (k-1) is exact (11 + 13 bits); hi = RN(P + x), and TwoSum gives
 *      its error lo exactly: P + x = hi + lo.
 *   2. RO(Y), Y rounded to odd in float32, rounds to float16 as Y does
 *      (24 bits against 11, at least two more: Boldo & Melquiond, as for the
 *      double fold). RO(Y) is Y where exact, else whichever of Y's two
 *      float32 neighbours has last bit 1: from a neighbour q and the sign of
 *      Y - q, a q with last bit 0 moves one ulp (its bits +-1) towards Y.
 *   3. k a power of 2: q = hi / k is exact and Y - q = lo / k, at most half
 *      an ulp of q: q is a neighbour and lo gives the side. k = 2 needs not
 *      even that: lo != 0 only where x and m are 2^13 or more apart, and then
 *      q = RN(P + x) / 2 lies within a float32 ulp of half the larger, a
 *      float16 value 2^12 ulps from any midpoint, where Y rounds too.
 *   4. Other k (AVX-512 only: it needs FMA): q0 = RN(hi RN(1/k)) is within 3
 *      ulps of Y, r0 = RN(RN(hi - k q0) + lo) is k (Y - q0) to 2^-23
 *      relative, so q = RN(q0 + r0 RN(1/k)), Y to 2^-21 ulps, is a
 *      neighbour of Y (Markstein's correction step). hi - k q is exact (a
 *      multiple of ulp(q), below 4k of them), so the side of Y is the sign
 *      of RN(RN(hi - k q) + lo). A zero q takes hi's sign (q0 + 0 would
 *      lose a -0); a nonzero one has it already.
 *   5. A block with an inf or NaN (hi not finite) goes through the double
 *      fold again, which keeps its NaN payloads; so does every k >= 2^13.
 * Every element takes its k's steps, branch-free: a test like the bfloat16
 * fold's (q far from a midpoint needs no care) lost on random data, where
 * means fall exactly on midpoints often (a fourth of them at k = 4), and
 * skipping TwoSum where the sum is exact gained nothing measurable.
 * Every value here is 0 or between 2^-37 and 2^29 in magnitude: no
 * subnormal or overflow in float32. The products are exact or explicit FMAs,
 * so a compiler that fuses them changes no bit. */
#define F16_MEAN_F32_MAX_K (1 << 13)

typedef struct {
    float k, one_over_k, km1;
} f16_mean_consts;

/* Which steps a k takes: fixed per call, a constant in each kernel loop. */
enum { F16_K2, F16_POW2, F16_OTHER };

static f16_mean_consts f16_mean_consts_for(int k)
{
    return (f16_mean_consts){(float)k, 1.0f / (float)k, (float)(k - 1)};
}

static int f16_mean_kind(int k) { return k == 2 ? F16_K2 : (k & (k - 1)) == 0 ? F16_POW2 : F16_OTHER; }

/* Step 2: q's bits one step towards Y where its last bit is 0 and `side`,
 * the sign of Y - q (0 where exact), says Y is not q. */
AVX2 static inline __m256 to_odd(__m256 q, __m256 side)
{
    const __m256i qi = _mm256_castps_si256(q), one = _mm256_set1_epi32(1);
    const __m256i inexact = _mm256_castps_si256(_mm256_cmp_ps(side, _mm256_setzero_ps(), _CMP_NEQ_OQ));
    const __m256i even = _mm256_cmpeq_epi32(_mm256_and_si256(qi, one), _mm256_setzero_si256());
    /* +1 (away from zero) where side has q's sign, else -1 */
    const __m256i step = _mm256_or_si256(_mm256_srai_epi32(_mm256_xor_si256(_mm256_castps_si256(side), qi), 31), one);
    return _mm256_castsi256_ps(_mm256_add_epi32(qi, _mm256_and_si256(_mm256_and_si256(inexact, even), step)));
}

/* Steps 1 and 3 on eight elements, k a power of 2 (`kind` F16_K2 or
 * F16_POW2); returns nonzero, storing nothing, where one is inf or NaN. */
AVX2 static inline int f16_mean_block(uint16_t *d, const uint16_t *x, const uint16_t *m, const f16_mean_consts *c,
                                      const int kind)
{
    const __m256 xv = load_f16(x), mv = load_f16(m);
    const __m256 p = kind == F16_K2 ? mv : _mm256_mul_ps(mv, _mm256_set1_ps(c->km1));
    const __m256 hi = _mm256_add_ps(p, xv);
    const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(hi), _mm256_set1_epi32(0x7fffffff));
    const __m256i special = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f7fffff));
    if (!_mm256_testz_si256(special, special)) return 1;
    __m256 q = _mm256_mul_ps(hi, _mm256_set1_ps(c->one_over_k));
    if (kind != F16_K2) q = to_odd(q, sum_error(p, xv, hi)); /* step 3 */
    store_f16(d, q);
    return 0;
}

/* Step 5: eight elements with an inf or NaN, by the double arithmetic. */
AVX2 __attribute__((noinline)) static void f16_mean_refold(uint16_t *d, const uint16_t *x, const uint16_t *m, int k)
{
    const __m256d km1 = _mm256_set1_pd((double)(k - 1)), kd = _mm256_set1_pd((double)k);
    const __m256d inv = _mm256_set1_pd(1.0 / (double)k);
    store_f16(d, mean_step(load_f16(x), load_f16(m), km1, kd, inv, (k & (k - 1)) == 0));
}

/* The tail (< LANES elements) through a zero-padded block. */
#define F16_MEAN_LOOP(NAME, TARGET, LANES, BLOCK, REFOLD)                             \
    TARGET static inline void NAME(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k, \
                                   const int kind)                                    \
    {                                                                                 \
        const f16_mean_consts c = f16_mean_consts_for(k);                             \
        size_t i = 0;                                                                 \
        for (; i + LANES <= count; i += LANES)                                        \
            if (BLOCK(d + i, x + i, m + i, &c, kind)) REFOLD(d + i, x + i, m + i, k); \
        if (i < count) {                                                              \
            uint16_t bx[LANES] = {0}, bm[LANES] = {0}, bd[LANES];                     \
            memcpy(bx, x + i, (count - i) * 2);                                       \
            memcpy(bm, m + i, (count - i) * 2);                                       \
            if (BLOCK(bd, bx, bm, &c, kind)) REFOLD(bd, bx, bm, k);                   \
            memcpy(d + i, bd, (count - i) * 2);                                       \
        }                                                                             \
    }

F16_MEAN_LOOP(f16_mean_loop, AVX2, 8, f16_mean_block, f16_mean_refold)

/* k a power of 2 below 2^13 (the rest takes FMA: AVX-512 only). */
AVX2 static void f16_mean_f32(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k)
{
    if (k == 2) f16_mean_loop(d, x, m, count, k, F16_K2);
    else f16_mean_loop(d, x, m, count, k, F16_POW2);
}

/* ------------------------------------------------------------ AVX-512: sixteen a step
 *
 * The mean fold is bound by instruction count (each element is converted
 * four times), not memory, and bfloat16's rounding takes a dozen integer
 * instructions: zmm registers halve the instructions per element. The
 * arithmetic is the AVX2 kernels', with mask registers for the selects. */

#define AVX512 __attribute__((target("avx512f,avx2,f16c")))

AVX512 static inline __m512 load16_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

AVX512 static inline void store16_f16(uint16_t *p, __m512 v)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

AVX512 static inline __m512 load16_bf16(const uint16_t *p)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

AVX512 static inline void store16_bf16(uint16_t *p, __m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    out = _mm512_mask_or_epi32(out, nan, high, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(out));
}

AVX512 static inline __m256 to_float_odd512(__m512d y)
{
    const __m512i dropped_bits = _mm512_set1_epi64((1ll << 29) - 1);
    const __m512i u = _mm512_castpd_si512(y);
    const __mmask8 inexact = _mm512_test_epi64_mask(u, dropped_bits);
    const __m512i kept = _mm512_andnot_si512(dropped_bits, u);
    return _mm512_cvtpd_ps(_mm512_castsi512_pd(_mm512_mask_or_epi64(kept, inexact, kept, _mm512_set1_epi64(1ll << 29))));
}

/* a / k correctly rounded without vdivpd, whose throughput bounds the fold:
 * q0 = a * RN(1/k) is faithful, the remainder a - q0 * k is exact (FMA), and
 * one correction step gives RN(a / k) (Markstein's theorem; Muller et al.,
 * Handbook of Floating-Point Arithmetic, 2nd ed., 4.9). Our a is 0 or at
 * least 2^-149 in magnitude, far from double underflow. Where the remainder
 * is 0 (q0 exact: keeps -0's sign, which + 0 would lose) or NaN (a infinite
 * or NaN), q0 is the quotient. */
AVX512 static inline __m512d divide512(__m512d a, __m512d k, __m512d one_over_k, int k_is_power_of_2)
{
    const __m512d q0 = _mm512_mul_pd(a, one_over_k);
    if (k_is_power_of_2) return q0; /* exact */
    const __m512d rest = _mm512_fnmadd_pd(q0, k, a);
    const __m512d q = _mm512_fmadd_pd(rest, one_over_k, q0);
    return _mm512_mask_mov_pd(q0, _mm512_cmp_pd_mask(rest, _mm512_setzero_pd(), _CMP_NEQ_OQ), q);
}

AVX512 static inline __m512 mean_step512(__m512 x, __m512 mean, __m512d k_minus_1, __m512d k, __m512d one_over_k,
                                         int k_is_power_of_2)
{
    const __m256 mean_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mean), 1));
    const __m256 x_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    __m512d lo = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(mean)), k_minus_1),
                               _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    __m512d hi = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtps_pd(mean_hi), k_minus_1), _mm512_cvtps_pd(x_hi));
    lo = divide512(lo, k, one_over_k, k_is_power_of_2);
    hi = divide512(hi, k, one_over_k, k_is_power_of_2);
    const __m512d joined = _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(to_float_odd512(lo))),
                                              _mm256_castps_pd(to_float_odd512(hi)), 1);
    return _mm512_castpd_ps(joined);
}

AVX512 static void f16_mean512(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k)
{
    const __m512d km1 = _mm512_set1_pd((double)(k - 1)), kd = _mm512_set1_pd((double)k);
    const __m512d inv = _mm512_set1_pd(1.0 / (double)k);
    const int pow2 = (k & (k - 1)) == 0;
    uint16_t bx[16] = {0}, bm[16] = {0}, bd[16];
    for (size_t i = 0; i < count; i += 16) {
        const size_t n = count - i < 16 ? count - i : 16;
        if (n < 16) {
            memcpy(bx, x + i, n * 2);
            memcpy(bm, m + i, n * 2);
            store16_f16(bd, mean_step512(load16_f16(bx), load16_f16(bm), km1, kd, inv, pow2));
            memcpy(d + i, bd, n * 2);
        } else {
            store16_f16(d + i, mean_step512(load16_f16(x + i), load16_f16(m + i), km1, kd, inv, pow2));
        }
    }
}

/* The AVX2 bfloat16 fold's helpers with mask registers. */
AVX512 static inline void store16_bf16_plain(uint16_t *p, __m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i out = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(out));
}

AVX512 static inline __m512 sum_error512(__m512 p, __m512 x, __m512 hi)
{
    const __m512 xv = _mm512_sub_ps(hi, p), pv = _mm512_sub_ps(hi, xv);
    return _mm512_add_ps(_mm512_sub_ps(p, pv), _mm512_sub_ps(x, xv));
}

AVX512 static inline __m512 midpoint_side512(__m512 q, __m512 hi, __m512 lo, __mmask16 near, const bf16_mean_consts *c)
{
    const __m512i qi = _mm512_castps_si512(q);
    /* (q & 0xffff0000) | 0x8000 */
    const __m512i mid = _mm512_ternarylogic_epi32(qi, _mm512_set1_epi32((int)0xffff0000u),
                                                  _mm512_set1_epi32(0x8000), 0xea);
    const __m512 km = _mm512_mul_ps(_mm512_castsi512_ps(mid), _mm512_set1_ps(c->k));
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(hi, km), lo);
    const __m512 binade = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(km), _mm512_set1_epi32(0x7f800000)));
    const __m512 r_abs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0x7fffffff)));
    const __mmask16 lost = _mm512_cmp_ps_mask(_mm512_mul_ps(r_abs, _mm512_set1_ps(0x1p53f)), binade, _CMP_LE_OQ);
    /* r ^ (q & sign): > 0 where Y' is above M in magnitude */
    const __m512 side = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(r), qi,
                                                                      _mm512_set1_epi32((int)0x80000000u), 0x78));
    const __mmask16 moves = near & ~lost;
    const __mmask16 above = _mm512_mask_cmp_ps_mask(moves, side, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __mmask16 below = _mm512_mask_cmp_ps_mask(moves, side, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512i z = _mm512_mask_mov_epi32(qi, near, mid);
    z = _mm512_mask_add_epi32(z, above, z, _mm512_set1_epi32(1));
    z = _mm512_mask_sub_epi32(z, below, z, _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(z);
}

AVX512 static inline int bf16_mean_lanes512(__m512 x, __m512 m, const bf16_mean_consts *c, int scaled, __m512 *z)
{
    const __m512 p = _mm512_mul_ps(m, _mm512_set1_ps(scaled ? c->km1_down : c->km1));
    const __m512 xs = scaled ? _mm512_mul_ps(x, _mm512_set1_ps(c->down)) : x;
    const __m512 hi = _mm512_add_ps(p, xs);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(0x7fffffff));
    if (!scaled && _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(HUGE_BITS))) return BLOCK_HUGE;
    if (_mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)), _mm512_set1_epi32(c->tiny - 1)))
        return BLOCK_TINY;

    const __m512 q = _mm512_mul_ps(hi, _mm512_set1_ps(c->one_over_k));
    const __m512i low = _mm512_and_si512(_mm512_castps_si512(q), _mm512_set1_epi32(0xffff));
    *z = q;
    if (c->pow2) {
        const __m512 lo = sum_error512(p, xs, hi);
        const __mmask16 inexact = _mm512_cmp_ps_mask(lo, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        const __mmask16 near = _mm512_mask_cmpeq_epi32_mask(inexact, low, _mm512_set1_epi32(0x8000));
        if (near) *z = midpoint_side512(q, hi, lo, near, c);
    } else {
        const __m512i off = _mm512_sub_epi32(low, _mm512_set1_epi32(0x8000 - MIDPOINT_WINDOW));
        const __mmask16 near = _mm512_cmplt_epu32_mask(off, _mm512_set1_epi32(2 * MIDPOINT_WINDOW + 1));
        if (near) *z = midpoint_side512(q, hi, sum_error512(p, xs, hi), near, c);
    }
    if (scaled) *z = _mm512_mul_ps(*z, _mm512_set1_ps(c->up));
    return BLOCK_DONE;
}

AVX512 static inline __mmask16 sum_is_exact512(__m512 p, __m512 x, __m512 hi)
{
    return _mm512_cmp_ps_mask(_mm512_sub_ps(hi, p), x, _CMP_EQ_OQ) &
           _mm512_cmp_ps_mask(_mm512_sub_ps(hi, x), p, _CMP_EQ_OQ);
}

AVX512 static inline int bf16_mean_block512(uint16_t *d, const uint16_t *x, const uint16_t *m,
                                            const bf16_mean_consts *c)
{
    const __m512 xv = load16_bf16(x), mv = load16_bf16(m);
    const __m512 p = _mm512_mul_ps(mv, _mm512_set1_ps(c->km1));
    const __m512 hi = _mm512_add_ps(p, xv);
    __m512 q = _mm512_mul_ps(hi, _mm512_set1_ps(c->one_over_k));
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 huge = _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(HUGE_BITS));
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)),
                                                   _mm512_set1_epi32(c->tiny - 1));
    const __m512i qi = _mm512_castps_si512(q);
    const __m512i low = _mm512_and_si512(qi, _mm512_set1_epi32(0xffff));
    __mmask16 doubt;
    if (c->k == 2.0f) {
        doubt = 0; /* step 3 */
    } else if (c->pow2) {
        const __mmask16 on_mid = _mm512_cmpeq_epi32_mask(low, _mm512_set1_epi32(0x8000));
        doubt = on_mid & ~sum_is_exact512(p, xv, hi);
    } else {
        /* fast step 4: (q & 0x7fff0000) | 0x8000 */
        const __m512i mid =
            _mm512_ternarylogic_epi32(qi, _mm512_set1_epi32(0x7fff0000), _mm512_set1_epi32(0x8000), 0xea);
        const __m512 kmid = _mm512_castsi512_ps(_mm512_max_epu32(mid, _mm512_set1_epi32(MID_FLOOR)));
        const __m512 r = _mm512_fnmadd_ps(kmid, _mm512_set1_ps(c->k), _mm512_castsi512_ps(magnitude));
        const __mmask16 off = _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        const __m512i step = _mm512_or_si512(_mm512_srai_epi32(_mm512_castps_si512(r), 31), _mm512_set1_epi32(1));
        const __m512i z = _mm512_mask_add_epi32(mid, off, mid, step);
        /* z | (q & sign) */
        q = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(z, qi, _mm512_set1_epi32((int)0x80000000u), 0xf8));
        doubt = (__mmask16)~(off | sum_is_exact512(p, xv, hi));
    }
    if (!(huge | tiny | doubt)) {
        store16_bf16_plain(d, q);
        return 0;
    }
    __m512 z;
    int found = bf16_mean_lanes512(xv, mv, c, 0, &z);
    if (found == BLOCK_HUGE) found = bf16_mean_lanes512(xv, mv, c, 1, &z);
    if (found == BLOCK_TINY) return 1;
    store16_bf16_plain(d, z);
    return 0;
}

AVX512 static inline __m512 nan_first512(__m512 a, __m512 r)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
}
AVX512 static inline __m512 v_sum512(__m512 a, __m512 b) { return nan_first512(a, _mm512_add_ps(a, b)); }
AVX512 static inline __m512 v_prod512(__m512 a, __m512 b) { return nan_first512(a, _mm512_mul_ps(a, b)); }

AVX512 static inline __m512 v_min512(__m512 a, __m512 b)
{
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), b, a);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), r, b);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
}

AVX512 static inline __m512 v_max512(__m512 a, __m512 b)
{
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), b, a);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), r, b);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
}

#define BINARY_KERNEL512(NAME, LOAD, STORE, OP)                                       \
    AVX512 static void NAME(uint16_t *d, const uint16_t *x, const uint16_t *y, size_t count) \
    {                                                                                 \
        size_t i = 0;                                                                 \
        for (; i + 16 <= count; i += 16) STORE(d + i, OP(LOAD(x + i), LOAD(y + i)));  \
        if (i < count) {                                                              \
            uint16_t bx[16] = {0}, by[16] = {0}, bd[16];                              \
            memcpy(bx, x + i, (count - i) * 2);                                       \
            memcpy(by, y + i, (count - i) * 2);                                       \
            STORE(bd, OP(LOAD(bx), LOAD(by)));                                        \
            memcpy(d + i, bd, (count - i) * 2);                                       \
        }                                                                             \
    }

BINARY_KERNEL512(f16_sum512, load16_f16, store16_f16, v_sum512)
BINARY_KERNEL512(f16_prod512, load16_f16, store16_f16, v_prod512)
BINARY_KERNEL512(f16_min512, load16_f16, store16_f16, v_min512)
BINARY_KERNEL512(f16_max512, load16_f16, store16_f16, v_max512)
BINARY_KERNEL512(bf16_sum512, load16_bf16, store16_bf16, v_sum512)
BINARY_KERNEL512(bf16_prod512, load16_bf16, store16_bf16, v_prod512)
BINARY_KERNEL512(bf16_min512, load16_bf16, store16_bf16, v_min512)
BINARY_KERNEL512(bf16_max512, load16_bf16, store16_bf16, v_max512)

BF16_MEAN_KERNEL(bf16_mean512, AVX512, 16, bf16_mean_block512)

/* The float16 fold in float32 ("float16 mean fold in float32" above), every
 * k < 2^13. */
AVX512 static inline __m512 to_odd512(__m512 q, __m512 side)
{
    const __m512i qi = _mm512_castps_si512(q), one = _mm512_set1_epi32(1);
    const __mmask16 inexact = _mm512_cmp_ps_mask(side, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __mmask16 even = _mm512_mask_testn_epi32_mask(inexact, qi, one);
    const __m512i step = _mm512_or_si512(_mm512_srai_epi32(_mm512_xor_si512(_mm512_castps_si512(side), qi), 31), one);
    return _mm512_castsi512_ps(_mm512_mask_add_epi32(qi, even, qi, step));
}

/* Steps 2 and 4 from q = RN(hi RN(1/k)). */
AVX512 static inline __m512 f16_mean_steps512(__m512 q, __m512 hi, __m512 lo, const f16_mean_consts *c)
{
    const __m512 k = _mm512_set1_ps(c->k), inv = _mm512_set1_ps(c->one_over_k);
    const __m512 r0 = _mm512_add_ps(_mm512_fnmadd_ps(q, k, hi), lo);
    /* q | (hi & sign): hi's sign, which q + r0 / k loses where it is -0 */
    q = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(_mm512_fmadd_ps(r0, inv, q)),
                                                      _mm512_castps_si512(hi), _mm512_set1_epi32((int)0x80000000u),
                                                      0xf8));
    return to_odd512(q, _mm512_add_ps(_mm512_fnmadd_ps(q, k, hi), lo));
}

AVX512 static inline int f16_mean_block512(uint16_t *d, const uint16_t *x, const uint16_t *m, const f16_mean_consts *c,
                                           const int kind)
{
    const __m512 xv = load16_f16(x), mv = load16_f16(m);
    const __m512 p = kind == F16_K2 ? mv : _mm512_mul_ps(mv, _mm512_set1_ps(c->km1));
    const __m512 hi = _mm512_add_ps(p, xv);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(0x7fffffff));
    if (_mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f7fffff))) return 1;
    __m512 q = _mm512_mul_ps(hi, _mm512_set1_ps(c->one_over_k));
    if (kind != F16_K2) {
        const __m512 lo = sum_error512(p, xv, hi);
        q = kind == F16_POW2 ? to_odd512(q, lo) : f16_mean_steps512(q, hi, lo, c); /* step 3 or 4 */
    }
    store16_f16(d, q);
    return 0;
}

AVX512 __attribute__((noinline)) static void f16_mean_refold512(uint16_t *d, const uint16_t *x, const uint16_t *m,
                                                                int k)
{
    const __m512d km1 = _mm512_set1_pd((double)(k - 1)), kd = _mm512_set1_pd((double)k);
    const __m512d inv = _mm512_set1_pd(1.0 / (double)k);
    store16_f16(d, mean_step512(load16_f16(x), load16_f16(m), km1, kd, inv, (k & (k - 1)) == 0));
}

F16_MEAN_LOOP(f16_mean_loop512, AVX512, 16, f16_mean_block512, f16_mean_refold512)

/* Every k below 2^13. */
AVX512 static void f16_mean512_f32(uint16_t *d, const uint16_t *x, const uint16_t *m, size_t count, int k)
{
    switch (f16_mean_kind(k)) {
    case F16_K2: f16_mean_loop512(d, x, m, count, k, F16_K2); break;
    case F16_POW2: f16_mean_loop512(d, x, m, count, k, F16_POW2); break;
    default: f16_mean_loop512(d, x, m, count, k, F16_OTHER); break;
    }
}

typedef void binary_kernel(uint16_t *, const uint16_t *, const uint16_t *, size_t);
static binary_kernel *const binary_kernels[2][2][4] = {
    /* [AVX2, AVX-512][RR_FLOAT16, RR_BFLOAT16][RR_SUM, RR_PROD, RR_MIN, RR_MAX] */
    {{f16_sum, f16_prod, f16_min, f16_max}, {bf16_sum, bf16_prod, bf16_min, bf16_max}},
    {{f16_sum512, f16_prod512, f16_min512, f16_max512}, {bf16_sum512, bf16_prod512, bf16_min512, bf16_max512}},
};

#endif /* RR_HAVE_X86 */

int rr_reduce16_vec(void *dst, const void *a, const void *b, size_t count, rr_dtype dtype, rr_op op)
{
#ifdef RR_HAVE_X86
    if (!rr_avg_is_mean(dtype) || op < 0 || op >= RR_NUM_OPS) return -1;
    const rr_kernels16 level = rr_kernels16_current();
    if (level < RR_KERNELS16_AVX2) return -1;
    if (op == RR_AVG) op = RR_SUM; /* as reduce.c: a 16-bit avg in the ring folds means instead */
    binary_kernels[level == RR_KERNELS16_AVX512][dtype][op](dst, a, b, count);
    return 0;
#else
    (void)dst, (void)a, (void)b, (void)count, (void)dtype, (void)op;
    return -1;
#endif
}

int rr_mean_fold16_vec(void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype, int k)
{
#ifdef RR_HAVE_X86
    const rr_kernels16 level = rr_kernels16_current();
    if (!rr_avg_is_mean(dtype) || k < 2 || level < RR_KERNELS16_AVX2) return -1;
    if (dtype == RR_BFLOAT16 && k >= BF16_MEAN_MAX_K) return -1; /* the scalar loop: see "bfloat16 mean fold" */
    const int avx512 = level == RR_KERNELS16_AVX512;
    if (dtype == RR_BFLOAT16) (avx512 ? bf16_mean512 : bf16_mean)(dst, x, mean, count, k);
    else if (k < F16_MEAN_F32_MAX_K && avx512) f16_mean512_f32(dst, x, mean, count, k);
    else if (k < F16_MEAN_F32_MAX_K && (k & (k - 1)) == 0) f16_mean_f32(dst, x, mean, count, k); /* AVX2: no FMA */
    else (avx512 ? f16_mean512 : f16_mean)(dst, x, mean, count, k);
    return 0;
#else
    (void)dst, (void)x, (void)mean, (void)count, (void)dtype, (void)k;
    return -1;
#endif
}
