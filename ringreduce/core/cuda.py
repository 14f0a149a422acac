"""ringreduce's CUDA kernels (csrc/kernels/cuda/reduce.cu), loaded through cupy.

The kernels come from a fatbin that setup.py builds with nvcc when asked
(RINGREDUCE_CUDA=1, for sm_80 and sm_90), or else are compiled at run time
from the same source by cupy.RawModule. Nothing here runs without cupy and a
GPU; importing this module never needs either.

    from ringreduce import cuda
    cuda.reduce3(dst, a, b, "sum")       # cupy arrays, on the current device and stream
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ..errors import RingReduceError
from . import device_ipc

PACKAGE = Path(__file__).resolve().parent.parent  # ringreduce/, holding the fatbin and (in a wheel) csrc/
FATBIN = PACKAGE / "reduce_kernels.fatbin"
# a wheel's copy (setup.py), then the source tree
SOURCE_DIRS = [PACKAGE / "csrc" / "kernels", PACKAGE.parent / "csrc" / "kernels"]

# In the C core's code order (rr_dtype, rr_op): the ring's device takes its kernels so.
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "int16", "uint16")
OPS = ("sum", "prod", "min", "max")
MEAN_DTYPES = ("float16", "bfloat16")  # averaged as running means (rr_mean_<dtype>), not sum-then-divide
THREADS = 256


def cupy_or_none():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def available() -> str | None:
    """None if GPU kernels can run here, else why not."""
    cp = cupy_or_none()
    if cp is None:
        return "cupy is not installed"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # cupy raises its own runtime errors without a driver
        return f"no usable CUDA device ({exc})"
    return None


@functools.lru_cache(maxsize=None)
def kernels():
    """The compiled kernels (a cupy.RawModule: the fatbin, else reduce.cu
    compiled now); RingReduceError without cupy and a CUDA device."""
    cp = cupy_or_none()
    why = available()
    if why:
        raise RingReduceError(f"GPU arrays need cupy and a CUDA device: {why}")
    if FATBIN.exists():
        return cp.RawModule(path=str(FATBIN))
    src = kernel_source()
    d = src.parent.parent
    return cp.RawModule(code=src.read_text(), options=("-std=c++17", f"-I{d}", f"-I{d / 'cuda'}"))


def kernel_source() -> Path:
    """csrc/kernels/cuda/reduce.cu (next to the reduce_math.h it includes), which cupy
    compiles where no fatbin was built."""
    for d in SOURCE_DIRS:
        src = d / "cuda" / "reduce.cu"
        if src.exists():
            return src
    raise RingReduceError("csrc/kernels/cuda/reduce.cu not found: reinstall ringreduce, or build with RINGREDUCE_CUDA=1")


def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise TypeError(f"ringreduce's CUDA kernels do not support dtype {name}")
    return name


def launch_grid(count: int) -> tuple[int]:
    """The grid of THREADS-thread blocks over count elements (grid-stride beyond 65535 blocks)."""
    return (max(1, min((count + THREADS - 1) // THREADS, 65535)),)


def reduce3(dst, a, b, op: str, dtype=None) -> None:
    """dst = a OP b, element-wise (avg reduces as sum; 16-bit floats average
    with mean_fold); dst may be a. `dtype`
    names the element type where the arrays are raw views (cupy has no
    bfloat16: pass uint16 arrays and dtype="bfloat16")."""
    if op == "avg":
        op = "sum"
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    kernel = kernels().get_function(f"rr_reduce_{_dtype_name(dtype or dst.dtype)}_{op}")
    count = dst.size
    kernel(launch_grid(count), (THREADS,), (dst, a, b, np.uint64(count)))


def mean_fold(dst, x, mean, k: int, dtype=None) -> None:
    """dst = (mean * (k-1) + x) / k for 16-bit floats, in double, rounded once:
    one fold of an average, as the CPU kernels do it; dst may be x or mean."""
    name = _dtype_name(dtype or dst.dtype)
    if name not in MEAN_DTYPES:
        raise TypeError(f"running means are for {MEAN_DTYPES}, not {name}")
    kernel = kernels().get_function(f"rr_mean_{name}")
    kernel(launch_grid(dst.size), (THREADS,), (dst, x, mean, np.uint64(dst.size), np.int32(k)))


def divide(buf, n: int, dtype=None) -> None:
    """buf /= n, as the CPU kernels do it (integers floor-divide)."""
    kernel = kernels().get_function(f"rr_divide_{_dtype_name(dtype or buf.dtype)}")
    kernel(launch_grid(buf.size), (THREADS,), (buf, np.uint64(buf.size), np.int32(n)))


def cast(dst, src, dst_dtype=None, src_dtype=None) -> None:
    """float32 <-> float16 / bfloat16, rounding to nearest even (compression)."""
    frm, to = _dtype_name(src_dtype or src.dtype), _dtype_name(dst_dtype or dst.dtype)
    kernel = kernels().get_function(f"rr_cast_{frm}_to_{to}")
    kernel(launch_grid(src.size), (THREADS,), (dst, src, np.uint64(src.size)))


# --------------------------------------------------------------------------- the collectives' data path


def is_device_array(x) -> bool:
    """True for GPU arrays (cupy, or anything with __cuda_array_interface__)."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


@functools.lru_cache(maxsize=None)
def ring_device(ordinal: int):
    """The ring's handle on GPU `ordinal` (ringreduce._core.Device): its stream,
    pinned staging and the kernels above, one per process and GPU."""
    from .. import _core

    cp = cupy_or_none()
    module = kernels()
    with cp.cuda.Device(ordinal):
        table = kernel_table(lambda name: module.get_function(name).kernel.ptr)
    return _core.Device.cuda(ordinal, *table)


def kernel_table(handle):
    """The CUfunction handles the ring's device takes, in the C core's order:
    reduce[dtype][op], divide[dtype] and mean[dtype] (16-bit floats);
    handle(name) gives one kernel's."""
    reduce = [[handle(f"rr_reduce_{d}_{op}") for op in OPS] for d in DTYPES]
    divide = [handle(f"rr_divide_{d}") for d in DTYPES]
    mean = [handle(f"rr_mean_{d}") for d in MEAN_DTYPES]
    return reduce, divide, mean


def through_bounce(device, src_ptr: int, dst_ptr: int, nbytes: int, work) -> bool:
    """The small messages' path on a GPU: nbytes at device pointer src_ptr go
    down into one of the device's cached pinned bounce buffers (one copy),
    work(view) runs on the host in place in that buffer (a writable
    memoryview, valid only during the call), and the buffer goes up into
    dst_ptr (one copy): two device operations, nothing allocated once a
    message of the size has passed. False, with nothing done, when other
    threads hold every bounce buffer or run a collective on the device (a
    small message never waits for one: it may wait on peers that wait on
    this message); if work raises, the buffer is handed back and nothing
    goes up."""
    got = device.bounce_down(src_ptr, nbytes)
    if got is None:
        return False
    slot, view = got
    try:
        work(view)
    except BaseException:
        try:
            view.release()
        except BufferError:  # the traceback still holds an array over it: nothing reads it again
            pass
        device.bounce_release(slot)
        raise
    view.release()
    device.bounce_up(slot, dst_ptr, nbytes)
    return True


class DeviceArrays:
    """What the collectives need to run on GPU arrays (cupy): allocate like
    numpy, copy to and from the host for the small-message path, and call the
    ring with device pointers. Results are cupy arrays on the input's device."""

    def __init__(self):
        self.xp = cupy_or_none()
        why = available()
        if why:
            raise RingReduceError(f"GPU arrays need cupy and a CUDA device: {why}")

    def asarray(self, x):
        # A cupy array stays as it is (cupy.asarray would copy one from another
        # GPU onto the current one); other GPU arrays become cupy views.
        return x if isinstance(x, self.xp.ndarray) else self.xp.asarray(x)

    def on(self, x):
        """x's GPU made current (a context manager): cupy's current device is
        per thread, and what the collectives allocate for x must live there."""
        return x.device

    def mark(self, x):
        """An event after the work the calling thread has queued for x (its
        current stream), for another thread to wait on before reading x."""
        with x.device:
            event = self.xp.cuda.Event(disable_timing=True)
            event.record()
        return event

    @staticmethod
    def wait(marker) -> None:
        marker.synchronize()

    def to_host(self, x) -> np.ndarray:
        return self.xp.asnumpy(x)

    def from_host(self, a: np.ndarray, like):
        with like.device:
            return self.xp.asarray(a)

    def _ready(self, array):
        """The ring's device for array. The ring runs on its own stream: what
        the calling thread has queued on array's GPU (current: callers run
        under on(array)) must be done first."""
        self.xp.cuda.get_current_stream().synchronize()
        return ring_device(array.device.id)

    def allreduce_small(self, x, out, reduce):
        """x's allreduce through a pinned bounce buffer (through_bounce):
        reduce(host) reduces a numpy array in place there. The result is out
        where it is C-contiguous, else a new array; None when no bounce buffer
        can be had now (the caller goes through pageable memory)."""
        src = self.xp.ascontiguousarray(x)  # a copy kernel for a strided x, on the current stream:
        dst = out if out is not None and out.flags.c_contiguous else self.xp.empty_like(src)
        device = self._ready(src)  # which _ready waits for before the ring's stream copies src down

        def work(view):
            reduce(np.frombuffer(view, dtype=src.dtype).reshape(src.shape))

        return dst if through_bounce(device, src.data.ptr, dst.data.ptr, src.nbytes, work) else None

    # The ring's collectives, after their header pass (all_device: every rank
    # runs it on a device): device to device where the ring agreed on IPC,
    # else staged (core/device_ipc.py).
    def allreduce(self, ring, src, dst, code, opc, all_device):
        device_ipc.allreduce(ring, self._ready(src), src.data.ptr, dst.data.ptr, src.nbytes, code, opc, all_device)

    def reduce_scatter(self, ring, src, dst, code, opc, all_device):
        device_ipc.reduce_scatter(ring, self._ready(src), src.data.ptr, dst.data.ptr, src.nbytes, code, opc,
                                  all_device)

    def allgather(self, ring, flat, nbytes, all_device):
        device_ipc.allgather(ring, self._ready(flat), flat.data.ptr, nbytes, all_device)

    def broadcast(self, ring, buf, root, all_device):
        device_ipc.broadcast(ring, self._ready(buf), buf.data.ptr, buf.nbytes, root, all_device)
