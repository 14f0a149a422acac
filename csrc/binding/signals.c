/* Signals and interrupt() while an operation waits with the GIL released.
 *
 * The transport asks its interrupt hook (transport.h) every ~100 ms while
 * it waits; arm_interrupt() installs signals_pending as that hook for the
 * length of one operation. A stop request from another thread ends the
 * operation; on the main thread, the only one Python runs signal handlers
 * on, the hook runs them, so Ctrl-C or a SIGTERM handler's exception ends it
 * too, and finish() (errors.c) raises that exception.
 */
#include "binding/binding.h"

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

void arm_interrupt(CommObject *self, int armed)
{
    rr_transport *t = self->ring ? self->ring->transport : NULL;
    if (!t) return;
    t->interrupted = armed ? signals_pending : NULL;
    t->interrupt_arg = self;
}

int comm_find_main_thread(void)
{
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    Py_XDECREF(threading);
    Py_XDECREF(main);
    if (!ident) return -1;
    main_thread = PyLong_AsUnsignedLong(ident);
    Py_DECREF(ident);
    return PyErr_Occurred() ? -1 : 0;
}
