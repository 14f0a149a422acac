"""Arrays and dtypes as the C core takes them: the dtype and op codes, the
checks every collective makes on this rank before any data moves (a
TypeError or ValueError, refused on every rank: protocol.py), and the array
families the collectives are written over (numpy here, cupy in cuda.py)."""
from __future__ import annotations

import contextlib
import functools

import ml_dtypes
import numpy as np

from .. import _core
from . import cuda as _cuda


DTYPES = {
    np.dtype(np.float16): _core.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): _core.BFLOAT16,
    np.dtype(np.float32): _core.FLOAT32,
    np.dtype(np.float64): _core.FLOAT64,
    np.dtype(np.int8): _core.INT8,
    np.dtype(np.uint8): _core.UINT8,
    np.dtype(np.int32): _core.INT32,
    np.dtype(np.int64): _core.INT64,
    np.dtype(np.int16): _core.INT16,
    np.dtype(np.uint16): _core.UINT16,
}
OPS = {"sum": _core.SUM, "prod": _core.PROD, "min": _core.MIN, "max": _core.MAX, "avg": _core.AVG}
OP_NAMES = {v: k for k, v in OPS.items()}
DTYPE_NAMES = {v: str(k) for k, v in DTYPES.items()}


def dtype_code(dtype: np.dtype) -> int:
    try:
        return DTYPES[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(DTYPE_NAMES.values())
        raise TypeError(f"ringreduce does not support dtype {dtype}; supported: {supported}") from None


def check_movable(dtype: np.dtype) -> None:
    """Ops that only move bytes (allgather, broadcast, alltoall) take any
    fixed-size dtype whose bytes are its value: not objects (pointers)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.itemsize == 0 or dtype.kind == "T":
        raise TypeError(f"ringreduce cannot move dtype {dtype}: only fixed-size dtypes without Python objects")
    if len(str(dtype).encode()) > 0xFFFF:  # the header's limit (_header_of), refused here before pairing stops
        raise TypeError(f"dtype of {len(dtype.names or ())} fields is too complex to describe in a header")


# A name longer than this is refused before it is sent (the header pass's blob cap is 64 MiB).
MAX_NAME_BYTES = 1 << 20


def check_name(name) -> None:
    """A collective's name is None or a str that UTF-8 can carry: anything
    else is refused on this rank before data moves (and so on every rank),
    never found while the header is built, after this rank stopped pairing."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"a collective's name must be a str or None, not {type(name).__name__}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"a collective's name must be encodable as UTF-8: {exc.reason} at position {exc.start}") \
            from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"a collective's name is {size} bytes; at most {MAX_NAME_BYTES}")


def op_code(op: str) -> int:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    return OPS[op]


class _HostTrip:
    """HostArrays.small_trip's trip: x's bytes where x is (its own context
    manager: no generator per call on the host's small path)."""
    bounced = False

    def __init__(self, x):
        self.x = x

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    @functools.cached_property
    def host(self):  # made only when asked: a large x goes to the ring as it is
        return np.ascontiguousarray(self.x).reshape(-1).view(np.uint8)

    def close(self) -> None:
        pass


class HostArrays:
    """numpy arrays: the ring reads and writes them where they are. The GPU
    counterpart is cuda.DeviceArrays (core/cuda.py); the collectives below are
    written once over either."""

    xp = np

    @staticmethod
    def asarray(x):
        return np.asarray(x)

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def from_host(a, like):
        return a

    @staticmethod
    def on(x):
        return contextlib.nullcontext()

    @staticmethod
    def mark(x):
        return None

    @staticmethod
    def wait(marker) -> None:
        pass

    @staticmethod
    def small_trip(x, down: bool = True):
        """A small collective's bytes of x (C order) on the host: x itself
        (cuda.SmallTrip is the GPU's counterpart)."""
        return _HostTrip(x)

    @staticmethod
    def result(trip, a, like):
        return a

    # The ring's collectives after their header pass, as DeviceArrays' (all_device: unused here).
    @staticmethod
    def allreduce(ring, src, dst, code, opc, all_device=False):
        ring.comm.allreduce(as_raw(src), as_raw(dst), code, opc)

    @staticmethod
    def reduce_scatter(ring, src, dst, code, opc, all_device=False):
        ring.comm.reduce_scatter(as_raw(src), as_raw(dst), code, opc)

    @staticmethod
    def allgather(ring, flat, nbytes, all_device=False):
        ring.comm.allgather(flat, nbytes)

    @staticmethod
    def broadcast(ring, buf, root, all_device=False):
        ring.comm.broadcast(as_bytes(buf), root)  # any dtype: the buffer protocol has no code for some


@functools.lru_cache(maxsize=None)
def device_arrays():
    return _cuda.DeviceArrays()


def arrays_for(x, reduces: bool = True):
    """The array family of x, and x as one of its arrays, its dtype checked:
    reducible (reduces) or merely movable."""
    family = device_arrays() if _cuda.is_device_array(x) else HostArrays
    arr = family.asarray(x)
    if family is HostArrays:
        arr = native(arr)
    if reduces:
        dtype_code(arr.dtype)
    else:
        check_movable(arr.dtype)
    return family, arr


def native(a: np.ndarray) -> np.ndarray:
    """a in this machine's byte order (a '>f4' array becomes '<f4' on x86):
    the kernels and the wire work in native order; results come back so."""
    if a.dtype.isnative or a.dtype.hasobject:
        return a
    return a.astype(a.dtype.newbyteorder("="))


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def as_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, flat."""
    return a.reshape(-1).view(np.uint8)


def as_raw(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array as the C core takes it (the buffer protocol has no
    code for bfloat16, so those go as bytes)."""
    return a.reshape(-1).view(np.uint8) if a.dtype == BFLOAT16 else a


def deliver(result, out, xp=np):
    if out is None:
        return result
    if out is not result:
        xp.copyto(out, result.reshape(out.shape))
    return out


def chunk_bounds(count: int, n: int, i: int) -> tuple[int, int]:
    """Chunk i of count elements over n ranks, as csrc/schedule/ring.c cuts it."""
    base, extra = divmod(count, n)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def read_splits(splits) -> tuple:
    """splits as a tuple of ints; a TypeError (on this rank, before any
    communication, like any unsupported input) when they are not integers."""
    if hasattr(splits, "numpy"):  # a TensorFlow tensor
        splits = splits.numpy()
    if _cuda.is_device_array(splits):
        splits = device_arrays().to_host(splits)
    a = np.asarray(splits)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise TypeError(f"alltoall splits must be a 1-d sequence of integers, not {a.dtype} of shape {a.shape}")
    given = tuple(int(v) for v in a)
    if any(v >= 1 << 63 for v in given):  # uint64 splits pass the integer check; the header's int64 would refuse
        # with a struct.error on this rank alone, after the refusal window: the others one collective off
        raise ValueError(f"alltoall splits must fit in int64; got {max(given)}")
    return given
