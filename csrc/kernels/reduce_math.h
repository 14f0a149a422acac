/* Element-wise arithmetic of the reductions, written once.
 *
 * Plain C99 static inline functions and macros, so the CPU kernels (reduce.c)
 * and the CUDA kernels (cuda/reduce.cu, which defines RR_DEVICE) compile the
 * very same arithmetic: the CPU tests check what the GPU runs.
 *
 * 16-bit floats (IEEE half, bfloat16) are widened to float32, combined, and
 * rounded back once, to nearest even. Their averages are running means
 * computed in double (rr_mean16_f16/bf16 below; docs/architecture.md).
 */
#ifndef RINGREDUCE_REDUCE_MATH_H
#define RINGREDUCE_REDUCE_MATH_H

#ifdef __CUDACC_RTC__
/* NVRTC (cupy.RawModule) ships no C library headers; cupy puts CUDA's own
 * C++ library (CCCL) on its include path, and memcpy is a built-in there. */
#include <cuda/std/cstdint>
#else
#include <stdint.h>
#include <string.h>
#endif

#ifndef RR_DEVICE
#define RR_DEVICE
#endif
#define RR_INLINE static inline RR_DEVICE

/* Wire and kernel codes; the Python binding maps numpy dtypes onto these. */
typedef enum {
    RR_FLOAT16 = 0,
    RR_BFLOAT16 = 1,
    RR_FLOAT32 = 2,
    RR_FLOAT64 = 3,
    RR_INT8 = 4,
    RR_UINT8 = 5,
    RR_INT32 = 6,
    RR_INT64 = 7,
    RR_INT16 = 8, /* a code never changes (Python and the CUDA kernels use them): a new dtype takes the next */
    RR_UINT16 = 9,
    RR_NUM_DTYPES
} rr_dtype;

typedef enum {
    RR_SUM = 0,
    RR_PROD = 1,
    RR_MIN = 2,
    RR_MAX = 3,
    RR_AVG = 4, /* sum on the wire, one division at the end; 16-bit floats:
                 * a running mean on the wire, no division (rr_avg_is_mean) */
    RR_NUM_OPS
} rr_op;

RR_INLINE size_t rr_dtype_size(rr_dtype t)
{
    switch (t) {
    case RR_FLOAT16: case RR_BFLOAT16: case RR_INT16: case RR_UINT16: return 2;
    case RR_FLOAT32: case RR_INT32: return 4;
    case RR_FLOAT64: case RR_INT64: return 8;
    case RR_INT8: case RR_UINT8: return 1;
    default: return 0;
    }
}

RR_INLINE uint32_t rr_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
RR_INLINE float rr_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bfloat16: the top half of a float32; round to nearest even, keep NaN quiet. */
RR_INLINE float rr_bf16_to_f32(uint16_t h) { return rr_bits_f32((uint32_t)h << 16); }
RR_INLINE uint16_t rr_f32_to_bf16(float f)
{
    const uint32_t u = rr_f32_bits(f);
    const uint32_t nan = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded); /* a select: loops vectorize */
}

/* IEEE half <-> float32, branch-light bit arithmetic (exact, subnormals
 * included) so the loops stay vectorizable without F16C. */
RR_INLINE float rr_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    /* Normal and subnormal: shift exponent+mantissa into place and rescale by
     * 2^112 (the exponent bias difference); a float multiply handles subnormals. */
    float mag = rr_bits_f32(em << 13) * rr_bits_f32(0x77800000u); /* 2^112 */
    uint32_t bits = rr_f32_bits(mag);
    bits = em >= 0x7c00u ? 0x7f800000u | ((uint32_t)(em & 0x3ffu) << 13) : bits; /* inf, nan */
    return rr_bits_f32(sign | bits);
}

RR_INLINE uint16_t rr_f32_to_f16(float f)
{
    const uint32_t all = rr_f32_bits(f);
    const uint32_t sign = (all >> 16) & 0x8000u, u = all & 0x7fffffffu;
    /* Every case computed, one chosen by selects (no branches: loops vectorize).
     * NaN: keep it quiet. Normal: rebias, round to nearest even. Below 2^-14
     * (subnormal or zero): adding 0.5 aligns the half subnormal's bits at the
     * bottom of the float mantissa and the FPU rounds to nearest even for us. */
    const uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);
    const uint32_t normal = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    const uint32_t subnormal = rr_f32_bits(rr_bits_f32(u) + 0.5f) - rr_f32_bits(0.5f);
    uint32_t out = u < 0x38800000u ? subnormal : normal;
    out = u >= 0x477ff000u ? 0x7c00u : out; /* rounds to >= 65520: infinity */
    out = u > 0x7f800000u ? nan : out;
    return (uint16_t)(out | sign);
}

/* double -> a 16-bit float with `mbits` mantissa and `ebits` exponent bits,
 * rounded once, to nearest even, straight from the double's bits. (Through
 * float32 it could round twice: a double just above a 16-bit tie rounds to
 * float32 exactly onto the tie, which then goes to even, maybe downward.)
 * Integer arithmetic only, so a GPU gives the CPU's bits. */
RR_INLINE uint16_t rr_f64_to_16(double x, int mbits, int ebits)
{
    uint64_t u;
    memcpy(&u, &x, 8);
    const uint16_t sign = (uint16_t)((u >> 63) << 15);
    u &= 0x7fffffffffffffffull;
    const int bias = (1 << (ebits - 1)) - 1, drop = 52 - mbits;
    const uint16_t inf = (uint16_t)(((1u << ebits) - 1u) << mbits);
    if (u > 0x7ff0000000000000ull) /* NaN: keep it quiet, and the top of its payload */
        return (uint16_t)(sign | inf | (1u << (mbits - 1)) | ((u >> drop) & ((1u << mbits) - 1u)));
    const int e = (int)(u >> 52) - 1023;
    if (e > bias) return (uint16_t)(sign | inf);
    if (e >= 1 - bias) { /* normal: rebias, round; a carry out of the top gives inf */
        u -= (uint64_t)(1023 - bias) << 52;
        u += ((uint64_t)1 << (drop - 1)) - 1u + ((u >> drop) & 1u);
        return (uint16_t)(sign | (u >> drop));
    }
    /* Subnormal or zero: the count of smallest subnormals, 2^(1 - bias - mbits). */
    const int shift = drop + 1 - bias - e;
    if (shift > 53) return sign; /* below half the smallest subnormal (doubles' subnormals too) */
    const uint64_t m = (u & 0xfffffffffffffull) | ((uint64_t)1 << 52);
    const uint64_t q = m >> shift, rest = m & (((uint64_t)1 << shift) - 1u), half = (uint64_t)1 << (shift - 1);
    return (uint16_t)(sign | (q + (rest > half || (rest == half && (q & 1u)))));
}
RR_INLINE uint16_t rr_f64_to_f16(double x) { return rr_f64_to_16(x, 10, 5); }
RR_INLINE uint16_t rr_f64_to_bf16(double x) { return rr_f64_to_16(x, 7, 8); }

/* Averages of 16-bit floats travel as running means, never as sums, so no
 * partial result leaves the type's range (a float16 sum of 40000 + 40000 is
 * inf). The fold that adds the k-th contribution x to the mean of the first
 * k-1 computes (mean * (k-1) + x) / k in double and rounds once. The product
 * is exact in double (11 significant bits times k-1 < 2^31), so a compiler
 * that fuses it with the add (FMA, as GPU compilers do) changes no bit. */
#define RR_NUM_MEAN_DTYPES 2 /* RR_FLOAT16 and RR_BFLOAT16, codes 0 and 1 */
RR_INLINE int rr_avg_is_mean(rr_dtype t) { return t == RR_FLOAT16 || t == RR_BFLOAT16; }
RR_INLINE double rr_mean_step(double mean, double x, int k) { return (mean * (double)(k - 1) + x) / (double)k; }
RR_INLINE uint16_t rr_mean16_f16(uint16_t x, uint16_t mean, int k)
{
    return rr_f64_to_f16(rr_mean_step((double)rr_f16_to_f32(mean), (double)rr_f16_to_f32(x), k));
}
RR_INLINE uint16_t rr_mean16_bf16(uint16_t x, uint16_t mean, int k)
{
    return rr_f64_to_bf16(rr_mean_step((double)rr_bf16_to_f32(mean), (double)rr_bf16_to_f32(x), k));
}

/* min/max as numpy.minimum/maximum: a NaN in either operand wins. */
#define RR_FMIN(a, b) (((a) != (a)) ? (a) : ((b) != (b)) ? (b) : ((a) < (b) ? (a) : (b)))
#define RR_FMAX(a, b) (((a) != (a)) ? (a) : ((b) != (b)) ? (b) : ((a) > (b) ? (a) : (b)))
/* 16-bit sums and products: a NaN in a wins, as in min/max. With one NaN
 * operand the hardware returns it whatever the order; with two, the first
 * operand's, and a compiler may swap a commutative add's operands: so the
 * portable and vector kernels, and ranks on different CPUs, agree only with
 * this select. */
#define RR_NAN_FIRST(a, r) (((a) != (a)) ? (a) : (r))
#define RR_IMIN(a, b) ((a) < (b) ? (a) : (b))
#define RR_IMAX(a, b) ((a) > (b) ? (a) : (b))

#endif
