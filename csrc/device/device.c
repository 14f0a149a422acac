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

void rr_device_destroy(rr_device *d)
{
    if (!d) return;
    rr_error ignored;
    if (d->ops->begin(d, &ignored) == RR_OK) rr_device_sync(d, &ignored);
    rr_device_ipc_destroy(d);
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
