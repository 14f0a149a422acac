/* ringreduce._mpi: builds the MPI transport for a communicator and hands it
 * to ringreduce._core as a capsule (the Comm then owns it). Built only where
 * an MPI is found; see setup.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "transport/mpi_transport.h"

/* create(fortran_handle, timeout, pids=None): pids, every rank's process
 * id in rank order where all share this host's pid namespace (see
 * rr_mpi_create). */
static PyObject *create(PyObject *Py_UNUSED(m), PyObject *args)
{
    long fhandle;
    double timeout;
    PyObject *pid_list = Py_None;
    if (!PyArg_ParseTuple(args, "ld|O", &fhandle, &timeout, &pid_list)) return NULL;
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        PyErr_SetString(PyExc_RuntimeError, "MPI is not initialized (import mpi4py.MPI first)");
        return NULL;
    }
    MPI_Comm comm = MPI_Comm_f2c((MPI_Fint)fhandle);
    int size = 0, *pids = NULL;
    MPI_Comm_size(comm, &size);
    if (pid_list != Py_None) {
        PyObject *seq = PySequence_Fast(pid_list, "pids must be a sequence of ints");
        if (!seq) return NULL;
        if (PySequence_Fast_GET_SIZE(seq) != size) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError, "pids: %d wanted, one per rank", size);
        }
        if (!(pids = PyMem_Malloc(sizeof *pids * (size_t)(size ? size : 1)))) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        for (int i = 0; i < size; i++) pids[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        Py_DECREF(seq);
        if (PyErr_Occurred()) {
            PyMem_Free(pids);
            return NULL;
        }
    }
    rr_transport *t = rr_mpi_create(comm, timeout, pids);
    PyMem_Free(pids);
    if (!t) {
        PyErr_SetString(PyExc_RuntimeError, "could not set up the MPI transport (MPI_Comm_dup failed)");
        return NULL;
    }
    return PyCapsule_New(t, "ringreduce.transport", NULL);
}

static PyObject *library_version(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return PyUnicode_FromStringAndSize(text, len);
}

static PyMethodDef methods[] = {
    {"create", create, METH_VARARGS, "create(fortran_handle, timeout, pids=None) -> transport capsule for _core.Comm"},
    {"library_version", library_version, METH_NOARGS, "the MPI library this module was built against"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mpi_module = {PyModuleDef_HEAD_INIT, "_mpi", "ringreduce's MPI transport", -1, methods};

PyMODINIT_FUNC PyInit__mpi(void) { return PyModule_Create(&mpi_module); }
