/* What the ring needs from an accelerator to run on buffers in its memory.
 *
 * The ring schedule (ring.c) stays the same for device buffers; only where
 * bytes sit changes. Sends leave from a pinned host mirror, received
 * segments land in pinned staging slots, and everything between host and
 * device is queued here: copies both ways and the reduction kernels, in
 * order on one stream. A ticket marks the work queued so far; asking whether
 * a ticket is done (or waiting for it) is how the ring learns that a segment
 * may be sent or a slot reused. The network moves one segment while the
 * device copies and reduces the one before it.
 *
 * Two implementations: CUDA through the driver API (cuda_device.c, loaded at
 * run time, so the package needs no CUDA to build or import), and an emulated
 * device in host memory (device_emulated.c) whose work runs late and whose
 * pointers fault on the host, so tests here catch any ordering mistake.
 */
#ifndef RINGREDUCE_DEVICE_H
#define RINGREDUCE_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/reduce_math.h"
#include "common/error.h"

typedef struct rr_device rr_device;

/* All but alloc/free/destroy queue work on the device's stream and return
 * RR_OK or an error code with err filled. */
typedef struct rr_device_ops {
    /* Makes the device usable from the calling thread (CUDA: its context). */
    int (*begin)(rr_device *d, rr_error *err);
    int (*to_host)(rr_device *d, void *host, const void *dev, size_t n, rr_error *err);
    int (*to_device)(rr_device *d, void *dev, const void *host, size_t n, rr_error *err);
    int (*copy)(rr_device *d, void *dst, const void *src, size_t n, rr_error *err);
    /* dst = a OP b over count elements (RR_AVG reduces as RR_SUM); dst may be a. */
    int (*reduce3)(rr_device *d, void *dst, const void *a, const void *b, size_t count, rr_dtype dtype,
                   rr_op op, rr_error *err);
    /* dst = running mean of x into mean (k-th contribution), as rr_mean_fold. */
    int (*mean_fold)(rr_device *d, void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype,
                     int k, rr_error *err);
    /* buf /= n, as rr_divide does it. */
    int (*divide)(rr_device *d, void *buf, size_t count, rr_dtype dtype, int n, rr_error *err);
    /* A ticket (> 0) for the work queued so far; 0 on error. */
    uint64_t (*mark)(rr_device *d, rr_error *err);
    /* 1 when the work up to ticket has finished, 0 when not yet (only if
     * !wait), or a negative error code. */
    int (*done)(rr_device *d, uint64_t ticket, int wait, rr_error *err);
    void *(*host_alloc)(rr_device *d, size_t n); /* pinned */
    void (*host_free)(rr_device *d, void *p);
    void *(*dev_alloc)(rr_device *d, size_t n);
    void (*dev_free)(rr_device *d, void *p);
    void (*destroy)(rr_device *d);
} rr_device_ops;

#define RR_DEVICE_SLOTS 4

struct rr_device {
    const rr_device_ops *ops;
    /* Kept between operations, grown on demand (rr_device_reserve). */
    char *mirror;         /* pinned: the host copy sends leave from */
    size_t mirror_bytes;
    char *staging;        /* pinned: RR_DEVICE_SLOTS receive slots */
    char *scratch;        /* device: where a slot goes up to be reduced */
    size_t slot_bytes;
};

/* Makes the mirror hold at least mirror_bytes and the slots slot_bytes each. */
int rr_device_reserve(rr_device *d, size_t mirror_bytes, size_t slot_bytes, rr_error *err);
/* Frees the buffers, then the device. */
void rr_device_destroy(rr_device *d);

/* Waits for everything queued so far. */
int rr_device_sync(rr_device *d, rr_error *err);

/* patience: how many times a ticket is asked about before its work runs
 * (0: only when waited for); see device_emulated.c. */
rr_device *rr_emulated_device_create(int patience);
/* ordinal: the CUDA device; functions: CUfunction handles of the kernels in
 * csrc/kernels/cuda/reduce.cu, reduce[dtype][op] (sum, prod, min, max), divide[dtype]
 * and mean[dtype] (float16, bfloat16). NULL with err filled when CUDA cannot be loaded. */
rr_device *rr_cuda_device_create(int ordinal, void *const reduce[RR_NUM_DTYPES][4],
                                 void *const divide[RR_NUM_DTYPES], void *const mean[RR_NUM_MEAN_DTYPES],
                                 rr_error *err);

#endif
