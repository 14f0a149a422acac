/* ringreduce._core.Comm's life: made over TCP sockets (a link's data through
 * shared memory where Python gives its file) or over a transport built
 * elsewhere (ringreduce._mpi's capsule), closed, interrupted; and the checks
 * every operation passes before it touches the ring (begin_op).
 *
 * A Comm is used by one operation at a time (its mutex), and after any
 * failure it stays broken and says why on every later call (errors.c). A
 * Comm belongs to the process that made it: in a forked child every call
 * refuses, and closing it forgets the parent's ring without touching it.
 */
#include <string.h>
#include <unistd.h>

#include "binding/binding.h"
#include "transport/tcp.h"

pid_t this_pid; /* binding.h */
static void forked_child(void) { this_pid = getpid(); }

void comm_track_pid(void)
{
    this_pid = getpid();
    pthread_atfork(NULL, NULL, forked_child);
}

/* Before each operation: after interrupt() nothing more runs (and the peers
 * are told), and a ring that knows a peer is lost fails at once. */
int begin_op(CommObject *self, rr_error *err)
{
    if (atomic_load(&self->stop_requested)) {
        rr_set_error(err, RR_E_INTERRUPTED, self->ring->rank, "rank %d was interrupted while leaving the ring",
                     self->ring->rank);
        if (self->ring->transport) self->ring->transport->ops->abort(self->ring->transport, err);
        return err->code;
    }
    return rr_ring_begin(self->ring, err);
}

/* Comm(rank, size, next_fd, prev_fd, ctrl_fds, timeout, segment, spin=100,
 * tx_shm=-1, rx_shm=-1) runs over TCP sockets (a link's data through shared
 * memory where tx_shm / rx_shm give its file); Comm(rank, size, -1, -1, (), timeout, segment,
 * transport=capsule) over a transport built elsewhere (ringreduce._mpi). */
int Comm_init(CommObject *self, PyObject *args, PyObject *kw)
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

void Comm_dealloc(CommObject *self)
{
    close_ring(self);
    if (self->mu_ready) pthread_mutex_destroy(&self->mu);
    Py_CLEAR(self->interrupt);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Says goodbye and frees the ring. In a forked child the ring (sockets,
 * shared mappings, the control star's thread) is the parent's: forget it. */
void close_ring(CommObject *self)
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

PyObject *Comm_close(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    if (reentered(self)) /* from a signal handler inside an operation: once it returns */
        self->close_pending = 1;
    else
        close_ring(self);
    Py_RETURN_NONE;
}

/* set_timeout(seconds): how long this rank's later waits may see no
 * progress (inf: for ever); called between operations, under the ring's lock. */
PyObject *Comm_set_timeout(CommObject *self, PyObject *args)
{
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s)) return NULL;
    rr_transport *t = self->ring ? self->ring->transport : NULL;
    if (t && t->ops->set_timeout) t->ops->set_timeout(t, timeout_s);
    Py_RETURN_NONE;
}

PyObject *Comm_interrupt(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    atomic_store(&self->stop_requested, 1);
    Py_RETURN_NONE;
}

/* Set from the moment a thread enters an operation (the GIL still held)
 * until it leaves: shutdown() on another thread interrupts such a call,
 * which may be waiting for the mutex, not yet running. */
PyObject *Comm_get_busy(CommObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(atomic_load(&self->callers) > 0);
}

PyObject *Comm_get_ring_id(CommObject *self, void *Py_UNUSED(closure))
{
    rr_ring *ring = self->closed ? NULL : self->ring;
    return PyLong_FromUnsignedLongLong(ring ? ring->id : 0);
}

PyObject *Comm_get_broken(CommObject *self, void *Py_UNUSED(closure))
{
    if (self->broken.code == RR_OK) Py_RETURN_NONE;
    return PyUnicode_FromString(self->broken.msg);
}
