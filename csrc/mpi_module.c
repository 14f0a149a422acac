/* ringreduce._mpi: builds the MPI transport for a communicator and hands it
 * to ringreduce._core as a capsule (the Comm then owns it). Built only where
 * an MPI is found; see setup.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "mpi_transport.h"

static PyObject *create(PyObject *Py_UNUSED(m), PyObject *args)
{
    long fhandle;
    double timeout;
    if (!PyArg_ParseTuple(args, "ld", &fhandle, &timeout)) return NULL;
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        PyErr_SetString(PyExc_RuntimeError, "MPI is not initialized (import mpi4py.MPI first)");
        return NULL;
    }
    rr_transport *t = rr_mpi_create(MPI_Comm_f2c((MPI_Fint)fhandle), timeout);
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
    {"create", create, METH_VARARGS, "create(fortran_handle, timeout) -> transport capsule for _core.Comm"},
    {"library_version", library_version, METH_NOARGS, "the MPI library this module was built against"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mpi_module = {PyModuleDef_HEAD_INIT, "_mpi", "ringreduce's MPI transport", -1, methods};

PyMODINIT_FUNC PyInit__mpi(void) { return PyModule_Create(&mpi_module); }
