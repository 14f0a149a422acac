/* ringreduce._core as Python sees it: the Comm type (its methods and
 * attributes), the Device and SharedRegion types, the module's functions and
 * its dtype and op constants. The methods live by what they do:
 *
 *   comm.c         a Comm's life: made, closed, interrupted; the checks before each operation
 *   collectives.c  the collectives, on host buffers and on device memory
 *   tuning.c       switches among a ring's equivalent paths, and their set-up
 *   counters.c     what the ring counted (bytes sent, paths taken, phase times)
 *   signals.c      signals and interrupt() while an operation waits
 *   errors.c       C errors as Python exceptions
 *   kernels.c      the reduction kernels on local buffers
 *   device_binding.c, shared_region_binding.c: the Device and SharedRegion types
 */
#include "binding/binding.h"
#include "binding/device_binding.h"
#include "binding/shared_region_binding.h"
#include "kernels/reduce_math.h"

static PyMethodDef Comm_methods[] = {
    {"bytes", (PyCFunction)Comm_bytes, METH_NOARGS,
     "bytes sent to the next rank so far: (ring data steps, blob exchanges, alltoall)"},
    {"bytes_via", (PyCFunction)Comm_bytes_via, METH_NOARGS,
     "the same bytes by how they went: (tcp, shm, cma, arena, mpi); both tuples sum alike"},
    {"bytes_received", (PyCFunction)Comm_bytes_received, METH_NOARGS,
     "bytes of the others' data taken in so far, by how they came: (tcp, shm, cma, arena, mpi)"},
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
     "CMA operations that read the previous rank's data out of its shared arrays mapped here (csrc/memory/peer_map.h)"},
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
    {"allreduce_ipc", (PyCFunction)Comm_allreduce_ipc, METH_VARARGS,
     "allreduce_ipc(device, src, dst, nbytes, dtype, op): allreduce of device memory, device to device (IPC path)"},
    {"reduce_scatter_ipc", (PyCFunction)Comm_reduce_scatter_ipc, METH_VARARGS,
     "reduce_scatter_ipc(device, src, dst, nbytes, dtype, op): reduce_scatter_device's IPC path"},
    {"allreduce_small_ipc", (PyCFunction)Comm_allreduce_small_ipc, METH_VARARGS,
     "allreduce_small_ipc(head, device, src, dst, nbytes, dtype, op, slot_bytes) -> None, or every rank's blob "
     "when headers differ: the one-pass small allreduce of device memory over IPC"},
    {"release_ipc", (PyCFunction)Comm_release_ipc, METH_VARARGS,
     "release_ipc(devices): collective, before close on a ring that agreed on IPC: the peers' windows this ring "
     "used closed on each device, a handshake, then the ring's own small windows freed"},
    {"allgather_ipc", (PyCFunction)Comm_allgather_ipc, METH_VARARGS,
     "allgather_ipc(device, buf, nbytes): allgather_device's IPC path"},
    {"broadcast_ipc", (PyCFunction)Comm_broadcast_ipc, METH_VARARGS,
     "broadcast_ipc(device, buf, nbytes, root): broadcast_device's IPC path"},
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
    {"set_timeout", (PyCFunction)Comm_set_timeout, METH_VARARGS,
     "set_timeout(seconds): how long later waits may see no progress before a peer is silent (inf: never)"},
    {"interrupt", (PyCFunction)Comm_interrupt, METH_NOARGS,
     "from any thread: the running operation (and every later one) fails, and the peers learn this rank left"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Comm_getset[] = {
    {"broken", (getter)Comm_get_broken, NULL, "why the communicator is unusable, or None", NULL},
    {"busy", (getter)Comm_get_busy, NULL, "whether a thread is inside an operation on this communicator", NULL},
    {"ring_id", (getter)Comm_get_ring_id, NULL,
     "the ring's id, unique in this process (what a Device keeps IPC state for); 0 once closed", NULL},
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

PyTypeObject CommType = {
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

static PyMethodDef core_methods[] = {
    {"arena_file_bytes", core_arena_file_bytes, METH_VARARGS,
     "arena_file_bytes(size, slot_bytes): size of a host arena's file (csrc/schedule/host_arena.h)"},
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
    comm_track_pid();
    if (comm_find_main_thread() < 0) return NULL;
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
