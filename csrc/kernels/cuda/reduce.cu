/* CUDA reduction and cast kernels for GPU buffers.
 *
 * The element-wise arithmetic is reduce_math.h, the very header the CPU
 * kernels (reduce.c) compile: RR_DEVICE makes its inline functions callable
 * on the device, so the CPU tests check what the GPU runs. 16-bit floats
 * are widened to float32, combined, and rounded back once; their averages
 * are running means in double (rr_mean_<dtype>, below).
 *
 * Kernels are extern "C" with plain names, so the same source serves nvcc
 * (setup.py, RINGREDUCE_CUDA=1) and cupy.RawModule (compiled at run time by
 * ringreduce/cuda.py). One kernel per (dtype, op): a grid-stride loop over
 * 16-byte vectors, then a scalar tail.
 */
#define RR_DEVICE __host__ __device__
#include "../reduce_math.h"

/* float32 division as the GPU does it, which gives the canonical NaN for a
 * NaN operand (x86 keeps the operand's payload). The host build of these
 * kernels (tests/hostcuda/cuda_builtins.h) defines it to do the same, so a
 * kernel that counts on the payload fails there as it would on a GPU. */
#ifndef RR_CUDA_FDIV
#define RR_CUDA_FDIV(a, b) ((a) / (b))
#endif

namespace {

struct Sum { template <class T> __device__ static T apply(T a, T b) { return a + b; } };
struct Prod { template <class T> __device__ static T apply(T a, T b) { return a * b; } };
struct FMin { template <class T> __device__ static T apply(T a, T b) { return RR_FMIN(a, b); } };
struct FMax { template <class T> __device__ static T apply(T a, T b) { return RR_FMAX(a, b); } };
struct IMin { template <class T> __device__ static T apply(T a, T b) { return RR_IMIN(a, b); } };
struct IMax { template <class T> __device__ static T apply(T a, T b) { return RR_IMAX(a, b); } };

/* Integer sums and products wrap like numpy's: computed unsigned. */
template <class UT> struct WrapSum {
    template <class T> __device__ static T apply(T a, T b) { return (T)((UT)a + (UT)b); }
};
template <class UT> struct WrapProd {
    template <class T> __device__ static T apply(T a, T b) { return (T)((UT)a * (UT)b); }
};

/* How one stored element is combined: natively, or widened to float32. */
template <class T, class Op> struct Native {
    __device__ static T combine(T a, T b) { return Op::apply(a, b); }
};
template <class Op> struct Half {
    __device__ static uint16_t combine(uint16_t a, uint16_t b)
    {
        return rr_f32_to_f16(Op::apply(rr_f16_to_f32(a), rr_f16_to_f32(b)));
    }
};
template <class Op> struct BHalf {
    __device__ static uint16_t combine(uint16_t a, uint16_t b)
    {
        return rr_f32_to_bf16(Op::apply(rr_bf16_to_f32(a), rr_bf16_to_f32(b)));
    }
};

/* dst[i] = a[i] OP b[i]; dst may alias a. 16-byte loads where all three
 * pointers allow them, one element at a time for the rest. */
template <class T, class C>
__device__ void reduce3(T *dst, const T *a, const T *b, size_t count)
{
    constexpr int V = 16 / sizeof(T);
    struct alignas(16) Vec { T v[V]; };
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    size_t start = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t vec_count = 0;
    if ((((uintptr_t)dst | (uintptr_t)a | (uintptr_t)b) & 15) == 0) {
        vec_count = count / V;
        Vec *d = reinterpret_cast<Vec *>(dst);
        const Vec *x = reinterpret_cast<const Vec *>(a), *y = reinterpret_cast<const Vec *>(b);
        for (size_t i = start; i < vec_count; i += stride) {
            Vec p = x[i], q = y[i], r;
#pragma unroll
            for (int k = 0; k < V; k++) r.v[k] = C::combine(p.v[k], q.v[k]);
            d[i] = r;
        }
    }
    for (size_t i = vec_count * V + start; i < count; i += stride) dst[i] = C::combine(a[i], b[i]);
}

template <class T>
__device__ void floor_divide(T *buf, size_t count, int n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        long long v = (long long)buf[i], q = v / n, r = v % n;
        buf[i] = (T)((r != 0 && r < 0) ? q - 1 : q);
    }
}

} // namespace

#define RR_REDUCE_KERNEL(NAME, T, ...)                                                     \
    extern "C" __global__ void NAME(T *dst, const T *a, const T *b, size_t count)          \
    {                                                                                      \
        reduce3<T, __VA_ARGS__>(dst, a, b, count);                                         \
    }

template <class Op> using F32 = Native<float, Op>;
template <class Op> using F64 = Native<double, Op>;

/* rr_reduce_<dtype>_<op>: the names ringreduce/cuda.py asks for. C combines
 * one stored element pair given an Op; integers wrap in the unsigned UT. */
#define RR_FLOAT_KERNELS(DT, T, C)                                                         \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_sum, T, C<Sum>)                                      \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_prod, T, C<Prod>)                                    \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_min, T, C<FMin>)                                     \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_max, T, C<FMax>)
#define RR_INT_KERNELS(DT, T, UT)                                                          \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_sum, T, Native<T, WrapSum<UT>>)                      \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_prod, T, Native<T, WrapProd<UT>>)                    \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_min, T, Native<T, IMin>)                             \
    RR_REDUCE_KERNEL(rr_reduce_##DT##_max, T, Native<T, IMax>)

RR_FLOAT_KERNELS(float16, uint16_t, Half)
RR_FLOAT_KERNELS(bfloat16, uint16_t, BHalf)
RR_FLOAT_KERNELS(float32, float, F32)
RR_FLOAT_KERNELS(float64, double, F64)
RR_INT_KERNELS(int8, int8_t, uint8_t)
RR_INT_KERNELS(uint8, uint8_t, uint8_t)
RR_INT_KERNELS(int32, int32_t, uint32_t)
RR_INT_KERNELS(int64, int64_t, uint64_t)
RR_INT_KERNELS(int16, int16_t, uint32_t) /* uint32_t: uint16_t promotes to int, which 65535 * 65535 overflows */
RR_INT_KERNELS(uint16, uint16_t, uint32_t)

/* Element-wise conversions: casts for compression, and the 16-bit divides. */
struct ToF16 { __device__ static uint16_t apply(float x) { return rr_f32_to_f16(x); } };
struct ToBF16 { __device__ static uint16_t apply(float x) { return rr_f32_to_bf16(x); } };
struct FromF16 { __device__ static float apply(uint16_t h) { return rr_f16_to_f32(h); } };
struct FromBF16 { __device__ static float apply(uint16_t h) { return rr_bf16_to_f32(h); } };

namespace {
template <class To, class From, class F>
__device__ void convert(To *dst, const From *src, size_t count)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        dst[i] = F::apply(src[i]);
}

/* 16-bit floats divide in float32 and round once, as reduce.c does. A NaN
 * stays the operand's NaN, as on the CPU: the GPU's division returns the
 * canonical NaN instead (RR_CUDA_FDIV), and narrowing quiets either alike. */
template <class Widen, class Narrow>
__device__ void divide16(uint16_t *buf, size_t count, int n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const float x = Widen::apply(buf[i]);
        buf[i] = Narrow::apply(RR_NAN_FIRST(x, RR_CUDA_FDIV(x, (float)n)));
    }
}

template <class T>
__device__ void divide_float(T *buf, size_t count, int n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) buf[i] /= (T)n;
}
} // namespace

namespace {
/* dst = (mean * (k-1) + x) / k in double, rounded once: reduce.c's rr_mean_fold.
 * Scalar loads: the double arithmetic, not the memory, bounds it. */
struct MeanF16 { __device__ static uint16_t apply(uint16_t x, uint16_t m, int k) { return rr_mean16_f16(x, m, k); } };
struct MeanBF16 { __device__ static uint16_t apply(uint16_t x, uint16_t m, int k) { return rr_mean16_bf16(x, m, k); } };

template <class Step>
__device__ void mean_fold(uint16_t *dst, const uint16_t *x, const uint16_t *mean, size_t count, int k)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        dst[i] = Step::apply(x[i], mean[i], k);
}
} // namespace

/* One fold of a 16-bit average; dst may be x or mean. */
extern "C" __global__ void rr_mean_float16(uint16_t *dst, const uint16_t *x, const uint16_t *mean, size_t count, int k)
{
    mean_fold<MeanF16>(dst, x, mean, count, k);
}
extern "C" __global__ void rr_mean_bfloat16(uint16_t *dst, const uint16_t *x, const uint16_t *mean, size_t count, int k)
{
    mean_fold<MeanBF16>(dst, x, mean, count, k);
}

/* The division that finishes an average, as reduce.c's rr_divide. */
extern "C" __global__ void rr_divide_float16(uint16_t *buf, size_t count, int n) { divide16<FromF16, ToF16>(buf, count, n); }
extern "C" __global__ void rr_divide_bfloat16(uint16_t *buf, size_t count, int n) { divide16<FromBF16, ToBF16>(buf, count, n); }
extern "C" __global__ void rr_divide_float32(float *buf, size_t count, int n) { divide_float(buf, count, n); }
extern "C" __global__ void rr_divide_float64(double *buf, size_t count, int n) { divide_float(buf, count, n); }
extern "C" __global__ void rr_divide_int8(int8_t *buf, size_t count, int n) { floor_divide(buf, count, n); }
extern "C" __global__ void rr_divide_uint8(uint8_t *buf, size_t count, int n) { floor_divide(buf, count, n); }
extern "C" __global__ void rr_divide_int32(int32_t *buf, size_t count, int n) { floor_divide(buf, count, n); }
extern "C" __global__ void rr_divide_int64(int64_t *buf, size_t count, int n) { floor_divide(buf, count, n); }
extern "C" __global__ void rr_divide_int16(int16_t *buf, size_t count, int n) { floor_divide(buf, count, n); }
extern "C" __global__ void rr_divide_uint16(uint16_t *buf, size_t count, int n) { floor_divide(buf, count, n); }

/* Compression casts: float32 <-> float16 / bfloat16, rounding to nearest even. */
extern "C" __global__ void rr_cast_float32_to_float16(uint16_t *dst, const float *src, size_t count)
{
    convert<uint16_t, float, ToF16>(dst, src, count);
}
extern "C" __global__ void rr_cast_float32_to_bfloat16(uint16_t *dst, const float *src, size_t count)
{
    convert<uint16_t, float, ToBF16>(dst, src, count);
}
extern "C" __global__ void rr_cast_float16_to_float32(float *dst, const uint16_t *src, size_t count)
{
    convert<float, uint16_t, FromF16>(dst, src, count);
}
extern "C" __global__ void rr_cast_bfloat16_to_float32(float *dst, const uint16_t *src, size_t count)
{
    convert<float, uint16_t, FromBF16>(dst, src, count);
}
