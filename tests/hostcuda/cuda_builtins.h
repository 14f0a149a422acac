/* The few CUDA built-ins csrc/kernels/cuda/reduce.cu uses, so that g++ compiles its
 * kernels for the host (tests/hostcuda/driver.cpp launches them).
 *
 * The kernels share nothing between threads (no shared memory, no
 * barriers): each thread walks its own grid-stride loop, so running the
 * threads of a grid one after another computes what the GPU computes.
 */
#ifndef HOSTCUDA_CUDA_BUILTINS_H
#define HOSTCUDA_CUDA_BUILTINS_H

#include <cstddef>
#include <cstdint>

#define __global__
#define __device__
#define __host__

struct uint3 { unsigned x, y, z; };
typedef uint3 dim3;

/* reduce.cu's float32 division as a GPU computes it: any NaN result is the
 * canonical NaN 0x7fffffff, whatever the operands' payloads (x86 keeps
 * one), so kernels that must keep a payload are checked here too. */
inline float hostcuda_fdiv(float a, float b)
{
    float q = a / b;
    if (q != q) {
        const uint32_t canonical = 0x7fffffffu;
        __builtin_memcpy(&q, &canonical, sizeof q);
    }
    return q;
}
#define RR_CUDA_FDIV(a, b) hostcuda_fdiv((a), (b))

/* Set by the launcher for the thread it is running. */
extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;

#endif
