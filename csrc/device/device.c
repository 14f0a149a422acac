/* The buffers a device keeps between ring operations (device.h). */
#include "device/device.h"

#include <stdlib.h>

int rr_device_reserve(rr_device *d, size_t mirror_bytes, size_t slot_bytes, rr_error *err)
{
    if (mirror_bytes > d->mirror_bytes) {
        d->ops->host_free(d, d->mirror);
        d->mirror_bytes = 0;
        /* Grow by half again, so a stream of slowly growing tensors does not
         * reallocate pinned memory each time. */
        size_t want = mirror_bytes + mirror_bytes / 2;
        if (!(d->mirror = d->ops->host_alloc(d, want))) goto oom;
        d->mirror_bytes = want;
    }
    if (slot_bytes > d->slot_bytes) {
        d->ops->host_free(d, d->staging);
        d->ops->dev_free(d, d->scratch);
        d->scratch = NULL;
        d->slot_bytes = 0;
        if (!(d->staging = d->ops->host_alloc(d, slot_bytes * RR_DEVICE_SLOTS))) goto oom;
        if (!(d->scratch = d->ops->dev_alloc(d, slot_bytes * RR_DEVICE_SLOTS))) goto oom;
        d->slot_bytes = slot_bytes;
    }
    return RR_OK;
oom:
    rr_set_error(err, RR_E_DEVICE, -1, "out of memory: %zu bytes of pinned host memory and %zu of device memory",
                 mirror_bytes, slot_bytes * RR_DEVICE_SLOTS);
    return err->code;
}

void rr_device_destroy(rr_device *d)
{
    if (!d) return;
    rr_error ignored;
    if (d->ops->begin(d, &ignored) == RR_OK) rr_device_sync(d, &ignored);
    d->ops->host_free(d, d->mirror);
    d->ops->host_free(d, d->staging);
    d->ops->dev_free(d, d->scratch);
    d->ops->destroy(d);
}

int rr_device_sync(rr_device *d, rr_error *err)
{
    uint64_t t = d->ops->mark(d, err);
    if (!t) return err->code;
    int rc = d->ops->done(d, t, 1, err);
    return rc < 0 ? -rc : RR_OK;
}
