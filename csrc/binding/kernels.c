/* The reduction kernels (kernels/reduce.h) on local buffers: for the
 * small-message path (reduce what every rank sent, in rank order) and for
 * tests and benchmarks of the kernels themselves. The GIL is released while
 * a kernel runs.
 */
#include "binding/binding.h"
#include "kernels/reduce.h"

PyObject *core_reduce(PyObject *Py_UNUSED(m), PyObject *args)
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

PyObject *core_mean_fold(PyObject *Py_UNUSED(m), PyObject *args)
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

PyObject *core_divide(PyObject *Py_UNUSED(m), PyObject *args)
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
