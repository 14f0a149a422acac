/* What a Comm has counted, for ringreduce.stats(), tests and benchmarks:
 * bytes sent by kind (the transport counts them, transport.h), how many ring
 * operations took the zero-copy, Cross Memory Attach and mapped paths, and
 * the phase times of the last ring allreduce. Reading one never changes
 * what the ring does.
 */
#include "binding/binding.h"

PyObject *Comm_cma_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->cma_ops : 0);
}

PyObject *Comm_mapped_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->mapped_ops : 0);
}

PyObject *Comm_zero_copy_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->ring ? self->ring->zero_copy_ops : 0);
}

PyObject *Comm_last_phases(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->ring) Py_RETURN_NONE;
    const double *t = self->ring->phase_times;
    return Py_BuildValue("(ddd)", t[0], t[1], t[2]);
}

/* Read without the lock: a running operation may be adding to it, and a
 * 64-bit load on its own is good enough for a statistic. */
PyObject *Comm_bytes(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    const unsigned long long *s = self->ring && self->ring->transport ? self->ring->transport->sent : NULL;
    if (!s) return Py_BuildValue("(KKK)", 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKK)", s[RR_SENT_RING], s[RR_SENT_BLOBS], s[RR_SENT_ALLTOALL]);
}

/* Bytes of the others' data this rank took in, by how they came (RR_VIA_* order). */
PyObject *Comm_bytes_received(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    const unsigned long long *v = self->ring && self->ring->transport ? self->ring->transport->received : NULL;
    if (!v) return Py_BuildValue("(KKKKK)", 0ULL, 0ULL, 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKKKK)", v[RR_VIA_TCP], v[RR_VIA_SHM], v[RR_VIA_CMA], v[RR_VIA_ARENA], v[RR_VIA_MPI]);
}

/* The same bytes by how they went; both tuples sum alike. */
PyObject *Comm_bytes_via(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    const unsigned long long *v = self->ring && self->ring->transport ? self->ring->transport->via : NULL;
    if (!v) return Py_BuildValue("(KKKKK)", 0ULL, 0ULL, 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKKKK)", v[RR_VIA_TCP], v[RR_VIA_SHM], v[RR_VIA_CMA], v[RR_VIA_ARENA], v[RR_VIA_MPI]);
}
