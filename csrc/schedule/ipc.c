/* The IPC path: collectives of device buffers among ranks whose devices
 * can open each other's memory (one GPU, or GPUs of one host with peer
 * access; agreed by every rank first, ringreduce/core/device_ipc.py), device
 * to device, with no trip through host memory.
 *
 * Every device keeps a window (rr_device_ipc_window): device memory it
 * allocated and exported itself, grown only, so its handle stays valid
 * across operations whatever memory pool the caller's buffers come from.
 * Peers open it once per generation and cache it (rr_device_ipc_peer); a
 * grown window's old one is freed once every ring whose peers may have it
 * open has had a handshake after the new one's (device/ipc_windows.c).
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
 * kernels give the host kernels' bits except which NaN a sum or product of
 * NaNs is (CUDA's canonical one), so every rank ends with the host ring's
 * bits up to that, and every rank with the same bits (each chunk is reduced
 * once, then only copied).
 *
 * reduce-scatter is the allreduce without its gather (this rank's chunk
 * copied out of its window; two handshakes), allgather copies this rank's
 * block into its window and then every other block out of its owner's,
 * broadcast copies the root's buffer into the root's window and out of it
 * on every other rank.
 *
 * A small allreduce (rr_allreduce_small_ipc) takes one pass instead of
 * three handshakes: its blobs are the operation's headers, each with where
 * that rank's input lies (its ring's small window, rr_ipc_small: a slot of
 * two, used in turn). Each rank copies its input into its slot and waits,
 * then, in the pass, learns every rank's slot, and folds every rank's input
 * in rank order straight into its dst (the host small paths' fold and bits:
 * rr_reduce_in_order). No pass is needed after the fold: a rank writes a
 * slot again two operations later, after a pass that every peer entered
 * only once done reading it. The last operation's slots are still read
 * after it returns: a ring's small windows are freed only with the ring, by
 * rr_ipc_release, whose handshake comes after every peer closed them. A
 * failure before the pass fails every rank alike, naming the rank.
 * A window not yet opened by the peers (new, or grown) says so in the pass:
 * every rank opens it and a handshake follows, so an open that fails fails
 * every rank, and after which a grown window's old one (which every peer
 * closed on opening the new) is freed. One in the fold fails that rank,
 * whose peers' results do not depend on it; it aborts its transport, so
 * their next operation names it. While it waits on its peers (the pass,
 * that handshake) the operation lets its device go (rr_device_hold): two
 * rings on one device, run by two threads in either order on different
 * ranks, never wait on each other.
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
        else rr_set_error(err, RR_E_DEVICE, q, "the IPC collective failed on rank %d: %.*s", q, MESSAGE - 1,
                          got[q].message);
        rc = err->code;
    }
    free(lens);
    if (rc == RR_OK && all) *all = blobs;
    else free(blobs);
    return rc;
}

/* Rank r's part between the first and second handshakes: chunk r folded
 * out of every window into its own (see above); the phase's end waits. */
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
    return rc;
}

/* An IPC operation's frame: the chunk table (offsets, lengths), the peers'
 * windows once open, and the status of this rank's own work so far. */
typedef struct {
    size_t *off, *len;
    char **win;
    rr_error local;
    int passed; /* a handshake after the first: every peer opened this rank's window */
} frame;

static int frame_init(rr_ring *ring, frame *f, rr_error *err)
{
    const int N = ring->size;
    memset(f, 0, sizeof *f);
    f->off = calloc((size_t)N, sizeof *f->off);
    f->len = calloc((size_t)N, sizeof *f->len);
    f->win = calloc((size_t)N, sizeof *f->win);
    if (f->off && f->len && f->win) return RR_OK;
    free(f->off);
    free(f->len);
    free(f->win);
    rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
    return err->code;
}

/* Copy in and the first handshake: the window made to hold `need` bytes,
 * [at, at + n) of src copied to the same place in it (n may be 0), waited
 * for; then every rank's handle, and the peers' windows opened (cached). */
static int open_phase(rr_ring *ring, rr_device *dev, frame *f, size_t need, const char *src, size_t at, size_t n,
                      rr_error *err)
{
    shake *all = NULL;
    int rc = dev->ops->begin(dev, &f->local);
    if (rc == RR_OK) rc = rr_device_ipc_window(dev, ring->id, need ? need : 1, &f->local);
    if (rc == RR_OK && n) rc = rr_dev_copy(dev, (char *)dev->window.ptr + at, src + at, n, &f->local);
    if (rc == RR_OK) rc = rr_device_sync(dev, &f->local);
    if ((rc = handshake(ring, &f->local, &dev->window.handle, &all, err)) != RR_OK) return rc;
    for (int q = 0; q < ring->size && f->local.code == RR_OK; q++)
        f->win[q] = q == ring->rank ? dev->window.ptr : rr_device_ipc_peer(dev, &all[q].handle, ring->id, &f->local);
    free(all);
    return RR_OK;
}

/* A phase's end: this rank's queued work waited for, then a handshake.
 * The first one tells this rank that every peer opened its window (and
 * closed any older one it had open: rr_device_ipc_passed). */
static int phase_end(rr_ring *ring, rr_device *dev, frame *f, rr_error *err)
{
    if (f->local.code == RR_OK) rr_device_sync(dev, &f->local);
    int rc = handshake(ring, &f->local, NULL, NULL, err);
    if (rc == RR_OK && !f->passed) rr_device_ipc_passed(dev, ring->id);
    f->passed = 1;
    return rc;
}

static int frame_end(rr_device *dev, frame *f, int rc)
{
    if (rc != RR_OK) {
        rr_error ignored;
        rr_device_sync(dev, &ignored); /* nothing left in flight on the windows */
    }
    free(f->off);
    free(f->len);
    free(f->win);
    return rc;
}

static int check_reduction(rr_dtype dtype, rr_op op, rr_error *err)
{
    if (rr_dtype_size(dtype) && op >= 0 && op < RR_NUM_OPS) return RR_OK;
    rr_set_error(err, RR_E_INVALID, -1, "unsupported dtype %d or op %d", (int)dtype, (int)op);
    return err->code;
}

/* allreduce (gather = 1) or reduce-scatter (gather = 0: only chunk r of dst
 * is written). */
static int reduce_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                      rr_op op, int gather, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t esize = rr_dtype_size(dtype), bytes = count * esize;
    frame f;
    if (frame_init(ring, &f, err)) return err->code;
    size_t at = 0, longest = 0;
    for (int i = 0; i < N; i++) {
        f.off[i] = at;
        f.len[i] = rr_chunk_count(count, N, i) * esize;
        at += f.len[i];
        if (f.len[i] > longest) longest = f.len[i];
    }
    const size_t scratch_at = (bytes + 255) / 256 * 256;
    int rc = open_phase(ring, dev, &f, scratch_at + longest, src, 0, bytes, err);
    if (rc != RR_OK) return frame_end(dev, &f, rc);
    if (f.local.code == RR_OK)
        reduce_own_chunk(dev, f.win, (char *)dev->window.ptr + scratch_at, dst, f.off, f.len, N, r, esize, dtype,
                         op, &f.local);
    if (!gather) { /* this rank's chunk is all it keeps */
        if (f.local.code == RR_OK && f.len[r])
            rr_dev_copy(dev, (char *)dst + f.off[r], f.win[r] + f.off[r], f.len[r], &f.local);
        return frame_end(dev, &f, phase_end(ring, dev, &f, err));
    }
    if ((rc = phase_end(ring, dev, &f, err)) != RR_OK) return frame_end(dev, &f, rc);
    ring->phase_times[1] = monotonic_s(); /* every chunk reduced: the gather starts */
    for (int q = 0; q < N && f.local.code == RR_OK; q++)
        if (f.len[q]) rr_dev_copy(dev, (char *)dst + f.off[q], f.win[q] + f.off[q], f.len[q], &f.local);
    return frame_end(dev, &f, phase_end(ring, dev, &f, err));
}

int rr_allreduce_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                     rr_op op, rr_error *err)
{
    if (check_reduction(dtype, op, err)) return err->code;
    if (ring->size == 1 || count == 0) return rr_allreduce(ring, dev, src, dst, count, dtype, op, err);
    ring->phase_times[0] = ring->phase_times[1] = monotonic_s();
    int rc = reduce_ipc(ring, dev, src, dst, count, dtype, op, 1, err);
    ring->phase_times[2] = monotonic_s();
    return rc;
}

int rr_reduce_scatter_ipc(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                          rr_op op, rr_error *err)
{
    if (check_reduction(dtype, op, err)) return err->code;
    if (ring->size == 1 || count == 0) return rr_reduce_scatter(ring, dev, src, dst, count, dtype, op, err);
    return reduce_ipc(ring, dev, src, dst, count, dtype, op, 0, err);
}

int rr_allgather_ipc(rr_ring *ring, rr_device *dev, void *buf, const size_t *nbytes, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    size_t total = 0;
    for (int i = 0; i < N; i++) total += nbytes[i];
    if (N == 1 || total == 0) return rr_allgather(ring, dev, buf, nbytes, err);
    frame f;
    if (frame_init(ring, &f, err)) return err->code;
    for (int i = 0; i < N; i++) {
        f.off[i] = i ? f.off[i - 1] + nbytes[i - 1] : 0;
        f.len[i] = nbytes[i];
    }
    int rc = open_phase(ring, dev, &f, total, buf, f.off[r], f.len[r], err);
    if (rc != RR_OK) return frame_end(dev, &f, rc);
    for (int q = 0; q < N && f.local.code == RR_OK; q++)
        if (q != r && f.len[q]) rr_dev_copy(dev, (char *)buf + f.off[q], f.win[q] + f.off[q], f.len[q], &f.local);
    return frame_end(dev, &f, phase_end(ring, dev, &f, err));
}

int rr_broadcast_ipc(rr_ring *ring, rr_device *dev, void *buf, size_t nbytes, int root, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    if (N == 1 || nbytes == 0) return RR_OK;
    frame f;
    if (frame_init(ring, &f, err)) return err->code;
    int rc = open_phase(ring, dev, &f, nbytes, buf, 0, r == root ? nbytes : 0, err);
    if (rc != RR_OK) return frame_end(dev, &f, rc);
    if (r != root && f.local.code == RR_OK) rr_dev_copy(dev, buf, f.win[root], nbytes, &f.local);
    return frame_end(dev, &f, phase_end(ring, dev, &f, err));
}

/* The small allreduce's blob after its header: this rank's status and
 * where its input lies (window and offset). */
typedef struct {
    int32_t code;
    int32_t fresh; /* a window its peers have not opened yet: every rank opens, then a handshake */
    char message[MESSAGE];
    rr_ipc_handle handle;
    uint64_t offset;
} small_shake;

/* out = in[0] OP ... OP in[n-1] on the device, as rr_reduce_in_order on the
 * host (the same operand roles, 16-bit averages as running means). */
static int fold_in_rank_order(rr_device *dev, char *out, char *const *in, int n, size_t count, rr_dtype dtype,
                              rr_op op, rr_error *err)
{
    const int mean = op == RR_AVG && rr_avg_is_mean(dtype);
    int rc = n == 1 ? rr_dev_copy(dev, out, in[0], count * rr_dtype_size(dtype), err) : RR_OK;
    for (int i = 1; i < n && rc == RR_OK; i++) {
        const char *acc = i == 1 ? in[0] : out;
        rc = mean ? rr_dev_mean_fold(dev, out, in[i], acc, count, dtype, i + 1, err)
                  : rr_dev_reduce3(dev, out, acc, in[i], count, dtype, op, err);
    }
    if (rc == RR_OK && op == RR_AVG && !mean) rc = rr_dev_divide(dev, out, count, dtype, n, err);
    return rc;
}

int rr_allreduce_small_ipc(rr_ring *ring, rr_device *dev, const void *head, size_t hlen, const void *src, void *dst,
                           size_t count, size_t slot_bytes, rr_dtype dtype, rr_op op, const rr_device_hold *hold,
                           int *agreed, void **all, size_t *lens, rr_error *err)
{
    *agreed = 0;
    *all = NULL;
    if (check_reduction(dtype, op, err)) return err->code;
    const int N = ring->size, r = ring->rank;
    const size_t bytes = count * rr_dtype_size(dtype);
    rr_error local = {0};
    rr_ipc_small *w = NULL;
    small_shake mine;
    memset(&mine, 0, sizeof mine);
    if (dev->ops->begin(dev, &local) == RR_OK &&
        (w = rr_device_ipc_small(dev, ring->id, bytes > slot_bytes ? bytes : slot_bytes, &local))) {
        mine.handle = w->window.handle;
        mine.offset = (w->ops & 1) * w->slot;
        mine.fresh = !w->announced;
        if ((!bytes || rr_dev_copy(dev, (char *)w->window.ptr + mine.offset, src, bytes, &local) == RR_OK))
            rr_device_sync(dev, &local);
    }
    mine.code = local.code;
    if (local.code) snprintf(mine.message, sizeof mine.message, "%.*s", MESSAGE - 1, local.msg);
    rr_device_let_go(hold); /* another ring's operation on this device may run while this one waits */
    int rc = rr_exchange_blobs(ring, head, hlen, &mine, sizeof mine, all, lens, err);
    rr_device_take(hold);
    if (rc != RR_OK) return rc;
    small_shake *got = calloc((size_t)N, sizeof *got);
    char **in = calloc((size_t)N, sizeof *in);
    if (!got || !in) {
        free(got);
        free(in);
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    size_t at = 0;
    int same = 1;
    for (int q = 0; q < N; q++) {
        const char *blob = (const char *)*all + at;
        if (lens[q] != hlen + sizeof mine || memcmp(blob, head, hlen)) same = 0;
        else memcpy(&got[q], blob + hlen, sizeof mine); /* blobs lie back to back, unaligned */
        at += lens[q];
    }
    if (!same) { /* another collective or path on some rank: the caller says which, nothing was read */
        free(got);
        free(in);
        return RR_OK;
    }
    *agreed = 1;
    free(*all);
    *all = NULL;
    for (int q = 0; q < N && rc == RR_OK; q++) {
        if (!got[q].code) continue;
        if (q == r) *err = local;
        else rr_set_error(err, RR_E_DEVICE, q, "the IPC collective failed on rank %d: %.*s", q, MESSAGE - 1,
                          got[q].message);
        rc = err->code;
    }
    int fresh = 0;
    for (int q = 0; q < N && rc == RR_OK; q++) {
        char *base = q == r ? w->window.ptr : local.code ? NULL : rr_device_ipc_peer(dev, &got[q].handle, ring->id,
                                                                                    &local);
        in[q] = base ? base + got[q].offset : NULL;
        fresh |= got[q].fresh;
    }
    /* A window opened for the first time may fail to open (another GPU, IPC
     * refused): every rank hears it and fails alike, naming the rank. */
    if (rc == RR_OK && fresh) {
        rr_device_let_go(hold);
        rc = handshake(ring, &local, NULL, NULL, err);
        rr_device_take(hold);
        if (rc == RR_OK) rr_device_ipc_small_passed(dev, w); /* every peer opened the new window, closed the old */
    }
    if (rc == RR_OK && local.code == RR_OK && count) fold_in_rank_order(dev, dst, in, N, count, dtype, op, &local);
    if (rc == RR_OK) {
        rr_error ignored;
        rr_device_sync(dev, local.code ? &ignored : &local);
        w->ops++;
        w->announced = !local.code;
        if (local.code) { /* the peers' results are whole; their next operation hears of this rank */
            if (local.rank < 0) local.rank = r;
            *err = local;
            if (ring->transport) ring->transport->ops->abort(ring->transport, err);
            rc = err->code;
        }
    }
    free(got);
    free(in);
    return rc;
}

int rr_ipc_release(rr_ring *ring, rr_device *const *devs, int ndevs, const rr_device_hold *holds, rr_error *err)
{
    rr_error mine = {0};
    for (int i = 0; i < ndevs; i++) {
        rr_device_take(&holds[i]);
        if (devs[i]->ops->begin(devs[i], &mine) == RR_OK) rr_device_ipc_close_ring(devs[i], ring->id);
        rr_device_let_go(&holds[i]);
    }
    int rc = ring->size > 1 ? handshake(ring, &mine, NULL, NULL, err) : RR_OK;
    if (rc != RR_OK) return rc; /* a peer may still have them open: they go with the device */
    for (int i = 0; i < ndevs; i++) {
        rr_device_take(&holds[i]);
        rr_error ignored;
        if (devs[i]->ops->begin(devs[i], &ignored) == RR_OK) rr_device_ipc_release_ring(devs[i], ring->id);
        rr_device_let_go(&holds[i]);
    }
    return RR_OK;
}
