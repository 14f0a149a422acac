/* ringreduce._core: the thin Python binding over the ring.
 *
 * Buffers arrive through the buffer protocol (C-contiguous; Python has done
 * every check); the GIL is released for the whole operation. A Comm is used
 * by one operation at a time (a mutex), and after any failure it stays
 * broken and says why on every later call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "cma.h"
#include "device_binding.h"
#include "reduce.h"
#include "recursive_doubling.h"
#include "reduce16.h"
#include "ring.h"
#include "shared_region_binding.h"
#include "tcp.h"

typedef struct {
    PyObject_HEAD
    rr_ring *ring;
    pthread_mutex_t mu;
    int mu_ready;        /* mu initialised: destroyed with the object, never while a thread may wait on it */
    int closed;
    rr_error broken; /* the first error; code RR_OK while healthy */
    PyObject *interrupt; /* what a signal handler raised while we waited (see signals_pending) */
    pid_t pid;           /* the process that made the ring: a forked child must not touch it */
    atomic_int busy;     /* an operation runs, on thread `owner` */
    atomic_int callers;  /* threads inside an operation's call, waiting for the mutex or running: Comm.busy */
    pthread_t owner;
    int close_pending;   /* close() came from a signal handler inside an operation: done after it */
    atomic_int stop_requested; /* interrupt() from any thread: the running operation gives up */
} CommObject;

static void close_ring(CommObject *self);

/* The main thread's id: only it runs Python's signal handlers. */
static unsigned long main_thread;

/* The transport's interrupt hook (transport.h), asked every ~100 ms while an
 * operation waits with the GIL released. interrupt() from another thread
 * (shutdown() while the engine's thread waits) says stop. On the main thread
 * it also runs Python's signal handlers, so Ctrl-C need not wait for
 * RINGREDUCE_TIMEOUT: if one raised (SIGINT's KeyboardInterrupt, a SIGTERM
 * handler's exception), keep it for finish() and say stop. Either way the
 * operation fails and the transport tells the peers this rank left. */
static int signals_pending(void *arg)
{
    CommObject *self = arg;
    if (atomic_load(&self->stop_requested)) return 1;
    if (PyThread_get_thread_ident() != main_thread) return 0; /* only it runs signal handlers */
    PyGILState_STATE gil = PyGILState_Ensure();
    int stop = PyErr_CheckSignals() < 0;
    if (stop) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *value = PyErr_GetRaisedException();
#else
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb) PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
#endif
        Py_XSETREF(self->interrupt, value);
    }
    PyGILState_Release(gil);
    return stop;
}

static void arm_interrupt(CommObject *self, int armed)
{
    rr_transport *t = self->ring ? self->ring->transport : NULL;
    if (!t) return;
    t->interrupted = armed ? signals_pending : NULL;
    t->interrupt_arg = self;
}

/* A signal handler run by the hook is Python on the thread that holds the
 * lock: a collective or close() from it would wait for itself forever. */
static int reentered(CommObject *self)
{
    return atomic_load(&self->busy) && pthread_equal(self->owner, pthread_self());
}

/* This process's id, kept by an atfork handler: asking the kernel (getpid)
 * on every operation cost ~0.1 us of a 4 KiB allreduce's ~4. */
static pid_t this_pid;
static void forked_child(void) { this_pid = getpid(); }

static int forked_away(CommObject *self) { return self->pid != this_pid; }

/* The setters' guard: 1, with a ValueError set, when there is no ring to set. */
static int refuse_closed(CommObject *self)
{
    if (self->ring && !forked_away(self)) return 0;
    PyErr_SetString(PyExc_ValueError, "the communicator is closed");
    return 1;
}

/* Before each operation: after interrupt() nothing more runs (and the peers
 * are told), and a ring that knows a peer is lost fails at once. */
static int begin_op(CommObject *self, rr_error *err)
{
    if (atomic_load(&self->stop_requested)) {
        rr_set_error(err, RR_E_INTERRUPTED, self->ring->rank, "rank %d was interrupted while leaving the ring",
                     self->ring->rank);
        if (self->ring->transport) self->ring->transport->ops->abort(self->ring->transport, err);
        return err->code;
    }
    return rr_ring_begin(self->ring, err);
}

PyObject *error_class(const char *name)
{
    PyObject *mod = PyImport_ImportModule("ringreduce.errors");
    if (!mod) return NULL;
    PyObject *cls = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    return cls;
}

/* Raises PeerLostError(msg, rank) or RingReduceError(msg, rank); `first` is
 * false when the error is an old one, met again on a later call. */
static PyObject *raise_error(const rr_error *err, int first)
{
    if (err->code == RR_E_SYSTEM && strstr(err->msg, "out of memory")) return PyErr_NoMemory();
    PyObject *cls = error_class(err->code == RR_E_PEER_LOST && first ? "PeerLostError" : "RingReduceError");
    if (!cls) return NULL;
    PyObject *msg = first ? PyUnicode_FromString(err->msg)
                          : PyUnicode_FromFormat("communicator is unusable after an earlier error: %s", err->msg);
    PyObject *exc = msg ? PyObject_CallFunction(cls, "Oi", msg, err->rank) : NULL;
    Py_XDECREF(msg);
    Py_DECREF(cls);
    if (!exc) return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

static int check_usable(CommObject *self)
{
    if (self->closed) {
        PyObject *cls = error_class("RingReduceError");
        if (cls) { PyErr_SetString(cls, "ringreduce is shut down: call ringreduce.init() first"); Py_DECREF(cls); }
        return -1;
    }
    if (self->broken.code != RR_OK) { raise_error(&self->broken, 0); return -1; }
    return 0;
}

/* Comm(rank, size, next_fd, prev_fd, ctrl_fds, timeout, segment, spin=100,
 * tx_shm=-1, rx_shm=-1) runs over TCP sockets (a link's data through shared
 * memory where tx_shm / rx_shm give its file); Comm(rank, size, -1, -1, (), timeout, segment,
 * transport=capsule) over a transport built elsewhere (ringreduce._mpi). */
static int Comm_init(CommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"rank", "size", "next_fd", "prev_fd", "ctrl_fds", "timeout", "segment", "spin",
                             "transport", "tx_shm", "rx_shm", NULL};
    int rank, size, next_fd, prev_fd, tx_shm = -1, rx_shm = -1;
    PyObject *ctrl, *capsule = NULL;
    double timeout;
    Py_ssize_t segment;
    int spin = 100;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiOdn|iOii", kwlist, &rank, &size, &next_fd, &prev_fd,
                                     &ctrl, &timeout, &segment, &spin, &capsule, &tx_shm, &rx_shm))
        return -1;
    if (capsule && capsule != Py_None) {
        rr_transport *t = PyCapsule_GetPointer(capsule, "ringreduce.transport");
        if (!t) return -1;
        if (t->rank != rank || t->size != size) {
            PyErr_SetString(PyExc_ValueError, "transport's rank or size differs");
            return -1;
        }
        /* The Comm owns it from here: make the capsule unusable for a second Comm. */
        if (PyCapsule_SetName(capsule, "ringreduce.transport.taken")) return -1;
        self->ring = rr_ring_create(t, (size_t)segment);
        self->pid = this_pid;
        if (!self->ring) { t->ops->destroy(t); PyErr_NoMemory(); return -1; }
        pthread_mutex_init(&self->mu, NULL);
        self->mu_ready = 1;
        return 0;
    }
    /* The shared-memory files are owned from here on: close them on any early return. */
    if (size < 1 || rank < 0 || rank >= size || segment <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad rank, size or segment");
        goto fail_shm;
    }
    PyObject *seq = PySequence_Fast(ctrl, "ctrl_fds must be a sequence");
    if (!seq) goto fail_shm;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *fds = PyMem_Malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!fds) { Py_DECREF(seq); PyErr_NoMemory(); goto fail_shm; }
    for (Py_ssize_t i = 0; i < n; i++) fds[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (PyErr_Occurred()) { PyMem_Free(fds); goto fail_shm; }
    rr_transport *t = NULL;
    if (size > 1) {
        rr_error err = {0};
        t = rr_tcp_create(rank, size, next_fd, prev_fd, fds, (int)n, timeout, spin, tx_shm, rx_shm, &err);
        if (!t) { PyMem_Free(fds); raise_error(&err, 1); return -1; }
    } else {
        if (tx_shm >= 0) close(tx_shm); /* a world of one has no links */
        if (rx_shm >= 0) close(rx_shm);
    }
    PyMem_Free(fds);
    self->ring = rr_ring_create(t, (size_t)segment);
    self->pid = this_pid;
    if (!self->ring) {
        if (t) t->ops->destroy(t);
        PyErr_NoMemory();
        return -1;
    }
    self->ring->rank = rank;
    self->ring->size = size;
    pthread_mutex_init(&self->mu, NULL);
    self->mu_ready = 1;
    return 0;
fail_shm:
    if (tx_shm >= 0) close(tx_shm);
    if (rx_shm >= 0) close(rx_shm);
    return -1;
}

static void Comm_dealloc(CommObject *self)
{
    close_ring(self);
    if (self->mu_ready) pthread_mutex_destroy(&self->mu);
    Py_CLEAR(self->interrupt);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Runs one ring operation with the GIL released and the lock held. A ring
 * that already knows a peer is lost fails before the operation starts
 * (rr_ring_begin); one called from a signal handler inside an operation, or
 * in a forked child, fails without touching the ring. */
#define RUN_LOCKED(self, err, CALL)                                          \
    do {                                                                     \
        if (reentered(self) || forked_away(self)) {                          \
            rr_set_error(&(err), RR_E_INVALID, -1, forked_away(self)         \
                ? "this communicator belongs to the process that forked this one: call ringreduce.init() here" \
                : "a collective cannot run inside a signal handler that interrupted another one");            \
            break;                                                           \
        }                                                                    \
        atomic_fetch_add(&(self)->callers, 1);                               \
        Py_BEGIN_ALLOW_THREADS                                               \
        pthread_mutex_lock(&(self)->mu);                                     \
        (self)->owner = pthread_self();                                      \
        atomic_store(&(self)->busy, 1);                                      \
        if (!(self)->ring) { /* closed by another thread while we waited */ \
            rr_set_error(&(err), RR_E_INVALID, -1, "ringreduce is shut down: call ringreduce.init() first"); \
        } else if ((self)->broken.code == RR_OK) {                           \
            arm_interrupt(self, 1);                                          \
            if (begin_op(self, &(err)) == RR_OK) { CALL; }                   \
            arm_interrupt(self, 0);                                          \
            if ((err).code != RR_OK) (self)->broken = (err);                 \
        } else {                                                             \
            (err) = (self)->broken;                                          \
            (err).code = -(err).code;                                        \
        }                                                                    \
        atomic_store(&(self)->busy, 0);                                      \
        pthread_mutex_unlock(&(self)->mu);                                   \
        Py_END_ALLOW_THREADS                                                 \
        atomic_fetch_sub(&(self)->callers, 1);                               \
        if ((self)->close_pending) close_ring(self);                         \
    } while (0)

static PyObject *finish(CommObject *self, rr_error *err)
{
    if (err->code == RR_OK) Py_RETURN_NONE;
    if (err->code == RR_E_INTERRUPTED && self->interrupt) { /* the handler's own exception */
        PyObject *exc = self->interrupt;
        self->interrupt = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
        return NULL;
    }
    if (err->code < 0) { err->code = -err->code; return raise_error(err, 0); }
    return raise_error(err, 1);
}

static int get_writable(PyObject *obj, Py_buffer *view)
{
    return PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
}

static int valid_dtype_op(int dtype, int op)
{
    if (dtype < 0 || dtype >= RR_NUM_DTYPES || op < 0 || op >= RR_NUM_OPS) {
        PyErr_SetString(PyExc_ValueError, "unknown dtype or op code");
        return 0;
    }
    return 1;
}

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

static PyObject *Comm_allreduce(CommObject *self, PyObject *args) { return reduce_op(self, args, 0); }
static PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args) { return reduce_op(self, args, 1); }

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

static PyObject *Comm_allgather(CommObject *self, PyObject *args)
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

static PyObject *Comm_broadcast(CommObject *self, PyObject *args)
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
static PyObject *Comm_alltoall(CommObject *self, PyObject *args)
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
    RUN_LOCKED(self, err, pthread_mutex_lock(&(d)->mu); CALL; pthread_mutex_unlock(&(d)->mu))

static int pointer(PyObject *obj, void **p)
{
    *p = PyLong_AsVoidPtr(obj);
    return PyErr_Occurred() ? -1 : 0;
}

/* allreduce_device(device, src, dst, nbytes, dtype, op), reduce_scatter_device(...) */
static PyObject *reduce_on_device(CommObject *self, PyObject *args, int scatter)
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
    RUN_ON_DEVICE(self, d, err,
                  err.code = scatter ? rr_reduce_scatter(self->ring, d->dev, src, dst, count, (rr_dtype)dtype,
                                                         (rr_op)op, &err)
                                     : rr_allreduce(self->ring, d->dev, src, dst, count, (rr_dtype)dtype, (rr_op)op,
                                                    &err));
    return finish(self, &err);
}

static PyObject *Comm_allreduce_device(CommObject *self, PyObject *args) { return reduce_on_device(self, args, 0); }
static PyObject *Comm_reduce_scatter_device(CommObject *self, PyObject *args)
{
    return reduce_on_device(self, args, 1);
}

static PyObject *Comm_allgather_device(CommObject *self, PyObject *args)
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
    RUN_ON_DEVICE(self, d, err, rr_allgather(self->ring, d->dev, buf, nbytes, &err));
    PyMem_Free(nbytes);
    return finish(self, &err);
}

static PyObject *Comm_broadcast_device(CommObject *self, PyObject *args)
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
    RUN_ON_DEVICE(self, d, err, rr_broadcast(self->ring, d->dev, buf, (size_t)nbytes, root, &err));
    return finish(self, &err);
}

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

static PyObject *Comm_exchange_blobs(CommObject *self, PyObject *args)
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
    if (err.code != RR_OK) finish(self, &err);
    else if (agreed) { Py_INCREF(Py_None); result = Py_None; }
    else result = blob_list(all, lens, N);
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

static PyObject *Comm_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return small_allreduce(self, args, nargs, 0);
}

static PyObject *Comm_try_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return small_allreduce(self, args, nargs, 1);
}

/* Says goodbye and frees the ring. In a forked child the ring (sockets,
 * shared mappings, the control star's thread) is the parent's: forget it. */
static void close_ring(CommObject *self)
{
    self->close_pending = 0;
    if (self->closed || !self->ring) {
        self->closed = 1;
        return;
    }
    if (forked_away(self)) {
        self->ring = NULL; /* leaked on purpose: destroying it would say goodbye for the parent */
    } else {
        rr_ring *ring = NULL;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        /* Detached with the GIL held as well as the mutex: the getters and
         * the checks before an operation read self->ring under the GIL
         * alone, and must never see a ring that is being destroyed. (The
         * order mutex, then GIL, is the interrupt hook's too.) */
        Py_BLOCK_THREADS
        if (!self->closed) ring = self->ring; /* another closer got here first: nothing left */
        self->ring = NULL;
        self->closed = 1;
        Py_UNBLOCK_THREADS
        rr_ring_destroy(ring);
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
    }
    self->closed = 1; /* mu stays: another thread may be waiting on it, and finds the ring gone */
}

static PyObject *Comm_close(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    if (reentered(self)) /* from a signal handler inside an operation: once it returns */
        self->close_pending = 1;
    else
        close_ring(self);
    Py_RETURN_NONE;
}

static PyObject *Comm_interrupt(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    atomic_store(&self->stop_requested, 1);
    Py_RETURN_NONE;
}

/* Set from the moment a thread enters an operation (the GIL still held)
 * until it leaves: shutdown() on another thread interrupts such a call,
 * which may be waiting for the mutex, not yet running. */
static PyObject *Comm_get_busy(CommObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(atomic_load(&self->callers) > 0);
}

static PyObject *Comm_get_broken(CommObject *self, void *Py_UNUSED(closure))
{
    if (self->broken.code == RR_OK) Py_RETURN_NONE;
    return PyUnicode_FromString(self->broken.msg);
}

/* Takes the lock, so it waits for an operation running on another thread. */
static PyObject *Comm_set_segment(CommObject *self, PyObject *args)
{
    Py_ssize_t segment;
    if (!PyArg_ParseTuple(args, "n", &segment)) return NULL;
    if (segment <= 0) {
        PyErr_SetString(PyExc_ValueError, "segment must be > 0 bytes");
        return NULL;
    }
    if (refuse_closed(self)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = self->ring ? rr_ring_set_segment(self->ring, (size_t)segment) : 0;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    return PyLong_FromSize_t(self->ring ? self->ring->segment : 0);
}

/* For benchmarks and tests: every rank must choose alike (ring.h). Takes
 * the lock, as set_segment does. */
static PyObject *Comm_set_small_algorithm(CommObject *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (refuse_closed(self)) return NULL;
    const int reaches_any = self->ring->transport && self->ring->transport->ops->sendrecv;
    rr_small_algorithm algo;
    if (!strcmp(name, "auto") || (!strcmp(name, "doubling") && reaches_any)) algo = RR_SMALL_AUTO;
    else if (!strcmp(name, "ring")) algo = RR_SMALL_RING;
    else {
        PyErr_Format(PyExc_ValueError, "small algorithm %s: choose 'auto', 'ring'%s", name,
                     reaches_any ? " or 'doubling'" : " ('doubling' needs a transport that reaches any rank: MPI)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (self->ring) self->ring->small_algorithm = algo;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Comm_get_small_algorithm(CommObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->ring && rr_doubling_usable(self->ring) ? "doubling" : "ring");
}

/* What the busiest rank of a small allreduce sends, in tensors: the cost
 * model of Python's small-path limit (ringreduce/collectives.py). Through
 * the host arena (taken before doubling, ring.c) it is the ring pass's N - 1,
 * so the limit is Config.small_limit's, which the arena's slot is sized for. */
static PyObject *Comm_get_small_rounds(CommObject *self, void *Py_UNUSED(closure))
{
    if (!self->ring) return PyLong_FromLong(0);
    const int N = self->ring->size;
    const int arena = self->ring->arena && self->ring->use_arena;
    return PyLong_FromLong(!arena && rr_doubling_usable(self->ring) ? rr_doubling_rounds(N) : N - 1);
}

/* attach_arena(fd, slot_bytes, spin): maps the host arena (ringreduce/shm.py
 * made and checked the file; every rank attaches it at the same point).
 * Takes ownership of fd. Returns whether the ring took it. */
static PyObject *Comm_attach_arena(CommObject *self, PyObject *args)
{
    int fd, spin;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "ini", &fd, &slot, &spin)) return NULL;
    if (slot <= 0 || !self->ring || forked_away(self) || !self->ring->transport) {
        close(fd);
        PyErr_SetString(PyExc_ValueError, "bad slot size, or the communicator is closed or of one rank");
        return NULL;
    }
    rr_error err = {0};
    rr_arena *arena = rr_arena_map(fd, self->ring->rank, self->ring->size, (size_t)slot, spin, &err);
    if (!arena) return raise_error(&err, 1);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = rr_ring_attach_arena(self->ring, arena);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc) rr_arena_unmap(arena);
    return PyBool_FromLong(rc == 0);
}

/* use_arena(on): switches the attached arena on or off (every rank alike,
 * between operations): benchmarks compare it with the ring pass. */
static PyObject *Comm_use_arena(CommObject *self, PyObject *args)
{
    int on; /* 0 off, else an rr_arena_mode (True: AUTO) */
    if (!PyArg_ParseTuple(args, "i", &on)) return NULL;
    if (on < 0 || on > RR_ARENA_SPLIT) return PyErr_Format(PyExc_ValueError, "no arena mode %d", on);
    if (!self->ring || !self->ring->arena) Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (self->ring) self->ring->use_arena = on; /* closed by another thread meanwhile: nothing to switch */
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
}

static PyObject *Comm_get_arena_slot(CommObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->ring && self->ring->arena && self->ring->use_arena
                             ? rr_arena_slot_bytes(self->ring->arena) : 0);
}

/* Takes the lock, as set_segment. Returns whether ring operations now take
 * the zero-copy path: asked for, and the transport offers windows. The
 * path's byte order differs: every rank must get the same answer, which
 * ringreduce/shm.py's agree_zero_copy sees to. */
static PyObject *Comm_set_zero_copy(CommObject *self, PyObject *args)
{
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    if (refuse_closed(self)) return NULL;
    int used;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    self->ring->zero_copy = on;
    used = on && self->ring->transport && self->ring->transport->ops->rx_window;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(used);
}

static PyObject *Comm_get_zero_copy(CommObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ring && self->ring->zero_copy && self->ring->transport &&
                           self->ring->transport->ops->rx_window);
}

/* Takes the lock, as set_zero_copy. pid: prev's process, agreed by every
 * rank (ringreduce/shm.py agree_cma), or 0 to stop. Returns whether host
 * ring operations from 1 MiB a chunk now take the CMA path (cma.h). */
static PyObject *Comm_set_cma(CommObject *self, PyObject *args)
{
    int pid;
    if (!PyArg_ParseTuple(args, "i", &pid)) return NULL;
    if (refuse_closed(self)) return NULL;
    int used;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    used = pid > 0 && self->ring->transport && self->ring->transport->ops->prev_alive;
    self->ring->cma_pid = used ? pid : 0;
    used = used && self->ring->zero_copy;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(used);
}

/* cma_probe(pid, address, expected bytes): whether this process may read
 * that process's memory (process_vm_readv) and finds the bytes there. */
static PyObject *Comm_cma_probe(PyObject *Py_UNUSED(cls), PyObject *args)
{
    int pid;
    unsigned long long addr;
    Py_buffer want;
    if (!PyArg_ParseTuple(args, "iKy*", &pid, &addr, &want)) return NULL;
    int ok = rr_cma_probe(pid, addr, want.buf, (size_t)want.len);
    PyBuffer_Release(&want);
    return PyBool_FromLong(ok);
}

static PyObject *Comm_get_cma_pid(CommObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->ring ? self->ring->cma_pid : 0);
}

static PyObject *Comm_cma_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->cma_ops : 0);
}

static PyObject *Comm_mapped_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->mapped_ops : 0);
}

static PyObject *Comm_zero_copy_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->zero_copy_ops : 0);
}

static PyObject *Comm_last_phases(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->ring) Py_RETURN_NONE;
    const double *t = self->ring->phase_times;
    return Py_BuildValue("(ddd)", t[0], t[1], t[2]);
}

/* Read without the lock: a running operation may be adding to it, and a
 * 64-bit load on its own is good enough for a statistic. */
static PyObject *Comm_bytes(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    const unsigned long long *s = self->ring && self->ring->transport ? self->ring->transport->sent : NULL;
    if (!s) return Py_BuildValue("(KKK)", 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKK)", s[RR_SENT_RING], s[RR_SENT_BLOBS], s[RR_SENT_ALLTOALL]);
}

static PyObject *Comm_bytes_via(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    const unsigned long long *v = self->ring && self->ring->transport ? self->ring->transport->via : NULL;
    if (!v) return Py_BuildValue("(KKKKK)", 0ULL, 0ULL, 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKKKK)", v[RR_VIA_TCP], v[RR_VIA_SHM], v[RR_VIA_CMA], v[RR_VIA_ARENA], v[RR_VIA_MPI]);
}

static PyMethodDef Comm_methods[] = {
    {"bytes", (PyCFunction)Comm_bytes, METH_NOARGS,
     "bytes sent to the next rank so far: (ring data steps, blob exchanges, alltoall)"},
    {"bytes_via", (PyCFunction)Comm_bytes_via, METH_NOARGS,
     "the same bytes by how they went: (tcp, shm, cma, arena, mpi); both tuples sum alike"},
    {"set_segment", (PyCFunction)Comm_set_segment, METH_VARARGS,
     "set_segment(bytes): the ring's pipeline segment from the next operation on (rounded up to 64); returns it"},
    {"set_small_algorithm", (PyCFunction)Comm_set_small_algorithm, METH_VARARGS,
     "set_small_algorithm('auto' | 'ring' | 'doubling'): of the small operations from the next one on; "
     "every rank must choose alike"},
    {"set_zero_copy", (PyCFunction)Comm_set_zero_copy, METH_VARARGS,
     "set_zero_copy(on): reduce straight in shared-memory links from the next operation on; "
     "returns whether that path is now taken (both links shared memory); every rank must agree"},
    {"set_cma", (PyCFunction)Comm_set_cma, METH_VARARGS,
     "set_cma(prev_pid): read the previous rank's buffers by Cross Memory Attach from the next operation "
     "on (0: stop); returns whether that path is now taken; every rank must agree (shm.agree_cma)"},
    {"cma_probe", (PyCFunction)Comm_cma_probe, METH_VARARGS | METH_STATIC,
     "cma_probe(pid, address, expected): whether process_vm_readv reads those bytes there"},
    {"cma_ops", (PyCFunction)Comm_cma_ops, METH_NOARGS,
     "how many ring operations so far took the Cross Memory Attach path"},
    {"mapped_ops", (PyCFunction)Comm_mapped_ops, METH_NOARGS,
     "CMA operations that read the previous rank's data out of its shared arrays mapped here (csrc/peer_map.h)"},
    {"zero_copy_ops", (PyCFunction)Comm_zero_copy_ops, METH_NOARGS,
     "how many ring operations so far reduced straight in the shared-memory mappings"},
    {"last_phases", (PyCFunction)Comm_last_phases, METH_NOARGS,
     "(start, ScatterReduce done, end) of the last ring allreduce, in time.monotonic() seconds"},
    {"allreduce", (PyCFunction)Comm_allreduce, METH_VARARGS,
     "allreduce(src, dst, dtype, op): dst = reduction of every rank's src; dst may be src"},
    {"reduce_scatter", (PyCFunction)Comm_reduce_scatter, METH_VARARGS,
     "reduce_scatter(src, dst, dtype, op): chunk `rank` of dst ends reduced"},
    {"allgather", (PyCFunction)Comm_allgather, METH_VARARGS,
     "allgather(buf, nbytes): in place; this rank's block already filled"},
    {"broadcast", (PyCFunction)Comm_broadcast, METH_VARARGS, "broadcast(buf, root): in place"},
    {"alltoall", (PyCFunction)Comm_alltoall, METH_VARARGS,
     "alltoall(src, dst, bytes): block bytes[r*N + d] of src goes to rank d; dst gets every rank's block for us"},
    {"allreduce_device", (PyCFunction)Comm_allreduce_device, METH_VARARGS,
     "allreduce_device(device, src, dst, nbytes, dtype, op): allreduce of device memory (pointers)"},
    {"reduce_scatter_device", (PyCFunction)Comm_reduce_scatter_device, METH_VARARGS,
     "reduce_scatter_device(device, src, dst, nbytes, dtype, op)"},
    {"allgather_device", (PyCFunction)Comm_allgather_device, METH_VARARGS,
     "allgather_device(device, buf, nbytes): in place in device memory"},
    {"broadcast_device", (PyCFunction)Comm_broadcast_device, METH_VARARGS,
     "broadcast_device(device, buf, nbytes, root): in place in device memory"},
    {"exchange_blobs", (PyCFunction)Comm_exchange_blobs, METH_VARARGS,
     "exchange_blobs(head, data=b'') -> list of every rank's head+data, in rank order"},
    {"allreduce_small", (PyCFunction)(void (*)(void))Comm_allreduce_small, METH_FASTCALL,
     "allreduce_small(head, data, out, dtype, op) -> None, or every rank's blob when headers differ"},
    {"try_allreduce_small", (PyCFunction)(void (*)(void))Comm_try_allreduce_small, METH_FASTCALL,
     "try_allreduce_small(head, data, out, dtype, op): as allreduce_small, but NotImplemented, with nothing "
     "sent, for buffers it cannot use as given (not C-contiguous, out read-only, shapes differ)"},
    {"attach_arena", (PyCFunction)Comm_attach_arena, METH_VARARGS,
     "attach_arena(fd, slot_bytes, spin) -> whether the ring took the host arena (ringreduce/shm.py)"},
    {"use_arena", (PyCFunction)Comm_use_arena, METH_VARARGS,
     "use_arena(on): small operations through the attached arena or around the ring (all ranks alike); "
     "on may name how the arena reduces (host_arena.h's rr_arena_mode: 1 auto, 2 copy, 3 direct, 4 split)"},
    {"close", (PyCFunction)Comm_close, METH_NOARGS, "say goodbye to the peers and free everything"},
    {"interrupt", (PyCFunction)Comm_interrupt, METH_NOARGS,
     "from any thread: the running operation (and every later one) fails, and the peers learn this rank left"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Comm_getset[] = {
    {"broken", (getter)Comm_get_broken, NULL, "why the communicator is unusable, or None", NULL},
    {"busy", (getter)Comm_get_busy, NULL, "whether a thread is inside an operation on this communicator", NULL},
    {"small_algorithm", (getter)Comm_get_small_algorithm, NULL,
     "the small operations' algorithm in effect: 'doubling' or 'ring'", NULL},
    {"small_rounds", (getter)Comm_get_small_rounds, NULL,
     "tensors the busiest rank of a small allreduce sends (doubling: log2 N, +1 off powers of two; ring: N-1)",
     NULL},
    {"arena_slot", (getter)Comm_get_arena_slot, NULL, "blob bytes per rank of the host arena in use, 0: none", NULL},
    {"cma_pid", (getter)Comm_get_cma_pid, NULL,
     "the previous rank's pid where the ranks agreed on Cross Memory Attach (set_cma), else 0", NULL},
    {"zero_copy", (getter)Comm_get_zero_copy, NULL,
     "whether host ring operations take the zero-copy path now (set_zero_copy's last answer)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringreduce._core.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A ring of ranks over connected sockets: Comm(rank, size, next_fd, prev_fd, ctrl_fds, timeout, segment, spin=100)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Comm_init,
    .tp_dealloc = (destructor)Comm_dealloc,
    .tp_methods = Comm_methods,
    .tp_getset = Comm_getset,
};

/* Local kernels, for the small-message path (reduce what every rank sent, in
 * rank order) and for tests and benchmarks of the kernels themselves. */
static PyObject *core_reduce(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *dst_obj;
    Py_buffer src;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "Oy*ii", &dst_obj, &src, &dtype, &op)) return NULL;
    if (!valid_dtype_op(dtype, op)) { PyBuffer_Release(&src); return NULL; }
    Py_buffer dst;
    if (get_writable(dst_obj, &dst)) { PyBuffer_Release(&src); return NULL; }
    if (dst.len != src.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "dst and src differ in size");
        return NULL;
    }
    size_t count = (size_t)dst.len / rr_dtype_size((rr_dtype)dtype);
    Py_BEGIN_ALLOW_THREADS
    rr_reduce(dst.buf, src.buf, count, (rr_dtype)dtype, (rr_op)op);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *core_mean_fold(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *dst_obj;
    Py_buffer x;
    int dtype, k;
    if (!PyArg_ParseTuple(args, "Oy*ii", &dst_obj, &x, &dtype, &k)) return NULL;
    if (dtype < 0 || dtype >= RR_NUM_DTYPES || !rr_avg_is_mean((rr_dtype)dtype) || k < 2) {
        PyBuffer_Release(&x);
        PyErr_SetString(PyExc_ValueError, "mean_fold takes a 16-bit float dtype and k >= 2");
        return NULL;
    }
    Py_buffer dst;
    if (get_writable(dst_obj, &dst)) { PyBuffer_Release(&x); return NULL; }
    if (dst.len != x.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&x);
        PyErr_SetString(PyExc_ValueError, "dst and x differ in size");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rr_mean_fold(dst.buf, x.buf, dst.buf, (size_t)dst.len / 2, (rr_dtype)dtype, k);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyObject *core_divide(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *obj;
    int dtype, n;
    if (!PyArg_ParseTuple(args, "Oii", &obj, &dtype, &n)) return NULL;
    if (!valid_dtype_op(dtype, 0) || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype or divisor");
        return NULL;
    }
    Py_buffer view;
    if (get_writable(obj, &view)) return NULL;
    size_t count = (size_t)view.len / rr_dtype_size((rr_dtype)dtype);
    Py_BEGIN_ALLOW_THREADS
    rr_divide(view.buf, count, (rr_dtype)dtype, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* kernels16() -> the 16-bit float kernels in use; kernels16(name) uses
 * those, or the best the CPU runs if that is less, and returns the name. */
static PyObject *core_kernels16(PyObject *Py_UNUSED(m), PyObject *args)
{
    static const char *names[] = {"portable", "avx2", "avx512"};
    const char *want = NULL;
    if (!PyArg_ParseTuple(args, "|s", &want)) return NULL;
    rr_kernels16 level = rr_kernels16_current();
    if (want) {
        int i = 0;
        while (i < (int)(sizeof names / sizeof *names) && strcmp(names[i], want) != 0) i++;
        if (i == (int)(sizeof names / sizeof *names)) {
            PyErr_Format(PyExc_ValueError, "kernels16: unknown kernels %R (portable, avx2, avx512)", PyTuple_GET_ITEM(args, 0));
            return NULL;
        }
        level = rr_kernels16_use((rr_kernels16)i);
    }
    return PyUnicode_FromString(names[level]);
}

static PyObject *core_arena_file_bytes(PyObject *Py_UNUSED(m), PyObject *args)
{
    int size;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "in", &size, &slot)) return NULL;
    if (size < 1 || slot <= 0) {
        PyErr_SetString(PyExc_ValueError, "size and slot_bytes must be > 0");
        return NULL;
    }
    return PyLong_FromSize_t(rr_arena_file_bytes(size, (size_t)slot));
}

static PyMethodDef core_methods[] = {
    {"arena_file_bytes", core_arena_file_bytes, METH_VARARGS,
     "arena_file_bytes(size, slot_bytes): size of a host arena's file (csrc/host_arena.h)"},
    {"kernels16", core_kernels16, METH_VARARGS,
     "kernels16([name]) -> the 16-bit float kernels in use ('portable', 'avx2', 'avx512'); with a name, use those "
     "(or the best this CPU runs, if less)"},
    {"reduce", core_reduce, METH_VARARGS, "reduce(dst, src, dtype, op): dst = dst OP src, elementwise"},
    {"mean_fold", core_mean_fold, METH_VARARGS,
     "mean_fold(dst, x, dtype, k): dst = (dst * (k-1) + x) / k, one fold of a 16-bit float average"},
    {"divide", core_divide, METH_VARARGS, "divide(buf, dtype, n): the division that finishes avg"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "_core", "ringreduce's C ring", -1, core_methods};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&CommType) < 0 || PyType_Ready(&DeviceType) < 0 ||
        PyType_Ready(&SharedRegionType) < 0)
        return NULL;
    this_pid = getpid();
    pthread_atfork(NULL, NULL, forked_child);
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    Py_XDECREF(threading);
    Py_XDECREF(main);
    if (!ident) return NULL;
    main_thread = PyLong_AsUnsignedLong(ident);
    Py_DECREF(ident);
    if (PyErr_Occurred()) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    Py_INCREF(&CommType);
    PyModule_AddObject(m, "Comm", (PyObject *)&CommType);
    Py_INCREF(&DeviceType);
    PyModule_AddObject(m, "Device", (PyObject *)&DeviceType);
    Py_INCREF(&SharedRegionType);
    PyModule_AddObject(m, "SharedRegion", (PyObject *)&SharedRegionType);
    static const char *dtypes[] = {"FLOAT16", "BFLOAT16", "FLOAT32", "FLOAT64", "INT8", "UINT8", "INT32", "INT64",
                                   "INT16", "UINT16"};
    for (int i = 0; i < RR_NUM_DTYPES; i++) PyModule_AddIntConstant(m, dtypes[i], i);
    static const char *ops[] = {"SUM", "PROD", "MIN", "MAX", "AVG"};
    for (int i = 0; i < RR_NUM_OPS; i++) PyModule_AddIntConstant(m, ops[i], i);
    return m;
}
