/* The IPC path (ipc.c): collectives of device buffers, device to device,
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
/* The same for the other collectives, as their rr_* namesakes in ring.h
 * (reduce-scatter: chunk `rank` of dst; allgather and broadcast in place):
 * each reads its peers' windows, device to device. */
int rr_reduce_scatter_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                          rr_op op, rr_error *err);
int rr_allgather_ipc(rr_ring *ring, rr_device *dev, void *buf, const size_t *nbytes, rr_error *err);
int rr_broadcast_ipc(rr_ring *ring, rr_device *dev, void *buf, size_t nbytes, int root, rr_error *err);

/* The small allreduce over IPC: as rr_allreduce_small (ring.h), in one
 * pass whose blobs carry the header and where each rank's input lies on
 * the device; every rank then folds every rank's input in rank order
 * (rr_reduce_in_order's bits: the host's small paths') straight into dst.
 * If any header differs from ours, *agreed is 0, nothing is reduced, and
 * *all/lens hold every rank's blob (caller frees *all; each is a header
 * with this path's status after it). slot_bytes: the size the ring's small
 * window is made for at first (its small limit), so it need not grow.
 * Called holding the device; lets it go (hold) while it waits on peers. */
int rr_allreduce_small_ipc(rr_ring *ring, rr_device *dev, const void *head, size_t hlen, const void *src, void *dst,
                           size_t count, size_t slot_bytes, rr_dtype dtype, rr_op op, const rr_device_hold *hold,
                           int *agreed, void **all, size_t *lens, rr_error *err);

/* The IPC path's end on a ring (its close; collective: every rank of the
 * ring calls it, a ring that agreed on IPC): on each of the devices this
 * rank ran the ring's IPC collectives on, the peers' windows only this ring
 * used are closed; a handshake; then this rank's small window for the ring
 * goes, and the retired windows only it waited for. So no window is freed
 * while a peer has it open or reads it, the last small allreduce's
 * included. Called without the devices: holds[i] takes and lets go
 * devs[i]. Fails, freeing nothing of the ring's (the devices free it when
 * they go), where the handshake fails. */
int rr_ipc_release(rr_ring *ring, rr_device *const *devs, int ndevs, const rr_device_hold *holds, rr_error *err);

#endif
