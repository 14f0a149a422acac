/* ringreduce._core.Device: the CUDA device, or the emulated one that tests
 * the staged ring without a GPU (device.h). Pointers cross as integers:
 * cupy arrays give theirs (data.ptr), the emulated device hands out its own. */
#include "binding/device_binding.h"

#include <string.h>

void *rr_emulated_host_view(const void *dev);

static PyObject *wrap(rr_device *dev, int emulated)
{
    DeviceObject *self = PyObject_New(DeviceObject, &DeviceType);
    if (!self) { rr_device_destroy(dev); return NULL; }
    self->dev = dev;
    self->emulated = emulated;
    self->weakrefs = NULL;
    pthread_mutex_init(&self->mu, NULL);
    return (PyObject *)self;
}

static PyObject *Device_emulated(PyObject *Py_UNUSED(cls), PyObject *args)
{
    int patience = 2;
    const char *ipc = "emulated";
    if (!PyArg_ParseTuple(args, "|iz", &patience, &ipc)) return NULL;
    rr_device *dev = rr_emulated_device_create_as(patience < 0 ? 0 : patience, ipc ? ipc : "");
    return dev ? wrap(dev, 1) : PyErr_NoMemory();
}

static int read_handles(PyObject *seq_obj, void **out, Py_ssize_t n, const char *what)
{
    PyObject *seq = PySequence_Fast(seq_obj, what);
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries", what, n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    return PyErr_Occurred() ? -1 : 0;
}

/* Device.cuda(ordinal, reduce, divide, mean): reduce[dtype] is the (sum, prod,
 * min, max) CUfunction handles for that dtype, divide[dtype] one handle,
 * mean[dtype] one for each 16-bit float (float16, bfloat16). */
static PyObject *Device_cuda(PyObject *Py_UNUSED(cls), PyObject *args)
{
    int ordinal;
    PyObject *reduce_obj, *divide_obj, *mean_obj;
    if (!PyArg_ParseTuple(args, "iOOO", &ordinal, &reduce_obj, &divide_obj, &mean_obj)) return NULL;
    void *reduce[RR_NUM_DTYPES][4], *divide[RR_NUM_DTYPES], *mean[RR_NUM_MEAN_DTYPES];
    PyObject *rows = PySequence_Fast(reduce_obj, "reduce must be a sequence");
    if (!rows) return NULL;
    int bad = PySequence_Fast_GET_SIZE(rows) != RR_NUM_DTYPES;
    if (bad) PyErr_SetString(PyExc_ValueError, "reduce needs one row per dtype");
    for (int t = 0; !bad && t < RR_NUM_DTYPES; t++)
        bad = read_handles(PySequence_Fast_GET_ITEM(rows, t), reduce[t], 4, "reduce row");
    Py_DECREF(rows);
    if (bad || read_handles(divide_obj, divide, RR_NUM_DTYPES, "divide") ||
        read_handles(mean_obj, mean, RR_NUM_MEAN_DTYPES, "mean"))
        return NULL;
    rr_error err = {0};
    rr_device *dev;
    Py_BEGIN_ALLOW_THREADS
    dev = rr_cuda_device_create(ordinal, reduce, divide, mean, &err);
    Py_END_ALLOW_THREADS
    if (!dev) {
        PyObject *cls = error_class("RingReduceError");
        if (cls) { PyErr_SetString(cls, err.msg); Py_DECREF(cls); }
        return NULL;
    }
    return wrap(dev, 0);
}

DeviceObject *device_arg(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &DeviceType) || !((DeviceObject *)obj)->dev) {
        PyErr_SetString(PyExc_TypeError, "expected a ringreduce._core.Device");
        return NULL;
    }
    return (DeviceObject *)obj;
}

static int require_emulated(DeviceObject *self)
{
    if (self->emulated) return 0;
    PyErr_SetString(PyExc_TypeError, "only the emulated device hands out memory; use cupy for CUDA");
    return -1;
}

/* The emulated device's memory, for tests: alloc, free, write, read. */
static PyObject *Device_alloc(DeviceObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (require_emulated(self) || !PyArg_ParseTuple(args, "n", &n)) return NULL;
    void *p = self->dev->ops->dev_alloc(self->dev, (size_t)n);
    return p ? PyLong_FromVoidPtr(p) : PyErr_NoMemory();
}

static PyObject *Device_free(DeviceObject *self, PyObject *args)
{
    PyObject *ptr;
    if (require_emulated(self) || !PyArg_ParseTuple(args, "O", &ptr)) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred()) return NULL;
    self->dev->ops->dev_free(self->dev, p);
    Py_RETURN_NONE;
}

static PyObject *Device_write(DeviceObject *self, PyObject *args)
{
    PyObject *ptr;
    Py_buffer data;
    if (require_emulated(self) || !PyArg_ParseTuple(args, "Oy*", &ptr, &data)) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (!PyErr_Occurred()) memcpy(rr_emulated_host_view(p), data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Device_read(DeviceObject *self, PyObject *args)
{
    PyObject *ptr;
    Py_ssize_t n;
    if (require_emulated(self) || !PyArg_ParseTuple(args, "On", &ptr, &n)) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred()) return NULL;
    return PyBytes_FromStringAndSize(rr_emulated_host_view(p), n);
}

/* The device's error as a RingReduceError. */
static PyObject *raise_device_error(const rr_error *err)
{
    PyObject *cls = error_class("RingReduceError");
    if (cls) { PyErr_SetString(cls, err->msg); Py_DECREF(cls); }
    return NULL;
}

/* Device.bounce_down(ptr, nbytes) -> (slot, memoryview) or None: the small
 * messages' path (ringreduce/cuda.py): nbytes at device pointer ptr copied
 * into a free pinned bounce buffer the device keeps (one copy, waited for),
 * seen as a writable memoryview that is valid until bounce_up or
 * bounce_release hands the slot back. None, with nothing done, when every
 * slot is taken or another thread's collective holds the device. */
static PyObject *Device_bounce_down(DeviceObject *self, PyObject *args)
{
    PyObject *ptr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &ptr, &n)) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        return NULL;
    }
    rr_error err = {0};
    int slot = -2, rc = RR_OK;
    rr_device *d = self->dev;
    Py_BEGIN_ALLOW_THREADS
    /* Never waits for another thread's collective on this device: that one
     * may wait on peers that wait on this very message. */
    if (pthread_mutex_trylock(&self->mu) == 0) {
        /* The device first made usable on this thread: taking a slot may
         * allocate pinned memory, which CUDA registers in the current context. */
        rc = d->ops->begin(d, &err);
        if (rc == RR_OK) slot = rr_device_bounce(d, (size_t)n, &err);
        if (slot >= 0 && n) {
            rc = rr_dev_to_host(d, d->bounce[slot].buf, p, (size_t)n, &err);
            if (rc == RR_OK) rc = rr_device_sync(d, &err);
            if (rc != RR_OK) rr_device_bounce_release(d, slot);
        }
        pthread_mutex_unlock(&self->mu);
    }
    Py_END_ALLOW_THREADS
    if (rc != RR_OK || slot == -1) return raise_device_error(&err);
    if (slot == -2) Py_RETURN_NONE;
    PyObject *view = PyMemoryView_FromMemory(d->bounce[slot].buf, n, PyBUF_WRITE);
    if (!view) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        rr_device_bounce_release(d, slot);
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    return Py_BuildValue("(iN)", slot, view);
}

static int bounce_slot(int slot)
{
    if (slot >= 0 && slot < RR_BOUNCE_SLOTS) return 0;
    PyErr_SetString(PyExc_ValueError, "no such bounce slot");
    return -1;
}

/* Device.bounce_up(slot, ptr, nbytes): the slot's first nbytes copied to
 * device pointer ptr (one copy, waited for); the slot goes back either way. */
static PyObject *Device_bounce_up(DeviceObject *self, PyObject *args)
{
    PyObject *ptr;
    Py_ssize_t n;
    int slot;
    if (!PyArg_ParseTuple(args, "iOn", &slot, &ptr, &n) || bounce_slot(slot)) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred()) return NULL;
    rr_device *d = self->dev;
    if (n < 0 || (size_t)n > d->bounce[slot].bytes) {
        PyErr_SetString(PyExc_ValueError, "nbytes out of the bounce buffer's range");
        return NULL;
    }
    rr_error err = {0};
    int rc = RR_OK;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (n) {
        rc = d->ops->begin(d, &err);
        if (rc == RR_OK) rc = rr_dev_to_device(d, p, d->bounce[slot].buf, (size_t)n, &err);
        if (rc == RR_OK) rc = rr_device_sync(d, &err);
    }
    rr_device_bounce_release(d, slot);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != RR_OK) return raise_device_error(&err);
    Py_RETURN_NONE;
}

/* Device.bounce_release(slot): hands a slot back unused (the host work failed). */
static PyObject *Device_bounce_release(DeviceObject *self, PyObject *args)
{
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot) || bounce_slot(slot)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rr_device_bounce_release(self->dev, slot);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void hold_mutex(void *ctx, int hold)
{
    pthread_mutex_t *mu = ctx;
    if (hold) pthread_mutex_lock(mu);
    else pthread_mutex_unlock(mu);
}

rr_device_hold device_hold(DeviceObject *d) { return (rr_device_hold){hold_mutex, &d->mu}; }

/* Device.ipc_offer(ring_id) -> (identity, handle) or None: what this rank
 * gives in the IPC path's agreement of ring ring_id (Comm.ring_id;
 * core/device_ipc.py): its device's identity (the GPU's UUID) and its
 * window's handle (bytes), the window made now if need be (the ring's peers
 * may open it from now on); None where the device refuses IPC or cannot
 * export a window. */
static PyObject *Device_ipc_offer(DeviceObject *self, PyObject *args)
{
    unsigned long long ring = 0;
    if (!PyArg_ParseTuple(args, "|K", &ring)) return NULL;
    char id[RR_IPC_IDENTITY] = {0};
    rr_ipc_handle h;
    rr_error err = {0};
    int rc = RR_E_DEVICE;
    rr_device *d = self->dev;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (d->ops->ipc_identity && d->ops->begin(d, &err) == RR_OK && d->ops->ipc_identity(d, id, &err) == RR_OK)
        rc = rr_device_ipc_window(d, (uint64_t)ring, 1, &err);
    h = d->window.handle;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    id[RR_IPC_IDENTITY - 1] = 0;
    if (rc != RR_OK || !id[0]) Py_RETURN_NONE;
    return Py_BuildValue("(Ny#)", PyUnicode_DecodeLatin1(id, (Py_ssize_t)strlen(id), NULL), (const char *)&h,
                         (Py_ssize_t)sizeof h);
}

/* Device.ipc_probe(handle, identity, ring_id) -> bool: whether this device
 * reaches the peer's device (identity: its ipc_offer's; the same GPU, or
 * another with peer access) and the peer's window (its handle) opens here;
 * kept open (cached) for ring ring_id when it does. */
static PyObject *Device_ipc_probe(DeviceObject *self, PyObject *args)
{
    Py_buffer b;
    const char *identity;
    unsigned long long ring = 0;
    if (!PyArg_ParseTuple(args, "y*s|K", &b, &identity, &ring)) return NULL;
    rr_ipc_handle h;
    int ok = b.len == (Py_ssize_t)sizeof h;
    if (ok) memcpy(&h, b.buf, sizeof h);
    PyBuffer_Release(&b);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "not an IPC handle");
        return NULL;
    }
    rr_error err = {0};
    rr_device *d = self->dev;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    ok = d->ops->ipc_open && d->ops->begin(d, &err) == RR_OK && d->ops->ipc_reaches(d, identity) &&
         rr_device_ipc_peer(d, &h, (uint64_t)ring, &err) != NULL;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

/* Device.counts() -> dict: the device operations queued since the device was
 * made (rr_device_counts): a testing hook for what a collective costs. */
static PyObject *Device_counts(DeviceObject *self, PyObject *Py_UNUSED(ignored))
{
    rr_device_counts c;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    c = self->dev->counts;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{sKsKsKsKsKsKsKsK}", "copies", c.copies, "events", c.events, "waits", c.waits,
                         "host_copies", c.host_copies, "kernels", c.kernels, "ipc_opens", c.ipc_opens,
                         "ipc_exports", c.ipc_exports, "unpinned", c.unpinned);
}

static void Device_dealloc(DeviceObject *self)
{
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    if (self->dev) {
        Py_BEGIN_ALLOW_THREADS
        rr_device_destroy(self->dev);
        Py_END_ALLOW_THREADS
        pthread_mutex_destroy(&self->mu);
    }
    PyObject_Free(self);
}

static PyMethodDef Device_methods[] = {
    {"emulated", (PyCFunction)Device_emulated, METH_VARARGS | METH_STATIC,
     "emulated(patience=2, ipc='emulated') -> a device in host memory whose work runs late (tests; "
     "csrc/device/device_emulated.c); ipc: its identity for the IPC path (devices of equal identity open each "
     "other's windows), None to refuse IPC"},
    {"ipc_offer", (PyCFunction)Device_ipc_offer, METH_VARARGS,
     "ipc_offer(ring_id=0) -> (identity, handle) or None: this device's part in ring ring_id's IPC agreement; "
     "None: it refuses"},
    {"ipc_probe", (PyCFunction)Device_ipc_probe, METH_VARARGS,
     "ipc_probe(handle, identity, ring_id=0) -> bool: whether this device reaches the peer's (the same GPU, or peer "
     "access) and the peer's IPC window opens here (kept open for ring ring_id when it does)"},
    {"cuda", (PyCFunction)Device_cuda, METH_VARARGS | METH_STATIC,
     "cuda(ordinal, reduce, divide, mean) -> the CUDA device, with the kernels' CUfunction handles"},
    {"alloc", (PyCFunction)Device_alloc, METH_VARARGS, "alloc(nbytes) -> pointer (emulated device)"},
    {"free", (PyCFunction)Device_free, METH_VARARGS, "free(pointer) (emulated device)"},
    {"write", (PyCFunction)Device_write, METH_VARARGS, "write(pointer, bytes) (emulated device)"},
    {"read", (PyCFunction)Device_read, METH_VARARGS, "read(pointer, nbytes) -> bytes (emulated device)"},
    {"bounce_down", (PyCFunction)Device_bounce_down, METH_VARARGS,
     "bounce_down(pointer, nbytes) -> (slot, memoryview) or None: device bytes in a pinned bounce buffer (one copy); "
     "the view is valid until bounce_up/bounce_release; None when every slot is taken or the device is busy"},
    {"bounce_up", (PyCFunction)Device_bounce_up, METH_VARARGS,
     "bounce_up(slot, pointer, nbytes): the bounce buffer's bytes back to device memory (one copy); frees the slot"},
    {"bounce_release", (PyCFunction)Device_bounce_release, METH_VARARGS,
     "bounce_release(slot): frees a bounce slot without copying"},
    {"counts", (PyCFunction)Device_counts, METH_NOARGS,
     "counts() -> {'copies', 'events', 'waits', 'host_copies', 'kernels', 'ipc_opens', 'ipc_exports', "
     "'unpinned'}: device operations queued since the device was made, and host blocks the driver would not "
     "pin (testing hook)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject DeviceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringreduce._core.Device",
    .tp_basicsize = sizeof(DeviceObject),
    .tp_weaklistoffset = offsetof(DeviceObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A device the collectives run on: Device.cuda(...) or Device.emulated()",
    .tp_dealloc = (destructor)Device_dealloc,
    .tp_methods = Device_methods,
};
