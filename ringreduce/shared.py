"""Arrays in shared memory: ringreduce.shared_empty / shared_zeros /
shared_empty_like, the user-buffer registration of NCCL's ncclMemAlloc +
ncclCommRegister, MPI_Alloc_mem or XPMEM, for the ring on one host.

An array from here lives in a memfd mapped MAP_SHARED by this process
(csrc/memory/shared_region.h) and registered with the C core. Where the ring reads
its neighbour's chunks by Cross Memory Attach (RINGREDUCE_SHM_CMA), a rank
whose buffer lies in such a region says so in its token, and the neighbour
maps the region read-only and reduces straight out of it instead of copying
the chunk in first (docs/architecture.md, "Cross Memory Attach"). Any other
array, or a neighbour that cannot map it, takes process_vm_readv as before:
the same bits either way.

The region is freed when the last array (or view) over it is garbage
collected. Works before init; each array holds one file descriptor, so this
is for a few large buffers (gradients), not thousands of small ones.
"""
import math
import operator
import sys

import numpy as np

from . import _core
from .collectives import _check_movable

__all__ = ["shared_empty", "shared_zeros", "shared_empty_like", "is_shared"]


def _shape(shape) -> tuple:
    try:
        dims = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def shared_empty(shape, dtype=np.float32) -> np.ndarray:
    """A new C-contiguous array of shape and dtype in shared memory,
    uninitialised (in fact zero-filled: a fresh memfd is)."""
    dims = _shape(shape)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"shared_empty: not a dtype: {dtype!r} ({exc})") from None
    _check_movable(dt)
    count = math.prod(dims)  # exact: numpy's int64 product could wrap
    nbytes = count * dt.itemsize
    if nbytes > sys.maxsize:
        raise ValueError(f"shared_empty: array is too big ({count} elements of {dt})")
    region = _core.SharedRegion(nbytes)
    return np.frombuffer(region, dtype=dt, count=count).reshape(dims)


def shared_zeros(shape, dtype=np.float32) -> np.ndarray:
    """shared_empty, zero-filled (a fresh region is zeros already: no pass)."""
    return shared_empty(shape, dtype)


def shared_empty_like(a, dtype=None) -> np.ndarray:
    """shared_empty of a's shape, and of its dtype unless one is given."""
    a = np.asarray(a)
    return shared_empty(a.shape, a.dtype if dtype is None else dtype)


def is_shared(a) -> bool:
    """Whether all of a's bytes lie in one live region from shared_empty
    whose fd still names its memfd (so the mapped read can serve it)."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return False
    return _core.SharedRegion.region_of(a.ctypes.data, a.nbytes) != 0
