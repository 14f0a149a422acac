/* The C core's errors (rr_error) as Python exceptions: PeerLostError or
 * RingReduceError (ringreduce.errors) carrying the rank at fault, MemoryError
 * for an allocation that failed; and a Comm's refusal once it is closed or
 * broken, which repeats the first error on every later call.
 */
#include <string.h>

#include "binding/binding.h"
#include "binding/device_binding.h"

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
PyObject *raise_error(const rr_error *err, int first)
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

int check_usable(CommObject *self)
{
    if (self->closed) {
        PyObject *cls = error_class("RingReduceError");
        if (cls) { PyErr_SetString(cls, "ringreduce is shut down: call ringreduce.init() first"); Py_DECREF(cls); }
        return -1;
    }
    if (self->broken.code != RR_OK) { raise_error(&self->broken, 0); return -1; }
    return 0;
}

/* The setters' guard: 1, with a ValueError set, when there is no ring to set. */
int refuse_closed(CommObject *self)
{
    if (self->ring && !forked_away(self)) return 0;
    PyErr_SetString(PyExc_ValueError, "the communicator is closed");
    return 1;
}

PyObject *finish(CommObject *self, rr_error *err)
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
