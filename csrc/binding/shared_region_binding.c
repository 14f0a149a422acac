/* ringreduce._core.SharedRegion(nbytes): exports nbytes of a new region
 * through the buffer protocol; the region is freed with the object, which
 * every array made from it keeps alive (numpy holds the exporter). */
#include "binding/shared_region_binding.h"

#include <errno.h>

#include "memory/shared_region.h"

typedef struct {
    PyObject_HEAD
    void *base;
    Py_ssize_t nbytes; /* what the buffer exports; the region may be longer (whole pages) */
    size_t length;
    unsigned long long id;
    int fd;
} SharedRegionObject;

static PyObject *SharedRegion_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"nbytes", NULL};
    Py_ssize_t nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", names, &nbytes)) return NULL;
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "SharedRegion: nbytes must be >= 0, not %zd", nbytes);
        return NULL;
    }
    SharedRegionObject *self = (SharedRegionObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    uint64_t id = 0;
    void *base;
    Py_BEGIN_ALLOW_THREADS /* ftruncate and mmap of a large region may take a while */
    base = rr_region_create((size_t)nbytes, &self->length, &id);
    Py_END_ALLOW_THREADS
    if (!base) {
        int e = errno;
        Py_DECREF(self);
        errno = e;
        if (e == ENOMEM) return PyErr_NoMemory();
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->base = base;
    self->nbytes = nbytes;
    self->id = id;
    self->fd = rr_region_find(base, 0).fd;
    return (PyObject *)self;
}

static void SharedRegion_dealloc(SharedRegionObject *self)
{
    rr_region_free(self->base);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int SharedRegion_getbuffer(SharedRegionObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->base, self->nbytes, 0, flags);
}

static PyBufferProcs SharedRegion_as_buffer = {.bf_getbuffer = (getbufferproc)SharedRegion_getbuffer};

static PyObject *SharedRegion_get_id(SharedRegionObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *SharedRegion_get_length(SharedRegionObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->length);
}

static PyObject *SharedRegion_get_fd(SharedRegionObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->fd);
}

static PyObject *SharedRegion_get_address(SharedRegionObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(self->base);
}

/* region_of(address, nbytes) -> the id of the live region holding those bytes, or 0. */
static PyObject *SharedRegion_region_of(PyObject *Py_UNUSED(cls), PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &addr, &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(rr_region_find((const void *)(uintptr_t)addr, (size_t)n).id);
}

static PyGetSetDef SharedRegion_getset[] = {
    {"id", (getter)SharedRegion_get_id, NULL, "the region's id, unique in this process", NULL},
    {"length", (getter)SharedRegion_get_length, NULL, "the region's bytes (whole pages)", NULL},
    {"fd", (getter)SharedRegion_get_fd, NULL, "the region's memfd in this process (a neighbour opens it)", NULL},
    {"address", (getter)SharedRegion_get_address, NULL, "where the region starts in this process", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef SharedRegion_methods[] = {
    {"region_of", SharedRegion_region_of, METH_VARARGS | METH_STATIC,
     "region_of(address, nbytes) -> the id of the live region holding those bytes, or 0"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject SharedRegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringreduce._core.SharedRegion",
    .tp_doc = "SharedRegion(nbytes): nbytes of a memfd mapped MAP_SHARED, registered so the Cross Memory "
              "Attach ring lets a neighbour map it (csrc/memory/shared_region.h); freed with the object",
    .tp_basicsize = sizeof(SharedRegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = SharedRegion_new,
    .tp_dealloc = (destructor)SharedRegion_dealloc,
    .tp_as_buffer = &SharedRegion_as_buffer,
    .tp_getset = SharedRegion_getset,
    .tp_methods = SharedRegion_methods,
};
