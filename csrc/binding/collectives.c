/* The collectives of ringreduce._core.Comm: host buffers through the buffer
 * protocol (C-contiguous; Python has done every other check), device memory
 * as pointers given as integers. Each method parses and checks its
 * arguments, runs the ring's call under RUN_LOCKED (the GIL released for the
 * whole operation) and turns its error into an exception (finish).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "binding/binding.h"
#include "binding/device_binding.h"
#include "schedule/ipc.h"

/* allreduce(src, dst, dtype, op) and reduce_scatter(src, dst, dtype, op):
 * src is only read and may be dst. */
static PyObject *reduce_op(CommObject *self, PyObject *args, int scatter)
{
    PyObject *src_obj, *dst_obj;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOii", &src_obj, &dst_obj, &dtype, &op) || !valid_dtype_op(dtype, op))
        return NULL;
    if (check_usable(self)) return NULL;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS)) return NULL;
    if (get_writable(dst_obj, &dst)) { PyBuffer_Release(&src); return NULL; }
    if (src.len != dst.len) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "src and dst differ in size");
        return NULL;
    }
    size_t count = (size_t)dst.len / rr_dtype_size((rr_dtype)dtype);
    rr_error err = {0};
    RUN_LOCKED(self, err,
               scatter ? rr_reduce_scatter(self->ring, NULL, src.buf, dst.buf, count, (rr_dtype)dtype, (rr_op)op, &err)
                       : rr_allreduce(self->ring, NULL, src.buf, dst.buf, count, (rr_dtype)dtype, (rr_op)op, &err));
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return finish(self, &err);
}

PyObject *Comm_allreduce(CommObject *self, PyObject *args) { return reduce_op(self, args, 0); }

PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args) { return reduce_op(self, args, 1); }

/* The per-rank block sizes of an allgather; *total their sum. */
static size_t *block_sizes(CommObject *self, PyObject *sizes, size_t *total)
{
    const int N = self->ring->size;
    PyObject *seq = PySequence_Fast(sizes, "nbytes must be a sequence");
    if (!seq) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != N) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "nbytes needs one entry per rank");
        return NULL;
    }
    size_t *nbytes = PyMem_Malloc(sizeof(size_t) * (size_t)N);
    if (!nbytes) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    *total = 0;
    for (int i = 0; i < N; i++) {
        nbytes[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(seq, i));
        *total += nbytes[i];
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) { PyMem_Free(nbytes); return NULL; }
    return nbytes;
}

PyObject *Comm_allgather(CommObject *self, PyObject *args)
{
    PyObject *obj, *sizes;
    if (!PyArg_ParseTuple(args, "OO", &obj, &sizes)) return NULL;
    if (check_usable(self)) return NULL;
    size_t total;
    size_t *nbytes = block_sizes(self, sizes, &total);
    if (!nbytes) return NULL;
    Py_buffer view;
    if (get_writable(obj, &view)) { PyMem_Free(nbytes); return NULL; }
    if ((size_t)view.len != total) {
        PyBuffer_Release(&view);
        PyMem_Free(nbytes);
        PyErr_SetString(PyExc_ValueError, "buffer size differs from the sum of nbytes");
        return NULL;
    }
    rr_error err = {0};
    RUN_LOCKED(self, err, rr_allgather(self->ring, NULL, view.buf, nbytes, &err));
    PyBuffer_Release(&view);
    PyMem_Free(nbytes);
    return finish(self, &err);
}

PyObject *Comm_broadcast(CommObject *self, PyObject *args)
{
    PyObject *obj;
    int root;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &root)) return NULL;
    if (check_usable(self)) return NULL;
    if (root < 0 || root >= self->ring->size) {
        PyErr_SetString(PyExc_ValueError, "root out of range");
        return NULL;
    }
    Py_buffer view;
    if (get_writable(obj, &view)) return NULL;
    rr_error err = {0};
    RUN_LOCKED(self, err, rr_broadcast(self->ring, NULL, view.buf, (size_t)view.len, root, &err));
    PyBuffer_Release(&view);
    return finish(self, &err);
}

/* alltoall(src, dst, bytes): bytes is the N*N block matrix, row-major
 * (bytes[o*N + d] = what rank o sends to rank d), the same on every rank. */
PyObject *Comm_alltoall(CommObject *self, PyObject *args)
{
    PyObject *src_obj, *dst_obj, *sizes;
    if (!PyArg_ParseTuple(args, "OOO", &src_obj, &dst_obj, &sizes)) return NULL;
    if (check_usable(self)) return NULL;
    const int N = self->ring->size;
    PyObject *seq = PySequence_Fast(sizes, "bytes must be a sequence");
    if (!seq) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != (Py_ssize_t)N * N) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "bytes needs size * size entries");
        return NULL;
    }
    size_t *bytes = PyMem_Malloc(sizeof(size_t) * (size_t)N * (size_t)N);
    if (!bytes) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)N * N; i++) bytes[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (PyErr_Occurred()) { PyMem_Free(bytes); return NULL; }
    size_t sends = 0, gets = 0;
    const int r = self->ring->rank;
    for (int i = 0; i < N; i++) {
        sends += bytes[(size_t)r * N + i];
        gets += bytes[(size_t)i * N + r];
    }
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS)) { PyMem_Free(bytes); return NULL; }
    if (get_writable(dst_obj, &dst)) { PyBuffer_Release(&src); PyMem_Free(bytes); return NULL; }
    if ((size_t)src.len != sends || (size_t)dst.len != gets) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyMem_Free(bytes);
        PyErr_SetString(PyExc_ValueError, "src or dst differs from this rank's row or column of bytes");
        return NULL;
    }
    rr_error err = {0};
    RUN_LOCKED(self, err, rr_alltoall(self->ring, src.buf, dst.buf, bytes, &err));
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyMem_Free(bytes);
    return finish(self, &err);
}

/* The collectives on a device's memory (device.h). Buffers are pointers
 * given as integers, Python having checked them (cupy's data.ptr); both the
 * Comm and the Device are held for the whole operation. */
#define RUN_ON_DEVICE(self, d, err, CALL) \
    RUN_LOCKED(self, err, pthread_mutex_lock(&(d)->mu); CALL; pthread_mutex_unlock(&(d)->mu); \
               own_device_error(self, &(err)))

/* A failure of this rank's own device (a CUDA call) names this rank, as the
 * peers' PeerLostError does: the message says which of the ranks' GPUs failed. */
static void own_device_error(CommObject *self, rr_error *err)
{
    if (err->code != RR_E_DEVICE || err->rank >= 0) return;
    err->rank = self->ring->rank;
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "rank %d: %s", err->rank, err->msg);
    memcpy(err->msg, msg, sizeof msg);
}

static int pointer(PyObject *obj, void **p)
{
    *p = PyLong_AsVoidPtr(obj);
    return PyErr_Occurred() ? -1 : 0;
}

/* allreduce_device(device, src, dst, nbytes, dtype, op), reduce_scatter_device(...), and their IPC
 * paths allreduce_ipc(...), reduce_scatter_ipc(...) (csrc/schedule/ipc.c), where every rank agreed on
 * it (core/device_ipc.py) */
static PyObject *reduce_on_device(CommObject *self, PyObject *args, int scatter, int ipc)
{
    PyObject *dev_obj, *src_obj, *dst_obj;
    Py_ssize_t nbytes;
    int dtype, op;
    void *src, *dst;
    if (!PyArg_ParseTuple(args, "OOOnii", &dev_obj, &src_obj, &dst_obj, &nbytes, &dtype, &op) ||
        !valid_dtype_op(dtype, op) || pointer(src_obj, &src) || pointer(dst_obj, &dst))
        return NULL;
    DeviceObject *d = device_arg(dev_obj);
    if (!d || check_usable(self)) return NULL;
    size_t count = (size_t)nbytes / rr_dtype_size((rr_dtype)dtype);
    rr_error err = {0};
    rr_device *dv = d->dev;
    rr_ring *ring = self->ring;
    RUN_ON_DEVICE(self, d, err,
                  err.code = scatter ? (ipc ? rr_reduce_scatter_ipc : rr_reduce_scatter)(
                                           ring, dv, src, dst, count, (rr_dtype)dtype, (rr_op)op, &err)
                                     : (ipc ? rr_allreduce_ipc : rr_allreduce)(
                                           ring, dv, src, dst, count, (rr_dtype)dtype, (rr_op)op, &err));
    return finish(self, &err);
}

PyObject *Comm_allreduce_device(CommObject *self, PyObject *args) { return reduce_on_device(self, args, 0, 0); }
PyObject *Comm_reduce_scatter_device(CommObject *self, PyObject *args) { return reduce_on_device(self, args, 1, 0); }
PyObject *Comm_allreduce_ipc(CommObject *self, PyObject *args) { return reduce_on_device(self, args, 0, 1); }
PyObject *Comm_reduce_scatter_ipc(CommObject *self, PyObject *args) { return reduce_on_device(self, args, 1, 1); }

/* allgather_device(device, buf, nbytes), allgather_ipc(...): in place */
static PyObject *allgather_on_device(CommObject *self, PyObject *args, int ipc)
{
    PyObject *dev_obj, *ptr, *sizes;
    void *buf;
    if (!PyArg_ParseTuple(args, "OOO", &dev_obj, &ptr, &sizes) || pointer(ptr, &buf)) return NULL;
    DeviceObject *d = device_arg(dev_obj);
    if (!d || check_usable(self)) return NULL;
    size_t total;
    size_t *nbytes = block_sizes(self, sizes, &total);
    if (!nbytes) return NULL;
    rr_error err = {0};
    RUN_ON_DEVICE(self, d, err, (ipc ? rr_allgather_ipc : rr_allgather)(self->ring, d->dev, buf, nbytes, &err));
    PyMem_Free(nbytes);
    return finish(self, &err);
}

PyObject *Comm_allgather_device(CommObject *self, PyObject *args) { return allgather_on_device(self, args, 0); }
PyObject *Comm_allgather_ipc(CommObject *self, PyObject *args) { return allgather_on_device(self, args, 1); }

/* broadcast_device(device, buf, nbytes, root), broadcast_ipc(...): in place */
static PyObject *broadcast_on_device(CommObject *self, PyObject *args, int ipc)
{
    PyObject *dev_obj, *ptr;
    Py_ssize_t nbytes;
    int root;
    void *buf;
    if (!PyArg_ParseTuple(args, "OOni", &dev_obj, &ptr, &nbytes, &root) || pointer(ptr, &buf)) return NULL;
    DeviceObject *d = device_arg(dev_obj);
    if (!d || check_usable(self)) return NULL;
    if (root < 0 || root >= self->ring->size) {
        PyErr_SetString(PyExc_ValueError, "root out of range");
        return NULL;
    }
    rr_error err = {0};
    RUN_ON_DEVICE(self, d, err,
                  (ipc ? rr_broadcast_ipc : rr_broadcast)(self->ring, d->dev, buf, (size_t)nbytes, root, &err));
    return finish(self, &err);
}

PyObject *Comm_broadcast_device(CommObject *self, PyObject *args) { return broadcast_on_device(self, args, 0); }
PyObject *Comm_broadcast_ipc(CommObject *self, PyObject *args) { return broadcast_on_device(self, args, 1); }

/* Every blob in rank order, as a list of bytes. */
static PyObject *blob_list(const void *all, const size_t *lens, int N)
{
    PyObject *result = PyList_New(N);
    size_t at = 0;
    for (int i = 0; result && i < N; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)all + at, (Py_ssize_t)lens[i]);
        if (!b) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, i, b);
        at += lens[i];
    }
    return result;
}

PyObject *Comm_exchange_blobs(CommObject *self, PyObject *args)
{
    Py_buffer head, data = {0};
    if (!PyArg_ParseTuple(args, "y*|y*", &head, &data)) return NULL;
    PyObject *result = NULL;
    size_t *lens = NULL;
    void *all = NULL;
    if (check_usable(self)) goto done;
    const int N = self->ring->size;
    if (!(lens = PyMem_Malloc(sizeof(size_t) * (size_t)N))) { PyErr_NoMemory(); goto done; }
    rr_error err = {0};
    RUN_LOCKED(self, err, rr_exchange_blobs(self->ring, head.buf, (size_t)head.len, data.buf,
                                            (size_t)data.len, &all, lens, &err));
    if (err.code == RR_OK) result = blob_list(all, lens, N);
    else finish(self, &err);
done:
    free(all);
    PyMem_Free(lens);
    PyBuffer_Release(&head);
    if (data.obj || data.buf) PyBuffer_Release(&data);
    return result;
}

/* A small allreduce's answer: None when every header matched ours (reduced),
 * else every rank's blob; NULL with the error raised. */
static PyObject *small_result(CommObject *self, rr_error *err, int agreed, const void *all, const size_t *lens, int N)
{
    if (err->code != RR_OK) return finish(self, err);
    if (agreed) Py_RETURN_NONE;
    return blob_list(all, lens, N);
}

/* allreduce_small_ipc(head, device, src, dst, nbytes, dtype, op, slot_bytes): the one-pass small
 * allreduce of device memory over IPC (rr_allreduce_small_ipc), where the ring agreed on that path
 * (core/device_ipc.py); None when every header matched ours (dst holds the result), else every rank's
 * blob for Python to explain. */
PyObject *Comm_allreduce_small_ipc(CommObject *self, PyObject *args)
{
    PyObject *dev_obj, *src_obj, *dst_obj;
    Py_buffer head;
    Py_ssize_t nbytes, slot_bytes;
    int dtype, op;
    void *src, *dst;
    if (!PyArg_ParseTuple(args, "y*OOOniin", &head, &dev_obj, &src_obj, &dst_obj, &nbytes, &dtype, &op, &slot_bytes))
        return NULL;
    PyObject *result = NULL;
    size_t *lens = NULL;
    void *all = NULL;
    int agreed = 0, N = 0;
    DeviceObject *d = NULL;
    if (!valid_dtype_op(dtype, op) || pointer(src_obj, &src) || pointer(dst_obj, &dst)) goto done;
    if (nbytes < 0 || slot_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes and slot_bytes must be >= 0");
        goto done;
    }
    if (!(d = device_arg(dev_obj)) || check_usable(self)) goto done;
    size_t count = (size_t)nbytes / rr_dtype_size((rr_dtype)dtype);
    rr_error err = {0};
    rr_device *dv = d->dev;
    const rr_device_hold hold = device_hold(d); /* let go while it waits on peers */
    RUN_ON_DEVICE(self, d, err,
                  N = self->ring->size;
                  if (!(lens = malloc(sizeof *lens * (size_t)N))) rr_set_error(&err, RR_E_SYSTEM, -1, "out of memory");
                  else rr_allreduce_small_ipc(self->ring, dv, head.buf, (size_t)head.len, src, dst, count,
                                              (size_t)slot_bytes, (rr_dtype)dtype, (rr_op)op, &hold, &agreed, &all,
                                              lens, &err));
    result = small_result(self, &err, agreed, all, lens, N);
done:
    free(all);
    free(lens);
    PyBuffer_Release(&head);
    return result;
}

/* release_ipc(devices): the IPC path's end on this ring (rr_ipc_release),
 * before it closes: collective, every rank of a ring that agreed on IPC
 * calls it with the devices it ran the ring's IPC collectives on. */
PyObject *Comm_release_ipc(CommObject *self, PyObject *args)
{
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O", &list)) return NULL;
    PyObject *seq = PySequence_Fast(list, "devices must be a sequence");
    if (!seq) return NULL;
    const int n = (int)PySequence_Fast_GET_SIZE(seq);
    rr_device **devs = PyMem_Calloc((size_t)n + 1, sizeof *devs);
    rr_device_hold *holds = PyMem_Calloc((size_t)n + 1, sizeof *holds);
    PyObject *result = NULL;
    if (!devs || !holds) {
        PyErr_NoMemory();
        goto done;
    }
    for (int i = 0; i < n; i++) {
        DeviceObject *d = device_arg(PySequence_Fast_GET_ITEM(seq, i));
        if (!d) goto done;
        devs[i] = d->dev;
        holds[i] = device_hold(d);
    }
    if (check_usable(self)) goto done;
    rr_error err = {0};
    RUN_LOCKED(self, err, rr_ipc_release(self->ring, devs, n, holds, &err));
    result = finish(self, &err);
done:
    PyMem_Free(devs);
    PyMem_Free(holds);
    Py_DECREF(seq);
    return result;
}

static int same_shape(const Py_buffer *a, const Py_buffer *b)
{
    return a->ndim == b->ndim && (a->ndim == 0 || !memcmp(a->shape, b->shape, sizeof *a->shape * (size_t)a->ndim));
}

/* allreduce_small(head, src, dst, dtype, op) and try_allreduce_small(...):
 * the small allreduce (rr_allreduce_small) of head + src into dst; None when
 * every header matched ours (dst holds the result), else every rank's blob
 * for Python to explain. The try_ form is rr.allreduce's fast path: buffers
 * it cannot use as given (not C-contiguous, dst read-only, shapes differ, no
 * buffer at all) return NotImplemented before anything is sent, and the
 * caller takes its checked path, which refuses bad input on every rank.
 * METH_FASTCALL: no argument tuple, no format string to parse. */
static PyObject *small_allreduce(CommObject *self, PyObject *const *args, Py_ssize_t nargs, int decline)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allreduce_small(head, src, dst, dtype, op) takes 5 arguments");
        return NULL;
    }
    int dtype = (int)PyLong_AsLong(args[3]), op = (int)PyLong_AsLong(args[4]);
    if (PyErr_Occurred() || !valid_dtype_op(dtype, op)) return NULL;
    Py_buffer head, data, out;
    if (PyObject_GetBuffer(args[0], &head, PyBUF_SIMPLE)) return NULL;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_C_CONTIGUOUS)) goto decline_head;
    if (get_writable(args[2], &out)) goto decline_data;
    if (out.len != data.len || (decline && !same_shape(&data, &out))) {
        if (!decline) PyErr_SetString(PyExc_ValueError, "out and data differ in size");
        PyBuffer_Release(&out);
        goto decline_data;
    }
    PyObject *result = NULL;
    size_t *lens = NULL;
    void *all = NULL;
    int agreed = 0, N = 0;
    if (check_usable(self)) goto done;
    rr_error err = {0};
    /* N and lens under the lock: a ring closed meanwhile by another thread is gone (RUN_LOCKED says so) */
    RUN_LOCKED(self, err,
               N = self->ring->size;
               if (!(lens = malloc(sizeof *lens * (size_t)N))) rr_set_error(&err, RR_E_SYSTEM, -1, "out of memory");
               else rr_allreduce_small(self->ring, head.buf, (size_t)head.len, data.buf, (size_t)data.len, out.buf,
                                       (rr_dtype)dtype, (rr_op)op, &agreed, &all, lens, &err));
    result = small_result(self, &err, agreed, all, lens, N);
done:
    free(all);
    free(lens);
    PyBuffer_Release(&head);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
decline_data:
    PyBuffer_Release(&data);
decline_head:
    PyBuffer_Release(&head);
    if (!decline) return NULL;
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
}

PyObject *Comm_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return small_allreduce(self, args, nargs, 0);
}

PyObject *Comm_try_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return small_allreduce(self, args, nargs, 1);
}
