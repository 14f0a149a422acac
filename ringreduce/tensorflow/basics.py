"""Who am I, as Horovod's TensorFlow layer answers it: ranks as Python ints
and as tensors, the position across hosts, and what this build of
ringreduce can do (the *_built / *_enabled flags, answered truthfully for
ringreduce, not for Horovod's transports)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import ringreduce as rr
from ringreduce import is_initialized, local_rank, local_size, rank, size
from ringreduce import mpi_backend as _mpi_backend
from ringreduce import cuda as _cuda

# ----------------------------------------------------------------- process sets

try:  # built in parallel (ringreduce/process_sets.py); the lead wires the rest
    from ringreduce.process_sets import global_process_set
except ImportError:
    class _GlobalProcessSet:
        """Placeholder for ringreduce.process_sets.global_process_set: every rank."""
        process_set_id = 0

        def size(self):
            return rr.size()

        def rank(self):
            return rr.rank()

        def included(self):
            return True

        def __repr__(self):
            return "ProcessSet(process_set_id=0, ranks=all)"

    global_process_set = _GlobalProcessSet()


def check_process_set(process_set) -> None:
    """The one place the TF layer checks process_set=: only the global set runs
    today (the lead replaces this when process sets land)."""
    if process_set is not global_process_set and process_set is not None:
        raise NotImplementedError(
            f"process_set={process_set!r}: ringreduce.tensorflow runs collectives on the global process set only")


# ----------------------------------------------------------------- init, topology

_cross: dict = {}  # {"key": world identity, "cross_rank", "cross_size", "homogeneous"}


def init(comm=None, process_sets=None, backend: str | None = None) -> None:
    """Joins the ring (ringreduce.init) and learns the hosts' layout, as
    Horovod's init does. comm: an mpi4py communicator, as in rr.init."""
    if process_sets not in (None, [], ()):
        raise NotImplementedError("init(process_sets=...): ringreduce.tensorflow runs on the global process set only")
    if isinstance(comm, (list, tuple)):
        raise NotImplementedError("init(comm=[ranks]): pass an mpi4py communicator instead")
    rr.init(backend=backend, comm=comm)
    _learn_layout()


def shutdown() -> None:
    _cross.clear()
    rr.shutdown()


def _learn_layout() -> dict:
    """Every rank's (local_rank, local_size), gathered once: a collective, so
    init() runs it, where every rank is anyway."""
    key = (rr.rank(), rr.size(), rr.local_rank(), rr.local_size())
    if _cross.get("key") != key:
        mine = np.array([[rr.local_rank(), rr.local_size()]], dtype=np.int64)
        table = rr.allgather(mine, name="ringreduce.tensorflow.layout")
        peers = [r for r in range(rr.size()) if table[r, 0] == rr.local_rank()]
        _cross.update(key=key, cross_rank=peers.index(rr.rank()), cross_size=len(peers),
                      homogeneous=bool((table[:, 1] == table[0, 1]).all()))
    return _cross


def cross_rank() -> int:
    """This rank's position among the ranks with its local_rank (one per host):
    the index of its host. Learned at init(); after a bare rr.init() the first
    call is a collective, so every rank must make it."""
    return _learn_layout()["cross_rank"]


def cross_size() -> int:
    """How many ranks share this rank's local_rank: the number of hosts on a
    homogeneous cluster."""
    return _learn_layout()["cross_size"]


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return _learn_layout()["homogeneous"]


# ----------------------------------------------------------------- as tensors


def _int_op(value: int, name):
    return tf.constant(value, dtype=tf.int32, name=name)


def _only_global(process_set_id) -> None:
    if process_set_id != 0:
        raise NotImplementedError(f"process_set_id={process_set_id}: only the global process set (0) exists")


def rank_op(process_set_id: int = 0, name=None):
    """rank() as an int32 tensor (a constant: a rank never changes)."""
    _only_global(process_set_id)
    return _int_op(rr.rank(), name)


def size_op(process_set_id: int = 0, name=None):
    _only_global(process_set_id)
    return _int_op(rr.size(), name)


def local_rank_op(name=None):
    return _int_op(rr.local_rank(), name)


def local_size_op(name=None):
    return _int_op(rr.local_size(), name)


# ----------------------------------------------------------------- what is built


def mpi_built() -> bool:
    """Whether the MPI transport (ringreduce._mpi) is built and mpi4py imports."""
    return _mpi_backend.available() is None


def mpi_enabled() -> bool:
    """Whether the running ring goes over MPI (init under mpirun, or backend='mpi')."""
    from ringreduce.collectives import _state  # no public accessor for the backend yet
    return rr.is_initialized() and _state.init_args[0] == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE. As Horovod: ValueError unless
    the ring runs over MPI."""
    if not mpi_enabled():
        raise ValueError("the ring does not run over MPI (mpi_enabled() is False)")
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: ringreduce has no Gloo; its own TCP ring stands where Gloo would."""
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    """False: GPU tensors are reduced by ringreduce's own CUDA kernels, not NCCL."""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether GPU (cupy) arrays can be reduced here: the C core always carries
    the CUDA ring (libcuda is opened at run time); the kernels need cupy."""
    return _cuda.cupy_or_none() is not None


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "rank_op", "size_op", "local_rank_op", "local_size_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "rocm_built", "cuda_built", "global_process_set", "check_process_set",
]
