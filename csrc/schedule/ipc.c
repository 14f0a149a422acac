/* The IPC path: an allreduce of device buffers among ranks whose devices
 * can open each other's memory (one GPU, or GPUs of one host with peer
 * access; agreed by every rank first, ringreduce/core/device_ipc.py), device
 * to device, with no trip through host memory.
 *
 * Every device keeps a window (rr_device_ipc_window): device memory it
 * allocated and exported itself, grown only, so its handle stays valid
 * across operations whatever memory pool the caller's buffers come from.
 * Peers open it once per generation and cache it (rr_device_ipc_peer).
 *
 *   copy in    src -> own window (one device copy); wait
 *   handshake  every rank's window handle and status (a blob pass over
 *              the ring's links); open the peers' windows not yet open
 *   reduce     rank r folds chunk r (the ring's chunk table) out of every
 *              window, in the ring's order and operand roles, into its
 *              window's chunk r; wait
 *   handshake  every chunk is final in its owner's window
 *   gather     every chunk q from rank q's window into dst; wait
 *   handshake  nobody reads a window any more: the next operation may
 *              overwrite it
 *
 * The fold of chunk c is the host ring's (ring.c): the partial starts as
 * rank c+1's input, rank c+j folds its own input into it as reduce3(dst,
 * own, partial) (16-bit averages: mean_fold(dst, own, partial, k = j)),
 * the last fold is rank c's, and a sum-average divides at the end. Device
 * kernels give the host kernels' bits, so every rank ends with the bits the
 * host ring gives, NaN payloads included.
 *
 * The waits are host waits on this device's stream before each handshake,
 * so a peer never reads a window before its owner's work on it has run.
 * A rank whose device fails says so in the next handshake: every rank then
 * fails alike, naming it, and none is left waiting. A peer lost fails the
 * handshake's blob pass, as in any other collective.
 */
#include "schedule/ipc.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/reduce.h"

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define MESSAGE 240

typedef struct {
    int32_t code;             /* RR_OK, or this rank's error */
    char message[MESSAGE];    /* its text */
    rr_ipc_handle handle;     /* the first handshake: this rank's window */
} shake;

/* One handshake: this rank's status (and handle) to every rank. Fails, the
 * same on every rank, when any rank reports an error: its own message on
 * that rank, naming it on the others. */
static int handshake(rr_ring *ring, const rr_error *mine, const rr_ipc_handle *h, shake **all, rr_error *err)
{
    shake s;
    memset(&s, 0, sizeof s);
    s.code = mine->code;
    if (mine->code) snprintf(s.message, sizeof s.message, "%.*s", MESSAGE - 1, mine->msg);
    if (h) s.handle = *h;
    void *blobs = NULL;
    size_t *lens = calloc((size_t)ring->size, sizeof *lens);
    if (!lens) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    int rc = rr_exchange_blobs(ring, &s, sizeof s, NULL, 0, &blobs, lens, err);
    if (rc != RR_OK) {
        free(lens);
        return rc;
    }
    for (int q = 0; q < ring->size; q++) {
        if (lens[q] != sizeof s) {
            rr_set_error(err, RR_E_PROTOCOL, q, "rank %d's IPC handshake is %zu bytes, not %zu", q, lens[q], sizeof s);
            rc = err->code;
            break;
        }
    }
    const shake *got = blobs;
    for (int q = 0; rc == RR_OK && q < ring->size; q++) {
        if (!got[q].code) continue;
        if (q == ring->rank) *err = *mine;
        else rr_set_error(err, RR_E_DEVICE, q, "the IPC allreduce failed on rank %d: %.*s", q, MESSAGE - 1,
                          got[q].message);
        rc = err->code;
    }
    free(lens);
    if (rc == RR_OK && all) *all = blobs;
    else free(blobs);
    return rc;
}

/* Rank r's part between the first and second handshakes: chunk r folded
 * out of every window into its own (see above), then waited for. */
static int reduce_own_chunk(rr_device *dev, char *const *win, char *scratch, char *dst, const size_t *off,
                            const size_t *len, int N, int r, size_t esize, rr_dtype dtype, rr_op op, rr_error *err)
{
    const size_t count = len[r] / esize;
    const int mean = op == RR_AVG && rr_avg_is_mean(dtype);
    if (!count) return RR_OK;
    const char *acc = win[(r + 1) % N] + off[r];
    int rc = RR_OK;
    for (int j = 2; j <= N && rc == RR_OK; j++) {
        const char *own = win[(r + j) % N] + off[r];
        /* The last fold (rank r's own input) lands in place in the window
         * (dst = own is allowed); the others alternate between two scratch
         * chunks, so dst is never the partial it reads. */
        char *out = j == N ? win[r] + off[r] : j % 2 ? dst + off[r] : scratch;
        rc = mean ? rr_dev_mean_fold(dev, out, own, acc, count, dtype, j, err)
                  : rr_dev_reduce3(dev, out, own, acc, count, dtype, op, err);
        acc = out;
    }
    if (rc == RR_OK && op == RR_AVG && !mean) rc = rr_dev_divide(dev, win[r] + off[r], count, dtype, N, err);
    return rc == RR_OK ? rr_device_sync(dev, err) : rc;
}

int rr_allreduce_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                     rr_op op, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t esize = rr_dtype_size(dtype), bytes = count * esize;
    if (esize == 0 || op < 0 || op >= RR_NUM_OPS) {
        rr_set_error(err, RR_E_INVALID, -1, "unsupported dtype %d or op %d", (int)dtype, (int)op);
        return err->code;
    }
    if (N == 1 || bytes == 0) return rr_allreduce(ring, dev, src, dst, count, dtype, op, err);
    ring->phase_times[0] = ring->phase_times[1] = ring->phase_times[2] = monotonic_s();
    size_t *off = malloc(sizeof *off * (size_t)N), *len = malloc(sizeof *len * (size_t)N);
    char **win = calloc((size_t)N, sizeof *win);
    shake *all = NULL;
    if (!off || !len || !win) {
        free(off);
        free(len);
        free(win);
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    size_t at = 0, longest = 0;
    for (int i = 0; i < N; i++) {
        off[i] = at;
        len[i] = rr_chunk_count(count, N, i) * esize;
        at += len[i];
        if (len[i] > longest) longest = len[i];
    }
    const size_t scratch_at = (bytes + 255) / 256 * 256;

    /* Copy in. A local failure travels in the handshake, so every rank stops alike. */
    rr_error local = {0};
    int rc = dev->ops->begin(dev, &local);
    if (rc == RR_OK) rc = rr_device_ipc_window(dev, scratch_at + longest, &local);
    if (rc == RR_OK) rc = rr_dev_copy(dev, dev->window.ptr, src, bytes, &local);
    if (rc == RR_OK) rc = rr_device_sync(dev, &local);
    if ((rc = handshake(ring, &local, &dev->window.handle, &all, err)) != RR_OK) goto out;

    for (int q = 0; q < N && local.code == RR_OK; q++)
        win[q] = q == r ? dev->window.ptr : rr_device_ipc_peer(dev, &all[q].handle, &local);
    if (local.code == RR_OK)
        reduce_own_chunk(dev, win, (char *)dev->window.ptr + scratch_at, dst, off, len, N, r, esize, dtype, op,
                         &local);
    if ((rc = handshake(ring, &local, NULL, NULL, err)) != RR_OK) goto out;
    ring->phase_times[1] = monotonic_s(); /* every chunk reduced: the gather starts */

    for (int q = 0; q < N && local.code == RR_OK; q++)
        if (len[q]) rr_dev_copy(dev, (char *)dst + off[q], win[q] + off[q], len[q], &local);
    if (local.code == RR_OK) rr_device_sync(dev, &local);
    rc = handshake(ring, &local, NULL, NULL, err);
    ring->phase_times[2] = monotonic_s();
out:
    if (rc != RR_OK) {
        rr_error ignored;
        rr_device_sync(dev, &ignored); /* nothing left in flight on the windows */
    }
    free(all);
    free(off);
    free(len);
    free(win);
    return rc;
}
