/* What the ring needs from an accelerator to run on buffers in its memory.
 *
 * The ring stays the host ring for device buffers: it runs in place on a
 * pinned host mirror of the buffer (ring.c, "the staged path"), so it keeps
 * every host path (copying, zero-copy, Cross Memory Attach) and the host
 * kernels' bits. The device only moves whole chunks: each comes down to the
 * mirror once, in the order the ring first needs it (a ticket each), and
 * each final chunk goes back up as soon as the ring has finished it; one
 * wait at the end. All of that is queued here, in order on one stream: a
 * ticket marks the work queued so far, and asking whether a ticket is done
 * (or waiting for it) is how the ring learns that a chunk is on the host.
 * Small messages go through a pinned bounce buffer kept per device
 * (rr_device_bounce): one copy down, one copy up.
 *
 * Where every rank's device opens every other's memory (CUDA IPC), an
 * allreduce runs device to device instead (csrc/schedule/ipc.c): each device
 * keeps an exported window (rr_device_ipc_window) and the peers' windows it
 * opened (rr_device_ipc_peer), and reduces with its own kernels; which are
 * freed or closed when is ipc_windows.c's.
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

/* A device allocation another process on the host can open (CUDA IPC): the
 * exporter (owner: unique per process and device), which of its windows
 * (generation: a new one each time it grows), their size, and the
 * implementation's handle bytes (CUDA: a CUipcMemHandle). */
typedef struct rr_ipc_handle {
    uint64_t owner, generation, bytes;
    unsigned char data[64];
} rr_ipc_handle;

/* An exported allocation of this device and its handle (ptr NULL: none). */
typedef struct rr_ipc_window {
    void *ptr;
    rr_ipc_handle handle;
} rr_ipc_window;

/* The rings (rr_ring.id) something of a device's IPC state is kept for. */
typedef struct rr_ring_set {
    uint64_t *id;
    int n;
} rr_ring_set;

/* A ring's window for the one-pass small allreduce over IPC (ipc.c,
 * rr_allreduce_small_ipc): two slots of `slot` bytes, used in turn, one per
 * operation (ops counts them). A window that had to grow stays `retired`
 * until every peer has opened the new one (and so closed the old one). */
typedef struct rr_ipc_small {
    uint64_t ring;          /* rr_ring.id */
    size_t slot;
    unsigned long long ops;
    int announced;          /* the peers have opened this window (an operation on it succeeded) */
    rr_ipc_window window, retired;
} rr_ipc_small;

/* How an operation that waits on its peers lets the device go meanwhile
 * (fn(ctx, 0)) and takes it back (fn(ctx, 1)), so that another thread's
 * operation on another ring of the same device runs in between. fn NULL:
 * the caller keeps the device throughout. */
typedef struct rr_device_hold {
    void (*fn)(void *ctx, int hold);
    void *ctx;
} rr_device_hold;

static inline void rr_device_let_go(const rr_device_hold *h) { if (h && h->fn) h->fn(h->ctx, 0); }
static inline void rr_device_take(const rr_device_hold *h) { if (h && h->fn) h->fn(h->ctx, 1); }

/* The longest device identity (rr_device_ops.ipc_identity), NUL included. */
#define RR_IPC_IDENTITY 128

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
    /* CUDA IPC (ipc.c), all NULL where the device has none. ipc_identity
     * writes what two ranks compare to know they can open each other's
     * memory (the GPU's UUID), or fails when this device refuses IPC.
     * ipc_export allocates n bytes of device memory that other processes
     * can open and fills the handle's data (ipc_unexport frees it);
     * ipc_open maps a peer's export here, ipc_close unmaps it. ipc_reaches
     * says whether this device's kernels can read the memory of the device
     * of that identity (itself, or another GPU with peer access). */
    int (*ipc_identity)(rr_device *d, char out[RR_IPC_IDENTITY], rr_error *err);
    int (*ipc_reaches)(rr_device *d, const char *identity);
    void *(*ipc_export)(rr_device *d, size_t n, rr_ipc_handle *h, rr_error *err);
    void (*ipc_unexport)(rr_device *d, void *p, const rr_ipc_handle *h);
    void *(*ipc_open)(rr_device *d, const rr_ipc_handle *h, rr_error *err);
    void (*ipc_close)(rr_device *d, void *p, const rr_ipc_handle *h);
} rr_device_ops;

/* What a device has been asked to do since it was made: every call below
 * that queues work counts (a testing hook, ringreduce._core.Device.counts,
 * and how tests bound the operations a collective costs). */
typedef struct rr_device_counts {
    unsigned long long copies;  /* to_host, to_device, copy: the work the ring queues */
    unsigned long long events;  /* mark: a ticket (an event recorded) */
    unsigned long long waits;   /* done(wait = 1): the host blocked on a ticket */
    unsigned long long host_copies; /* of copies, to_host and to_device: trips through host memory */
    unsigned long long kernels; /* reduce3, mean_fold, divide */
    unsigned long long ipc_opens; /* ipc_open: a peer's window mapped here */
    unsigned long long ipc_exports; /* ipc_export: this device's window (re)made */
    unsigned long long unpinned; /* host_alloc blocks the driver would not pin: pageable, slower copies */
} rr_device_counts;

/* Small messages in flight at once through one device (threads, process
 * sets); one more waits its turn elsewhere (the caller's fallback). */
#define RR_BOUNCE_SLOTS 8

struct rr_device {
    const rr_device_ops *ops;
    /* Kept between operations, grown on demand, pinned. */
    char *mirror;         /* the host copy the ring runs on (rr_device_reserve) */
    size_t mirror_bytes;
    struct {              /* small messages' trip through the host (rr_device_bounce) */
        char *buf;
        size_t bytes;
        int busy;
    } bounce[RR_BOUNCE_SLOTS];
    rr_device_counts counts;
    /* The IPC path (ipc_windows.c). This device's window (grown only) and
     * the rings whose peers may have it open; a window replaced by a larger
     * one stays retired until each of the rings it waits for has shown that
     * its peers closed it (rr_device_ipc_passed, rr_device_ipc_release_ring). */
    rr_ipc_window window;
    rr_ring_set window_rings;
    struct rr_ipc_retired {
        rr_ipc_window window;
        rr_ring_set waiting;
    } *retired;
    int nretired;
    rr_ipc_small **small; /* the one-pass small allreduces' windows, one per ring (ipc.c) */
    int nsmall;
    /* peers' windows open here, one per owner, with the rings whose
     * operations opened or used it: closed when the owner's window is
     * replaced or when every one of those rings is released */
    struct rr_ipc_peer {
        rr_ipc_handle handle;
        void *ptr;
        rr_ring_set rings;
    } *peers;
    int npeers;
};

/* Makes the mirror hold at least mirror_bytes. */
int rr_device_reserve(rr_device *d, size_t mirror_bytes, rr_error *err);
/* Takes a free bounce buffer holding at least bytes (grown only: small
 * messages allocate nothing once one of their size has passed) and returns
 * its slot, until rr_device_bounce_release; -1 with err filled when out of
 * memory, -2 when every slot is taken. Not thread safe: the caller
 * serializes calls on one device. */
int rr_device_bounce(rr_device *d, size_t bytes, rr_error *err);
void rr_device_bounce_release(rr_device *d, int slot);
/* The IPC path's windows and peers (ipc_windows.c). Not thread safe: the
 * caller holds the device.
 *
 * rr_device_ipc_window makes this device's exported window hold at least
 * bytes for ring `ring` (whose peers will open it): grown only, a new
 * generation each time; the old one retired, waiting for every ring whose
 * peers may have it open. */
int rr_device_ipc_window(rr_device *d, uint64_t ring, size_t bytes, rr_error *err);
/* A handshake of `ring` after one in which its peers learned this device's
 * window: every peer of the ring has opened the current window, so closed
 * any older one; retired windows no other ring waits for are freed. */
void rr_device_ipc_passed(rr_device *d, uint64_t ring);
/* Ring `ring`'s small window (rr_ipc_small) with slots of at least
 * slot_bytes: made on first use, replaced when too small (the old one
 * retired, freed by rr_device_ipc_small_passed). The pointer stays valid
 * until the ring is released. NULL with err filled when it cannot be made. */
rr_ipc_small *rr_device_ipc_small(rr_device *d, uint64_t ring, size_t slot_bytes, rr_error *err);
/* Every peer of the small window's ring has opened its current window
 * (a handshake after the pass that announced it): the retired one goes. */
void rr_device_ipc_small_passed(rr_device *d, rr_ipc_small *s);
/* A peer's window mapped here for ring `ring`: opened once per handle (its
 * owner, generation and the implementation's bytes: a restarted process
 * that reuses a pid never gets another's mapping) and cached; another
 * handle of the same owner closes the old mapping first. NULL with err
 * filled when it cannot be opened. */
void *rr_device_ipc_peer(rr_device *d, const rr_ipc_handle *h, uint64_t ring, rr_error *err);
/* A ring's end, in two steps around a handshake of the ring (ipc.c,
 * rr_ipc_release): close_ring closes the peers' windows only that ring
 * used; after the handshake (every peer closed ours) release_ring frees
 * the ring's small window and the retired windows only it waited for. */
void rr_device_ipc_close_ring(rr_device *d, uint64_t ring);
void rr_device_ipc_release_ring(rr_device *d, uint64_t ring);
/* Everything of the IPC path's, closed and freed (rr_device_destroy). */
void rr_device_ipc_destroy(rr_device *d);

/* Frees the buffers, then the device. */
void rr_device_destroy(rr_device *d);

/* Waits for everything queued so far. */
int rr_device_sync(rr_device *d, rr_error *err);

/* The ops, counted (rr_device_counts). Everything outside the device
 * implementations queues work through these. */
static inline int rr_dev_to_host(rr_device *d, void *host, const void *dev, size_t n, rr_error *err)
{
    d->counts.copies++;
    d->counts.host_copies++;
    return d->ops->to_host(d, host, dev, n, err);
}
static inline int rr_dev_to_device(rr_device *d, void *dev, const void *host, size_t n, rr_error *err)
{
    d->counts.copies++;
    d->counts.host_copies++;
    return d->ops->to_device(d, dev, host, n, err);
}
static inline int rr_dev_copy(rr_device *d, void *dst, const void *src, size_t n, rr_error *err)
{
    d->counts.copies++;
    return d->ops->copy(d, dst, src, n, err);
}
static inline int rr_dev_reduce3(rr_device *d, void *dst, const void *a, const void *b, size_t count,
                                 rr_dtype dtype, rr_op op, rr_error *err)
{
    d->counts.kernels++;
    return d->ops->reduce3(d, dst, a, b, count, dtype, op, err);
}
static inline int rr_dev_mean_fold(rr_device *d, void *dst, const void *x, const void *mean, size_t count,
                                   rr_dtype dtype, int k, rr_error *err)
{
    d->counts.kernels++;
    return d->ops->mean_fold(d, dst, x, mean, count, dtype, k, err);
}
static inline int rr_dev_divide(rr_device *d, void *buf, size_t count, rr_dtype dtype, int n, rr_error *err)
{
    d->counts.kernels++;
    return d->ops->divide(d, buf, count, dtype, n, err);
}
static inline uint64_t rr_dev_mark(rr_device *d, rr_error *err)
{
    d->counts.events++;
    return d->ops->mark(d, err);
}
static inline int rr_dev_done(rr_device *d, uint64_t ticket, int wait, rr_error *err)
{
    if (wait) d->counts.waits++;
    return d->ops->done(d, ticket, wait, err);
}

/* patience: how many times a ticket is asked about before its work runs
 * (0: only when waited for); see device_emulated.c. */
rr_device *rr_emulated_device_create(int patience);
/* The same claiming another identity for IPC (two devices open each
 * other's windows when their identities match; "" refuses IPC): tests of
 * the agreement and its fallback. */
rr_device *rr_emulated_device_create_as(int patience, const char *identity);
/* ordinal: the CUDA device; functions: CUfunction handles of the kernels in
 * csrc/kernels/cuda/reduce.cu, reduce[dtype][op] (sum, prod, min, max), divide[dtype]
 * and mean[dtype] (float16, bfloat16). NULL with err filled when CUDA cannot be loaded. */
rr_device *rr_cuda_device_create(int ordinal, void *const reduce[RR_NUM_DTYPES][4],
                                 void *const divide[RR_NUM_DTYPES], void *const mean[RR_NUM_MEAN_DTYPES],
                                 rr_error *err);

#endif
