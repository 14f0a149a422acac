/* The buffers a device keeps between ring operations (device.h). */
#include "device/device.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Grows *buf to hold at least want bytes of pinned memory (by half again, so
 * a stream of slowly growing tensors does not reallocate each time). */
static int grow(rr_device *d, char **buf, size_t *have, size_t want, const char *what, rr_error *err)
{
    if (want <= *have) return RR_OK;
    d->ops->host_free(d, *buf);
    *have = 0;
    size_t size = want + want / 2;
    if (!(*buf = d->ops->host_alloc(d, size))) {
        rr_set_error(err, RR_E_DEVICE, -1, "out of memory: %zu bytes of pinned host memory for the %s", size, what);
        return err->code;
    }
    *have = size;
    return RR_OK;
}

int rr_device_reserve(rr_device *d, size_t mirror_bytes, rr_error *err)
{
    return grow(d, &d->mirror, &d->mirror_bytes, mirror_bytes, "ring's mirror", err);
}

int rr_device_bounce(rr_device *d, size_t bytes, rr_error *err)
{
    int slot = -1;
    for (int i = 0; i < RR_BOUNCE_SLOTS; i++) {
        if (d->bounce[i].busy) continue;
        if (slot < 0 || (d->bounce[slot].bytes < bytes && d->bounce[i].bytes > d->bounce[slot].bytes)) slot = i;
    }
    if (slot < 0) return -2;
    if (grow(d, &d->bounce[slot].buf, &d->bounce[slot].bytes, bytes ? bytes : 1, "bounce buffer", err)) return -1;
    d->bounce[slot].busy = 1;
    return slot;
}

void rr_device_bounce_release(rr_device *d, int slot)
{
    if (slot >= 0 && slot < RR_BOUNCE_SLOTS) d->bounce[slot].busy = 0;
}

/* This process's windows, numbered: with the pid, an IPC owner no other
 * window on the host has. */
static uint64_t next_serial;

static void unexport(rr_device *d, rr_ipc_window *w)
{
    if (w->ptr) d->ops->ipc_unexport(d, w->ptr, &w->handle);
    w->ptr = NULL;
}

/* Replaces w's allocation with one of `bytes` (a new generation of the same
 * owner; the first gets an owner). The old one is freed once this device's
 * queued work is done, or handed to *keep where keep is given. */
static int window_remake(rr_device *d, rr_ipc_window *w, size_t bytes, rr_ipc_window *keep, rr_error *err)
{
    if (!d->ops->ipc_export) {
        rr_set_error(err, RR_E_DEVICE, -1, "this device has no IPC");
        return err->code;
    }
    rr_ipc_handle h = w->handle;
    if (!w->ptr && !h.owner)
        h.owner = ((uint64_t)getpid() << 20) | (__atomic_fetch_add(&next_serial, 1, __ATOMIC_RELAXED) & 0xfffff);
    if (w->ptr && keep) {
        *keep = *w;
    } else if (w->ptr) {
        rr_device_sync(d, err); /* nothing of ours still reads or writes the old one */
        unexport(d, w);
    }
    w->ptr = NULL;
    h.generation++;
    h.bytes = bytes;
    memset(h.data, 0, sizeof h.data);
    d->counts.ipc_exports++;
    w->handle = h;
    if (!(w->ptr = d->ops->ipc_export(d, h.bytes, &w->handle, err))) {
        w->handle.bytes = 0;
        return err->code;
    }
    return RR_OK;
}

int rr_device_ipc_window(rr_device *d, size_t bytes, rr_error *err)
{
    if (d->window.ptr && d->window.handle.bytes >= bytes) return RR_OK;
    return window_remake(d, &d->window, bytes + bytes / 2, NULL, err); /* grown by half again, as the mirror */
}

rr_ipc_small *rr_device_ipc_small(rr_device *d, uint64_t ring, size_t slot_bytes, rr_error *err)
{
    rr_ipc_small *s = NULL;
    for (int i = 0; i < d->nsmall && !s; i++)
        if (d->small[i].ring == ring) s = &d->small[i];
    if (!s) {
        rr_ipc_small *more = realloc(d->small, sizeof *more * (size_t)(d->nsmall + 1));
        if (!more) {
            rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
            return NULL;
        }
        d->small = more;
        s = &d->small[d->nsmall++];
        memset(s, 0, sizeof *s);
        s->ring = ring;
    }
    slot_bytes = (slot_bytes ? slot_bytes + 255 : 256) / 256 * 256; /* each slot aligned for any kernel */
    if (s->window.ptr && s->slot >= slot_bytes) return s;
    if (s->retired.ptr) { /* grown twice without a pass between (a failed one): wait, then free it */
        rr_device_sync(d, err);
        unexport(d, &s->retired);
    }
    s->slot = 0;
    s->announced = 0;
    if (window_remake(d, &s->window, 2 * slot_bytes, &s->retired, err)) return NULL;
    s->slot = slot_bytes;
    return s;
}

void rr_device_ipc_small_passed(rr_device *d, rr_ipc_small *s)
{
    if (!s->retired.ptr) return;
    rr_error ignored;
    rr_device_sync(d, &ignored); /* and none of this device's own work on it is left */
    unexport(d, &s->retired);
}

void *rr_device_ipc_peer(rr_device *d, const rr_ipc_handle *h, rr_error *err)
{
    int at = -1;
    for (int i = 0; i < d->npeers; i++) {
        if (d->peers[i].handle.owner != h->owner) continue;
        if (d->peers[i].handle.generation == h->generation) return d->peers[i].ptr;
        at = i; /* that owner's window grew: the old one goes */
        d->ops->ipc_close(d, d->peers[i].ptr, &d->peers[i].handle);
        d->peers[i].ptr = NULL;
        break;
    }
    if (at < 0) {
        struct rr_ipc_peer *more = realloc(d->peers, sizeof *more * (size_t)(d->npeers + 1));
        if (!more) {
            rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
            return NULL;
        }
        d->peers = more;
        at = d->npeers++;
    }
    d->counts.ipc_opens++;
    void *p = d->ops->ipc_open(d, h, err);
    if (!p) { /* forget the owner: the next operation tries afresh */
        d->peers[at] = d->peers[--d->npeers];
        return NULL;
    }
    d->peers[at].handle = *h;
    d->peers[at].ptr = p;
    return p;
}

void rr_device_destroy(rr_device *d)
{
    if (!d) return;
    rr_error ignored;
    if (d->ops->begin(d, &ignored) == RR_OK) rr_device_sync(d, &ignored);
    for (int i = 0; i < d->npeers; i++) d->ops->ipc_close(d, d->peers[i].ptr, &d->peers[i].handle);
    free(d->peers);
    unexport(d, &d->window);
    for (int i = 0; i < d->nsmall; i++) {
        unexport(d, &d->small[i].window);
        unexport(d, &d->small[i].retired);
    }
    free(d->small);
    d->ops->host_free(d, d->mirror);
    for (int i = 0; i < RR_BOUNCE_SLOTS; i++) d->ops->host_free(d, d->bounce[i].buf);
    d->ops->destroy(d);
}

int rr_device_sync(rr_device *d, rr_error *err)
{
    uint64_t t = rr_dev_mark(d, err);
    if (!t) return err->code;
    int rc = rr_dev_done(d, t, 1, err);
    return rc < 0 ? -rc : RR_OK;
}
