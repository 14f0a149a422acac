"""Who am I, as Horovod's TensorFlow layer answers it: ranks as Python ints
and as tensors, the position across hosts, and what this build of
ringreduce can do (the *_built / *_enabled flags, answered truthfully for
ringreduce, not for Horovod's transports)."""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

import ringreduce as rr
from ringreduce import is_initialized, local_rank, local_size, rank, size
from ringreduce.engine import engine
from ringreduce.core import ProcessSet, add_process_set, find_process_set, global_process_set

# ----------------------------------------------------------------- process sets


def check_process_set(process_set):
    """The one place the TF layer reads process_set=: the set to run on
    (None: the global one). TypeError for anything but a ProcessSet;
    ValueError for a set that is not registered (add_process_set on every
    rank first) or that this rank is not a member of."""
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ringreduce.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        return process_set
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: call add_process_set on every rank first")
    if not process_set.included():
        raise ValueError(f"rank {rr.rank()} is not a member of {process_set}: only its members may call "
                         "collectives on it")
    return process_set


# ----------------------------------------------------------------- init, topology

_cross: dict = {}  # {"key": world identity, "cross_rank", "cross_size", "homogeneous"}


def overlap_enabled() -> bool:
    """RINGREDUCE_OVERLAP: 1 (default) or 0; anything else ("off", "false")
    would have left the overlap on silently, so it is refused, named."""
    text = os.environ.get("RINGREDUCE_OVERLAP", "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"RINGREDUCE_OVERLAP={text!r} makes no sense: use 0 or 1")
    return text != "0"


def init(comm=None, process_sets=None, backend: str | None = None) -> None:
    """Joins the ring (ringreduce.init) and learns the hosts' layout, as
    Horovod's init does. comm: an mpi4py communicator, as in rr.init.
    process_sets: ProcessSets (or lists of ranks) to add, on every rank."""
    if isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"init(process_sets={process_sets!r}): pass \"dynamic\" or a list of ProcessSets")
    if process_sets == "dynamic":  # sets here are always dynamic: add/remove_process_set work at any time
        process_sets = None
    if isinstance(comm, (list, tuple)):
        raise NotImplementedError("init(comm=[ranks]): pass an mpi4py communicator instead")
    overlap_enabled()  # a RINGREDUCE_OVERLAP that makes no sense is refused here, as rr.init does its settings
    rr.init(backend=backend, comm=comm)
    _learn_layout()
    for ps in process_sets or ():  # as Horovod: registered at init, in order, on every rank
        add_process_set(ps)


def shutdown() -> None:
    """Leaves, as Horovod's shutdown: the engine negotiates on until every
    rank has called shutdown (or join), so a process set's members go on
    while a non-member that is done waits here for them."""
    _cross.clear()
    if rr.is_initialized() and rr.size() > 1:
        engine().leave()
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


def rank_op(process_set_id: int = 0, name=None):
    """This rank's rank in the process set with that id (0: the world) as an
    int32 tensor (a constant: a rank never changes). ValueError on a non-member."""
    return _int_op(find_process_set(process_set_id).rank(), name)


def size_op(process_set_id: int = 0, name=None):
    """The size of the process set with that id (0: the world), as an int32 tensor."""
    return _int_op(find_process_set(process_set_id).size(), name)


def process_set_included_op(process_set_id: int = 0, name=None):
    """1 if this rank is a member of the process set with that id (0: the
    world), else 0, as an int32 tensor; ValueError for an unknown id."""
    return _int_op(int(find_process_set(process_set_id).included()), name)


def local_rank_op(name=None):
    return _int_op(rr.local_rank(), name)


def local_size_op(name=None):
    return _int_op(rr.local_size(), name)


# ----------------------------------------------------------------- timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing the engine's Chrome trace to file_path (other ranks:
    file_path with .rankN before its suffix), as RINGREDUCE_TIMELINE does
    from the start. mark_cycles: an instant event at each negotiation cycle
    that runs something. A timeline already running is closed first."""
    if not rr.is_initialized():
        raise ValueError("start_timeline: call init() first")
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops and closes the timeline (a no-op when none runs)."""
    if not rr.is_initialized():
        raise ValueError("stop_timeline: call init() first")
    engine().start_timeline(None)


# ----------------------------------------------------------------- what is built


def mpi_built() -> bool:
    """Whether the MPI transport (ringreduce._mpi) is built and mpi4py imports."""
    return rr.core.mpi_unavailable_reason() is None


def mpi_enabled() -> bool:
    """Whether the running ring goes over MPI (init under mpirun, or backend='mpi')."""
    return rr.core.backend() == "mpi"


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
    return rr.cuda.cupy_or_none() is not None


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "rank_op", "size_op", "local_rank_op", "local_size_op",
    "process_set_included_op", "start_timeline", "stop_timeline",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "rocm_built", "cuda_built", "global_process_set", "check_process_set",
]
