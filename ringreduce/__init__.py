"""ringreduce: Ring AllReduce for Python.

    import ringreduce as rr
    rr.init()
    grads = rr.allreduce(grads, op="avg")
"""
from .errors import MismatchError, PeerLostError, RingReduceError, StaleGenerationError, WithdrawnError
from .core.collectives import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    reduce_scatter,
    shutdown,
    size,
)
from .engine import join
from .core.shared import is_shared, shared_empty, shared_empty_like, shared_zeros
from .core.traffic import reset_stats, stats
from .core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "barrier", "join",
    "stats", "reset_stats",
    "shared_empty", "shared_zeros", "shared_empty_like", "is_shared",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "RingReduceError", "MismatchError", "PeerLostError", "StaleGenerationError", "WithdrawnError",
]
