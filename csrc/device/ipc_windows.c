/* The IPC path's memory on a device (device.h): the windows this device
 * exports, the peers' windows it opened, and when each may be freed or
 * closed.
 *
 * The rule: an exported window is freed only once no peer has it open.
 * A peer closes a window when it opens a newer one of the same owner, or
 * when every ring it used the window for is released. So a window replaced
 * by a larger one waits (retired) for each ring whose peers may hold it, as
 * a set of ring ids, until a handshake of that ring after the one that
 * announced the new window (rr_device_ipc_passed), or that ring's release
 * (rr_device_ipc_release_ring, after its peers closed what they opened for
 * it). A small window (one ring's) is retired until its ring's peers opened
 * the new one (rr_device_ipc_small_passed), and freed with its ring.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/device.h"

static int set_has(const rr_ring_set *s, uint64_t ring)
{
    for (int i = 0; i < s->n; i++)
        if (s->id[i] == ring) return 1;
    return 0;
}

static int set_add(rr_ring_set *s, uint64_t ring, rr_error *err)
{
    if (set_has(s, ring)) return RR_OK;
    uint64_t *more = realloc(s->id, sizeof *more * (size_t)(s->n + 1));
    if (!more) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    s->id = more;
    s->id[s->n++] = ring;
    return RR_OK;
}

static void set_remove(rr_ring_set *s, uint64_t ring)
{
    for (int i = 0; i < s->n; i++)
        if (s->id[i] == ring) s->id[i--] = s->id[--s->n];
}

static int set_copy(rr_ring_set *dst, const rr_ring_set *src, rr_error *err)
{
    dst->n = 0;
    dst->id = NULL;
    for (int i = 0; i < src->n; i++)
        if (set_add(dst, src->id[i], err)) return err->code;
    return RR_OK;
}

static void set_free(rr_ring_set *s)
{
    free(s->id);
    s->id = NULL;
    s->n = 0;
}

/* This process's windows, numbered: with the pid, an IPC owner no other
 * window on the host has while this process lives. */
static uint64_t next_serial;

static void unexport(rr_device *d, rr_ipc_window *w)
{
    if (w->ptr) d->ops->ipc_unexport(d, w->ptr, &w->handle);
    w->ptr = NULL;
}

/* Replaces w's allocation with one of `bytes` (a new generation of the same
 * owner; the first gets an owner). The old one is handed to *old (ptr NULL
 * where there was none): the caller frees it when no peer has it open. */
static int window_remake(rr_device *d, rr_ipc_window *w, size_t bytes, rr_ipc_window *old, rr_error *err)
{
    memset(old, 0, sizeof *old);
    if (!d->ops->ipc_export) {
        rr_set_error(err, RR_E_DEVICE, -1, "this device has no IPC");
        return err->code;
    }
    rr_ipc_handle h = w->handle;
    if (!w->ptr && !h.owner)
        h.owner = ((uint64_t)getpid() << 20) | (__atomic_fetch_add(&next_serial, 1, __ATOMIC_RELAXED) & 0xfffff);
    if (w->ptr) *old = *w;
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

/* Frees the retired windows no ring waits for any more, once nothing of
 * this device's own work still reads or writes them. */
static void free_unwaited(rr_device *d)
{
    int synced = 0;
    for (int i = 0; i < d->nretired; i++) {
        if (d->retired[i].waiting.n) continue;
        if (!synced) {
            rr_error ignored;
            rr_device_sync(d, &ignored);
            synced = 1;
        }
        unexport(d, &d->retired[i].window);
        set_free(&d->retired[i].waiting);
        d->retired[i--] = d->retired[--d->nretired];
    }
}

int rr_device_ipc_window(rr_device *d, uint64_t ring, size_t bytes, rr_error *err)
{
    if (set_add(&d->window_rings, ring, err)) return err->code;
    if (d->window.ptr && d->window.handle.bytes >= bytes) return RR_OK;
    struct rr_ipc_retired *more = realloc(d->retired, sizeof *more * (size_t)(d->nretired + 1));
    if (!more) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    d->retired = more;
    struct rr_ipc_retired *r = &d->retired[d->nretired];
    if (set_copy(&r->waiting, &d->window_rings, err)) {
        set_free(&r->waiting);
        return err->code;
    }
    int rc = window_remake(d, &d->window, bytes + bytes / 2, &r->window, err); /* by half again, as the mirror */
    if (r->window.ptr) d->nretired++;
    else set_free(&r->waiting);
    return rc;
}

void rr_device_ipc_passed(rr_device *d, uint64_t ring)
{
    for (int i = 0; i < d->nretired; i++) set_remove(&d->retired[i].waiting, ring);
    free_unwaited(d);
}

rr_ipc_small *rr_device_ipc_small(rr_device *d, uint64_t ring, size_t slot_bytes, rr_error *err)
{
    rr_ipc_small *s = NULL;
    for (int i = 0; i < d->nsmall && !s; i++)
        if (d->small[i]->ring == ring) s = d->small[i];
    if (!s) {
        rr_ipc_small **more = realloc(d->small, sizeof *more * (size_t)(d->nsmall + 1));
        if (!more || !(s = calloc(1, sizeof *s))) {
            if (more) d->small = more;
            rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
            return NULL;
        }
        d->small = more;
        d->small[d->nsmall++] = s;
        s->ring = ring;
    }
    slot_bytes = (slot_bytes ? slot_bytes + 255 : 256) / 256 * 256; /* each slot aligned for any kernel */
    if (s->window.ptr && s->slot >= slot_bytes) return s;
    if (s->retired.ptr) { /* grown again before the peers opened it (headers differed): only the retired */
        rr_error ignored;  /* one is open on peers; this one goes now */
        rr_device_sync(d, &ignored);
        unexport(d, &s->window);
    }
    rr_ipc_window old;
    s->slot = 0;
    s->announced = 0;
    int rc = window_remake(d, &s->window, 2 * slot_bytes, &old, err);
    if (old.ptr) s->retired = old;
    if (rc) return NULL;
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

static void close_peer(rr_device *d, int i)
{
    d->ops->ipc_close(d, d->peers[i].ptr, &d->peers[i].handle);
    set_free(&d->peers[i].rings);
    d->peers[i] = d->peers[--d->npeers];
}

void *rr_device_ipc_peer(rr_device *d, const rr_ipc_handle *h, uint64_t ring, rr_error *err)
{
    for (int i = 0; i < d->npeers; i++) {
        if (d->peers[i].handle.owner != h->owner) continue;
        if (!memcmp(&d->peers[i].handle, h, sizeof *h))
            return set_add(&d->peers[i].rings, ring, err) ? NULL : d->peers[i].ptr;
        close_peer(d, i); /* that owner's window was replaced, or is another process's of the same pid */
        break;
    }
    struct rr_ipc_peer *more = realloc(d->peers, sizeof *more * (size_t)(d->npeers + 1));
    if (!more) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return NULL;
    }
    d->peers = more;
    struct rr_ipc_peer *p = &d->peers[d->npeers];
    memset(p, 0, sizeof *p);
    if (set_add(&p->rings, ring, err)) return NULL;
    d->counts.ipc_opens++;
    if (!(p->ptr = d->ops->ipc_open(d, h, err))) { /* nothing kept: the next operation tries afresh */
        set_free(&p->rings);
        return NULL;
    }
    p->handle = *h;
    d->npeers++;
    return p->ptr;
}

void rr_device_ipc_close_ring(rr_device *d, uint64_t ring)
{
    for (int i = 0; i < d->npeers; i++) {
        if (!set_has(&d->peers[i].rings, ring)) continue;
        set_remove(&d->peers[i].rings, ring);
        if (!d->peers[i].rings.n) close_peer(d, i--);
    }
}

void rr_device_ipc_release_ring(rr_device *d, uint64_t ring)
{
    rr_error ignored;
    rr_device_sync(d, &ignored); /* nothing of this device's own work still reads or writes them */
    for (int i = 0; i < d->nsmall; i++) {
        rr_ipc_small *s = d->small[i];
        if (s->ring != ring) continue;
        unexport(d, &s->window);
        unexport(d, &s->retired);
        free(s);
        d->small[i] = d->small[--d->nsmall];
        break;
    }
    set_remove(&d->window_rings, ring);
    rr_device_ipc_passed(d, ring);
}

void rr_device_ipc_destroy(rr_device *d)
{
    while (d->npeers) close_peer(d, d->npeers - 1);
    free(d->peers);
    unexport(d, &d->window);
    set_free(&d->window_rings);
    for (int i = 0; i < d->nretired; i++) {
        unexport(d, &d->retired[i].window);
        set_free(&d->retired[i].waiting);
    }
    free(d->retired);
    for (int i = 0; i < d->nsmall; i++) {
        unexport(d, &d->small[i]->window);
        unexport(d, &d->small[i]->retired);
        free(d->small[i]);
    }
    free(d->small);
}
