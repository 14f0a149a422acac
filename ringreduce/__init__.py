"""ringreduce: Ring AllReduce for Python.

    import ringreduce as rr
    rr.init()
    grads = rr.allreduce(grads, op="avg")
"""
from .version import __version__
from .errors import MismatchError, PeerLostError, RingReduceError, StaleGenerationError, WithdrawnError
from .core import (ProcessSet, add_process_set, allgather, allreduce, alltoall, barrier, broadcast, cuda,
                   global_process_set, init, is_initialized, is_shared, local_rank, local_size, rank, reduce_scatter,
                   remove_process_set, reset_stats, shared_empty, shared_empty_like, shared_zeros, shutdown, size,
                   stats)
from .engine import join

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "barrier", "join",
    "stats", "reset_stats",
    "shared_empty", "shared_zeros", "shared_empty_like", "is_shared",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "RingReduceError", "MismatchError", "PeerLostError", "StaleGenerationError", "WithdrawnError",
]
