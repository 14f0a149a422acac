/* Element-wise arithmetic of the reductions, written once.
 *
 * Plain C99 static inline functions and macros, so the CPU kernels (reduce.c)
 * and the CUDA kernels (cuda/reduce.cu, which defines RR_DEVICE) compile the
 * very same arithmetic: the CPU tests check what the GPU runs.
 *
 * 16-bit floats (IEEE half, bfloat16) are widened to float32, combined, and
 * rounded back once, to nearest even.
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
    RR_NUM_DTYPES
} rr_dtype;

typedef enum {
    RR_SUM = 0,
    RR_PROD = 1,
    RR_MIN = 2,
    RR_MAX = 3,
    RR_AVG = 4, /* sum on the wire, one division at the end */
    RR_NUM_OPS
} rr_op;

RR_INLINE size_t rr_dtype_size(rr_dtype t)
{
    switch (t) {
    case RR_FLOAT16: case RR_BFLOAT16: return 2;
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
    uint32_t u = rr_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
    if (em >= 0x7c00u) bits = 0x7f800000u | ((uint32_t)(em & 0x3ffu) << 13); /* inf, nan */
    return rr_bits_f32(sign | bits);
}

RR_INLINE uint16_t rr_f32_to_f16(float f)
{
    uint32_t u = rr_f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint16_t out;
    if (u > 0x7f800000u) {                /* NaN: keep it quiet */
        out = (uint16_t)(0x7e00u | ((u >> 13) & 0x3ffu));
    } else if (u >= 0x477ff000u) {        /* rounds to >= 65520: infinity */
        out = 0x7c00u;
    } else if (u < 0x38800000u) {         /* below 2^-14: subnormal or zero */
        /* Adding 0.5 aligns the half subnormal's bits at the bottom of the
         * float mantissa; the FPU rounds to nearest even for us. */
        float g = rr_bits_f32(u) + 0.5f;
        out = (uint16_t)(rr_f32_bits(g) - rr_f32_bits(0.5f));
    } else {                              /* normal: rebias, round to nearest even */
        uint32_t mant_odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd;
        out = (uint16_t)(u >> 13);
    }
    return (uint16_t)(out | sign);
}

/* min/max as numpy.minimum/maximum: a NaN in either operand wins. */
#define RR_FMIN(a, b) (((a) != (a)) ? (a) : ((b) != (b)) ? (b) : ((a) < (b) ? (a) : (b)))
#define RR_FMAX(a, b) (((a) != (a)) ? (a) : ((b) != (b)) ? (b) : ((a) > (b) ? (a) : (b)))
#define RR_IMIN(a, b) ((a) < (b) ? (a) : (b))
#define RR_IMAX(a, b) ((a) > (b) ? (a) : (b))

#endif
