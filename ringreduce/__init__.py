"""ringreduce: Ring AllReduce for Python.

    import ringreduce as rr
    rr.init()
    grads = rr.allreduce(grads, op="avg")

Subpackages and submodules load on first use, as numpy's do:
`rr.elastic.run`, `rr.compression.PowerSGD`, `rr.balance.BatchBalancer`,
`rr.tensorflow`, `rr.metrics.serve`, `rr.ray.RayExecutor` work without an
import of their own. `import ringreduce` itself never imports TensorFlow or
Ray (only touching `rr.tensorflow` or `rr.ray` does), nor prometheus_client
(only `rr.metrics`, or init() with RINGREDUCE_METRICS_PORT set, does).
"""
import importlib as _importlib
import importlib.util as _importlib_util

from .version import __version__
from .errors import MismatchError, PeerLostError, RingReduceError, StaleGenerationError, WithdrawnError
from .core import (ProcessSet, add_process_set, allgather, allreduce, alltoall, barrier, broadcast, cuda,
                   flight_recorder, global_process_set, init, is_initialized, is_shared, local_rank, local_size, rank,
                   reduce_scatter, remove_process_set, reset_stats, shared_empty, shared_empty_like, shared_zeros,
                   shutdown, size, stats)
from .engine import join, straggler_report
from .core import listeners as _listeners

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "barrier", "join",
    "stats", "reset_stats", "straggler_report", "flight_recorder",
    "shared_empty", "shared_zeros", "shared_empty_like", "is_shared",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "RingReduceError", "MismatchError", "PeerLostError", "StaleGenerationError", "WithdrawnError",
]


def _metrics_at_init(config) -> None:
    """RINGREDUCE_METRICS_PORT set: init() starts this rank's Prometheus endpoint (ringreduce/metrics/)."""
    if config.metrics_port is not None:
        _importlib.import_module(f"{__name__}.metrics").start_at_init(config)


_listeners.add_init_listener(_metrics_at_init)


def __getattr__(name: str):
    """PEP 562: `rr.elastic` & co. import the submodule of that name on first
    use (it is then an attribute of the package, so this runs once per name).
    Names that are no submodule raise AttributeError as usual."""
    if not name.startswith("_"):
        try:
            found = _importlib_util.find_spec(f"{__name__}.{name}") is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"balance", "compression", "elastic", "metrics", "ray", "tensorflow"})
