/* The switches that choose among a ring's paths, and the set-up those paths
 * need: the pipeline segment, the small operations' algorithm, the host
 * arena, the zero-copy and Cross Memory Attach paths, and the 16-bit float
 * kernels in use.
 *
 * Every path gives the same results; a switch changes only how the bytes
 * move. Those that change the order of bytes on the wire must be set alike
 * on every rank, between operations (Python agrees on them first:
 * ringreduce/shm.py). A setter that touches the ring takes the Comm's lock,
 * so it waits for an operation running on another thread.
 */
#include <string.h>
#include <unistd.h>

#include "binding/binding.h"
#include "kernels/reduce16.h"
#include "schedule/cma.h"
#include "schedule/recursive_doubling.h"

/* Takes the lock, so it waits for an operation running on another thread. */
PyObject *Comm_set_segment(CommObject *self, PyObject *args)
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
PyObject *Comm_set_small_algorithm(CommObject *self, PyObject *args)
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

PyObject *Comm_get_small_algorithm(CommObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->ring && rr_doubling_usable(self->ring) ? "doubling" : "ring");
}

/* What the busiest rank of a small allreduce sends, in tensors: the cost
 * model of Python's small-path limit (ringreduce/collectives.py). Through
 * the host arena (taken before doubling, ring.c) it is the ring pass's N - 1,
 * so the limit is Config.small_limit's, which the arena's slot is sized for. */
PyObject *Comm_get_small_rounds(CommObject *self, void *Py_UNUSED(closure))
{
    if (!self->ring) return PyLong_FromLong(0);
    const int N = self->ring->size;
    const int arena = self->ring->arena && self->ring->use_arena;
    return PyLong_FromLong(!arena && rr_doubling_usable(self->ring) ? rr_doubling_rounds(N) : N - 1);
}

/* attach_arena(fd, slot_bytes, spin): maps the host arena (ringreduce/shm.py
 * made and checked the file; every rank attaches it at the same point).
 * Takes ownership of fd. Returns whether the ring took it. */
PyObject *Comm_attach_arena(CommObject *self, PyObject *args)
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
PyObject *Comm_use_arena(CommObject *self, PyObject *args)
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

PyObject *Comm_get_arena_slot(CommObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->ring && self->ring->arena && self->ring->use_arena
                             ? rr_arena_slot_bytes(self->ring->arena) : 0);
}

/* Takes the lock, as set_segment. Returns whether ring operations now take
 * the zero-copy path: asked for, and the transport offers windows. The
 * path's byte order differs: every rank must get the same answer, which
 * ringreduce/shm.py's agree_zero_copy sees to. */
PyObject *Comm_set_zero_copy(CommObject *self, PyObject *args)
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

PyObject *Comm_get_zero_copy(CommObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ring && self->ring->zero_copy && self->ring->transport &&
                           self->ring->transport->ops->rx_window);
}

/* Takes the lock, as set_zero_copy. pid: prev's process, agreed by every
 * rank (ringreduce/shm.py agree_cma), or 0 to stop. Returns whether host
 * ring operations from 1 MiB a chunk now take the CMA path (cma.h). */
PyObject *Comm_set_cma(CommObject *self, PyObject *args)
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
PyObject *Comm_cma_probe(PyObject *Py_UNUSED(cls), PyObject *args)
{
    int pid;
    unsigned long long addr;
    Py_buffer want;
    if (!PyArg_ParseTuple(args, "iKy*", &pid, &addr, &want)) return NULL;
    int ok = rr_cma_probe(pid, addr, want.buf, (size_t)want.len);
    PyBuffer_Release(&want);
    return PyBool_FromLong(ok);
}

PyObject *Comm_get_cma_pid(CommObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->ring ? self->ring->cma_pid : 0);
}

/* kernels16() -> the 16-bit float kernels in use; kernels16(name) uses
 * those, or the best the CPU runs if that is less, and returns the name. */
PyObject *core_kernels16(PyObject *Py_UNUSED(m), PyObject *args)
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

PyObject *core_arena_file_bytes(PyObject *Py_UNUSED(m), PyObject *args)
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
