"""ringreduce's CUDA kernels (csrc/kernels/cuda/reduce.cu), loaded through cupy.

The kernels come from a fatbin that setup.py builds with nvcc when asked
(RINGREDUCE_CUDA=1, for sm_80 and sm_90), or else are compiled at run time
from the same source by cupy.RawModule (NVRTC): where no fatbin was built,
and where the fatbin does not load on this GPU (code for other
architectures only). kernel_origin() says which. Nothing here runs without
cupy and a GPU; importing this module never needs either.

    from ringreduce import cuda
    cuda.reduce3(dst, a, b, "sum")       # cupy arrays, on the current device and stream
"""
from __future__ import annotations

import contextlib
import functools
import threading
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


# A kernel every build has: getting it loads a module on the current GPU.
PROBE_KERNEL = "rr_reduce_float32_sum"


@functools.lru_cache(maxsize=None)
def _loaded():
    """(module, origin): kernels() and kernel_origin()."""
    cp = cupy_or_none()
    why = available()
    if why:
        raise RingReduceError(f"GPU arrays need cupy and a CUDA device: {why}")
    fatbin_why = "no fatbin was built"
    if FATBIN.exists():
        module = cp.RawModule(path=str(FATBIN))
        try:
            module.get_function(PROBE_KERNEL)  # loads the fatbin: one without code for this GPU fails here
            return module, f"fatbin {FATBIN.name}"
        except Exception as exc:  # cupy's CUDADriverError, e.g. CUDA_ERROR_NO_BINARY_FOR_GPU
            fatbin_why = f"the fatbin did not load on this GPU: {exc}"
    src = kernel_source()
    d = src.parent.parent
    module = cp.RawModule(code=src.read_text(), options=("-std=c++17", f"-I{d}", f"-I{d / 'cuda'}"))
    try:
        module.get_function(PROBE_KERNEL)  # compiles and loads now, not in the first collective
    except Exception as exc:
        raise RingReduceError(f"ringreduce's CUDA kernels: compiling reduce.cu with NVRTC failed ({fatbin_why}): "
                              f"{exc}") from exc
    return module, f"NVRTC ({fatbin_why})"


def kernels():
    """The compiled kernels (a cupy.RawModule), loaded on the current GPU: the
    fatbin where it loads here, else reduce.cu compiled now with NVRTC
    (kernel_origin() says which); RingReduceError without cupy and a CUDA
    device, or where neither loads."""
    return _loaded()[0]


def kernel_origin() -> str:
    """Where kernels() came from: "fatbin reduce_kernels.fatbin", or
    "NVRTC (why: no fatbin was built, or the fatbin's load error)"; loads
    the kernels if need be (RingReduceError as kernels())."""
    return _loaded()[1]


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


def _flat(*arrays, count: int) -> None:
    """The kernels take bare pointers and walk count elements from each: an
    array that is strided or of another size would be read or written
    wrongly (or past its end, faulting the context), so it is refused."""
    for a in arrays:
        if not a.flags.c_contiguous or a.size != count:
            raise ValueError(f"ringreduce's CUDA kernels take C-contiguous arrays of {count} elements, "
                             f"not {'a strided one' if not a.flags.c_contiguous else f'one of {a.size}'}")


def reduce3(dst, a, b, op: str, dtype=None) -> None:
    """dst = a OP b, element-wise (avg reduces as sum; 16-bit floats average
    with mean_fold); dst may be a. `dtype`
    names the element type where the arrays are raw views (cupy has no
    bfloat16: pass uint16 arrays and dtype="bfloat16"). All three arrays are
    C-contiguous and of one size (ValueError otherwise)."""
    if op == "avg":
        op = "sum"
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    _flat(dst, a, b, count=dst.size)
    kernel = kernels().get_function(f"rr_reduce_{_dtype_name(dtype or dst.dtype)}_{op}")
    count = dst.size
    kernel(launch_grid(count), (THREADS,), (dst, a, b, np.uint64(count)))


def mean_fold(dst, x, mean, k: int, dtype=None) -> None:
    """dst = (mean * (k-1) + x) / k for 16-bit floats, in double, rounded once:
    one fold of an average, as the CPU kernels do it; dst may be x or mean
    (C-contiguous, one size, as reduce3)."""
    name = _dtype_name(dtype or dst.dtype)
    if name not in MEAN_DTYPES:
        raise TypeError(f"running means are for {MEAN_DTYPES}, not {name}")
    _flat(dst, x, mean, count=dst.size)
    kernel = kernels().get_function(f"rr_mean_{name}")
    kernel(launch_grid(dst.size), (THREADS,), (dst, x, mean, np.uint64(dst.size), np.int32(k)))


def divide(buf, n: int, dtype=None) -> None:
    """buf /= n, as the CPU kernels do it (integers floor-divide); buf C-contiguous."""
    _flat(buf, count=buf.size)
    kernel = kernels().get_function(f"rr_divide_{_dtype_name(dtype or buf.dtype)}")
    kernel(launch_grid(buf.size), (THREADS,), (buf, np.uint64(buf.size), np.int32(n)))


def cast(dst, src, dst_dtype=None, src_dtype=None) -> None:
    """float32 <-> float16 / bfloat16, rounding to nearest even (compression);
    dst and src C-contiguous, of one size."""
    _flat(dst, src, count=src.size)
    frm, to = _dtype_name(src_dtype or src.dtype), _dtype_name(dst_dtype or dst.dtype)
    kernel = kernels().get_function(f"rr_cast_{frm}_to_{to}")
    kernel(launch_grid(src.size), (THREADS,), (dst, src, np.uint64(src.size)))


# --------------------------------------------------------------------------- the collectives' data path


def is_device_array(x) -> bool:
    """True for GPU arrays (cupy, or anything with __cuda_array_interface__)."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def device_id(x):
    """The ordinal of the GPU a GPU array lives on (cupy's x.device.id; None
    for arrays that do not say)."""
    return getattr(getattr(x, "device", None), "id", None)


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


class _Gate:
    """A device's gate: held by a staged collective on the device for its
    whole run (staged()), which in C holds the device's own lock as long,
    waiting on peers. A small message's trip up takes the gate only if it is
    free: the C lock is then held by nothing that waits on peers, so the trip
    up never waits behind a staged collective (which could wait on peers that
    wait on this small message: a deadlock across processes). Slots whose
    hand-back had to wait for the device are `pending`, handed back by the
    gate's next holder."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: list[int] = []


_gates: dict = {}
_gates_lock = threading.Lock()


def _gate(device) -> _Gate:
    with _gates_lock:
        gate = _gates.get(device)
        if gate is None:
            gate = _gates[device] = _Gate()
        return gate


def _hand_back_pending(device, gate: _Gate) -> None:
    """Hands back the slots parked while a staged collective held the device;
    called with gate.lock held (no staged collective holds the C lock)."""
    while gate.pending:
        device.bounce_release(gate.pending.pop())


@contextlib.contextmanager
def staged(device):
    """Around a staged collective on device (Comm.*_device): holds the
    device's gate for the run (see _Gate), then hands back parked slots.
    Staged collectives on one device run one at a time either way (the C
    lock); this makes the small messages' trips up see it."""
    gate = _gate(device)
    with gate.lock:
        try:
            yield device
        finally:
            _hand_back_pending(device, gate)


def _release(view) -> None:
    try:
        view.release()
    except BufferError:  # an array over it outlived the host work: its bytes stay valid until the slot's next use
        pass


def _hand_back(device, slot: int) -> None:
    """The slot back to the device, unused: now where the gate is free, else
    parked (never waiting behind a staged collective)."""
    gate = _gate(device)
    if gate.lock.acquire(blocking=False):
        try:
            _hand_back_pending(device, gate)
            device.bounce_release(slot)
        finally:
            gate.lock.release()
    else:
        gate.pending.append(slot)


def _go_up(device, slot: int, view, dst_ptr: int, nbytes: int, copy_up) -> None:
    """The slot's first nbytes to dst_ptr, and the slot handed back. With the
    device's gate free: bounce_up (one copy on the ring's stream). While a
    staged collective holds the device: copy_up(host, dst_ptr) copies them
    (host: a numpy uint8 array over the slot), and the slot is parked for
    the gate's next holder to hand back: the trip never waits for the
    collective."""
    gate = _gate(device)
    if gate.lock.acquire(blocking=False):
        try:
            _release(view)
            _hand_back_pending(device, gate)
            device.bounce_up(slot, dst_ptr, nbytes)
        finally:
            gate.lock.release()
        return
    try:
        if nbytes:
            copy_up(np.frombuffer(view, np.uint8, nbytes), dst_ptr)
    finally:
        _release(view)
        gate.pending.append(slot)


def _take_slot(device, src_ptr: int, nbytes: int):
    """bounce_down, after handing back parked slots where the gate is free."""
    gate = _gate(device)
    if gate.pending and gate.lock.acquire(blocking=False):
        try:
            _hand_back_pending(device, gate)
        finally:
            gate.lock.release()
    return device.bounce_down(src_ptr, nbytes)


def through_bounce(device, src_ptr: int, dst_ptr: int, nbytes: int, work, copy_up=None) -> bool:
    """The small messages' path on a GPU: nbytes at device pointer src_ptr go
    down into one of the device's cached pinned bounce buffers (one copy),
    work(view) runs on the host in place in that buffer (a writable
    memoryview, valid only during the call), and the buffer goes up into
    dst_ptr (one copy): two device operations, nothing allocated once a
    message of the size has passed. False, with nothing done, when other
    threads hold every bounce buffer or run a collective on the device (a
    small message never waits for one: it may wait on peers that wait on
    this message); if work raises, the buffer is handed back and nothing
    goes up. The trip up never waits for a staged collective either (_go_up:
    copy_up(host, dst_ptr) copies then, when given; without it the trip up
    waits for the device)."""
    got = _take_slot(device, src_ptr, nbytes)
    if got is None:
        return False
    slot, view = got
    try:
        work(view)
    except BaseException:
        _release(view)  # the traceback may still hold an array over it: nothing reads it again
        _hand_back(device, slot)
        raise
    if copy_up is None:
        _release(view)
        device.bounce_up(slot, dst_ptr, nbytes)
    else:
        _go_up(device, slot, view, dst_ptr, nbytes, copy_up)
    return True


class SmallTrip:
    """A small collective's data (not allreduce: its result may differ in
    size) through one of the device's pinned bounce buffers: x's nbytes come
    down in one copy (`host`: a numpy uint8 array over them), the header pass
    runs on the host, and result() sends the result up in one copy through
    the same buffer where it fits: two device operations, nothing allocated
    once a message of the size has passed. Where no bounce buffer can be had
    (every slot taken, or the device busy with another thread's collective),
    `host` is a pageable copy (to_host()) and the result goes up through
    upload(). A result larger than the buffer (an allgather's) hands the
    buffer back and goes up through upload(). close() hands the buffer back
    unused (the ring's path, or an error); it is idempotent."""

    def __init__(self, device, src_ptr: int, nbytes: int, to_host, copy_up):
        got = None if device is None else _take_slot(device, src_ptr, nbytes)
        self.device, self.copy_up, self.nbytes, self._to_host = device, copy_up, nbytes, to_host
        if got is None:
            self.slot, self.view, self._host = None, None, None  # the pageable copy, made when asked
        else:
            self.slot, self.view = got
            self._host = np.frombuffer(self.view, np.uint8)

    @property
    def host(self) -> np.ndarray:
        if self._host is None:  # as bytes by a view: numpy's buffer protocol has no bfloat16
            self._host = np.ascontiguousarray(self._to_host()).reshape(-1).view(np.uint8)
        return self._host

    @property
    def bounced(self) -> bool:
        return self.slot is not None

    def result(self, a: np.ndarray, alloc, upload):
        """a (C-contiguous host array) on the device: alloc(a) gives (device
        array, its pointer) for the copy up through the buffer; upload(a)
        gives a device array the pageable way."""
        a = np.ascontiguousarray(a)
        if self.slot is None or a.nbytes > self.nbytes:
            self.close()
            return upload(a)
        out, ptr = alloc(a)
        slot, view = self.slot, self.view
        self.slot = self.view = self._host = None
        np.frombuffer(view, np.uint8, a.nbytes)[...] = a.reshape(-1).view(np.uint8)
        _go_up(self.device, slot, view, ptr, a.nbytes, self.copy_up)
        return out

    def close(self) -> None:
        if self.slot is not None:
            slot, view = self.slot, self.view
            self.slot = self.view = self._host = None
            _release(view)
            _hand_back(self.device, slot)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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

    def copy_up(self, host: np.ndarray, dst_ptr: int) -> None:
        """host's bytes to device pointer dst_ptr, on cupy's current stream,
        waited for: a small message's trip up while the ring's device is busy."""
        rt = self.xp.cuda.runtime
        stream = self.xp.cuda.get_current_stream()
        rt.memcpyAsync(dst_ptr, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

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

        return dst if through_bounce(device, src.data.ptr, dst.data.ptr, src.nbytes, work, self.copy_up) else None

    def ready(self, x) -> None:
        """Makes the ring's device for x's GPU (on first use: its stream,
        its kernels, compiled where no fatbin was built), so a collective can
        fail on it before its header goes out."""
        ring_device(x.device.id)

    def small_trip(self, x, down: bool = True) -> SmallTrip:
        """A small collective's trip for x (SmallTrip, its own context
        manager): its bytes down through a bounce buffer now, the result up
        through it; the buffer handed back on the way out whatever happens.
        down=False: no bounce buffer (host is the pageable copy, the result
        goes up the pageable way)."""
        src = self.xp.ascontiguousarray(x)
        device = self._ready(src) if down else None
        return SmallTrip(device, src.data.ptr, src.nbytes, lambda: self.to_host(src), self.copy_up)

    def result(self, trip: SmallTrip, a: np.ndarray, like):
        """a on like's device, through trip (SmallTrip.result)."""
        def alloc(h):
            out = self.xp.empty(h.shape, dtype=h.dtype)  # under on(like): callers run there
            return out, out.data.ptr
        return trip.result(a, alloc, lambda h: self.from_host(h, like))

    # The ring's collectives, after their header pass (all_device: every rank
    # runs it on a device): device to device where the ring agreed on IPC,
    # else staged (core/device_ipc.py). Either holds the device (its lock in
    # C) for the whole run, so each also holds the device's gate (staged).
    def allreduce(self, ring, src, dst, code, opc, all_device):
        with staged(self._ready(src)) as device:
            device_ipc.allreduce(ring, device, src.data.ptr, dst.data.ptr, src.nbytes, code, opc, all_device)

    def allreduce_small_ipc(self, ring, head, src, dst, code, opc):
        """The one-pass small allreduce over IPC (device_ipc.allreduce_small):
        None when it ran, else every rank's blob (nothing reduced). It lets
        the device go while it waits on peers (in C), so it holds no gate:
        another ring's collective on this device, and small trips, run
        meanwhile."""
        return device_ipc.allreduce_small(ring, self._ready(src), head, src.data.ptr, dst.data.ptr, src.nbytes, code,
                                          opc)

    def reduce_scatter(self, ring, src, dst, code, opc, all_device):
        with staged(self._ready(src)) as device:
            device_ipc.reduce_scatter(ring, device, src.data.ptr, dst.data.ptr, src.nbytes, code, opc, all_device)

    def allgather(self, ring, flat, nbytes, all_device):
        with staged(self._ready(flat)) as device:
            device_ipc.allgather(ring, device, flat.data.ptr, nbytes, all_device)

    def broadcast(self, ring, buf, root, all_device):
        with staged(self._ready(buf)) as device:
            device_ipc.broadcast(ring, device, buf.data.ptr, buf.nbytes, root, all_device)
