/* The IPC path (ipc.c): an allreduce of device buffers, device to device,
 * among ranks whose devices open each other's memory. */
#ifndef RINGREDUCE_IPC_H
#define RINGREDUCE_IPC_H

#include "schedule/ring.h"

/* As rr_allreduce on device buffers, with the host ring's bits, where every
 * rank of the ring agreed on the IPC path (each one's device opens every
 * other's windows; ringreduce/core/device_ipc.py). dst may be src. A rank's
 * device failure fails the operation on every rank, naming that rank. */
int rr_allreduce_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                     rr_op op, rr_error *err);

#endif
