"""Prometheus metrics of this rank, served over HTTP (docs/metrics.md).

    RINGREDUCE_METRICS_PORT=9400 ringrun -np 4 python train.py
        # each rank serves http://127.0.0.1:(9400 + local rank)/metrics
    RINGREDUCE_METRICS_PORT=0 ...   # each rank a free port, said on stderr

    import ringreduce as rr
    port = rr.metrics.serve(9400)   # the same, by hand: exactly this port (0: a free one)

What is read at scrape time (bytes sent, the engine's queue and cycles,
the elastic generation, straggler scores) is read by a custom collector
(collector.py) when Prometheus asks; what happens between scrapes (each
collective's latency, errors, lost peers) is counted as it happens, through
core's listeners (ringreduce/core/listeners.py). The layer sits above core,
the engine and elastic; core never imports it. Importing ringreduce never
imports prometheus_client: only this package does, when metrics are asked for.
"""
from __future__ import annotations

import sys
import threading

try:
    import prometheus_client
except ImportError as exc:  # the optional extra
    raise ImportError("ringreduce.metrics needs prometheus_client: pip install 'ringreduce[metrics]'") from exc

from .. import core
from ..core import listeners
from .collector import Collector, Recorder

__all__ = ["serve", "stop", "address", "set_straggler_source", "registry"]

_lock = threading.Lock()
_recorder = Recorder()
_registry = prometheus_client.CollectorRegistry(auto_describe=True)
_registry.register(Collector(_recorder))
_server = None  # (server, thread, host, port) while serving


def registry() -> prometheus_client.CollectorRegistry:
    """The registry this rank's endpoint serves (prometheus_client.generate_latest(registry()) renders it)."""
    return _registry


def serve(port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serves this rank's metrics at http://addr:port/metrics from now on,
    on a daemon thread; port 0: a free one. Returns the port. Collectives
    are counted from this call on. Raises RuntimeError when already serving
    (stop() first), ValueError for a port outside 0..65535, OSError naming
    the address when it cannot be bound."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer 0 .. 65535 (0: a free port), not {port!r}")
    global _server
    with _lock:
        if _server is not None:
            raise RuntimeError(f"this process already serves metrics on {_url(_server[2], _server[3])}; stop() first")
        try:
            server, thread = prometheus_client.start_http_server(port, addr=addr, registry=_registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc
        _server = (server, thread, addr, server.server_port)
        listeners.add_listener(_recorder.collective)
        return server.server_port


def stop() -> None:
    """Stops serving (the port is free again) and counting collectives; what
    was counted is kept for a later serve(). Does nothing when not serving."""
    global _server
    with _lock:
        if _server is None:
            return
        server, thread, _, _ = _server
        _server = None
        listeners.remove_listener(_recorder.collective)
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def address() -> tuple[str, int] | None:
    """(addr, port) this rank serves metrics on, or None."""
    held = _server
    return None if held is None else (held[2], held[3])


def set_straggler_source(fn) -> None:
    """fn() -> {rank: score} (or None), called at each scrape: the
    ringreduce_straggler_score gauge, one sample per rank scored. None puts
    back the default: the scores of the engine's straggler report
    (rr.straggler_report(), docs/api.md)."""
    _recorder.straggler_source = fn


def start_at_init(config) -> None:
    """init()'s listener (registered by ringreduce/__init__.py): with
    RINGREDUCE_METRICS_PORT=P, serves on P + local rank (P = 0: a free port)
    at RINGREDUCE_METRICS_ADDR, and says where on stderr. A process already
    serving (an earlier init, an elastic reset, serve()) keeps its server."""
    if config.metrics_port is None or _server is not None:
        return
    rank, local_rank = core.rank(), core.local_rank()
    port = config.metrics_port + local_rank if config.metrics_port else 0
    if port > 65535:
        raise ValueError(f"RINGREDUCE_METRICS_PORT={config.metrics_port}: rank {rank} (local rank {local_rank}) "
                         f"would serve metrics on port {port}, past 65535")
    try:
        port = serve(port, config.metrics_addr)
    except OSError as exc:
        raise OSError(exc.errno, f"rank {rank}: RINGREDUCE_METRICS_PORT={config.metrics_port}: {exc.strerror}") \
            from exc
    except RuntimeError:
        return  # serve() called on another thread meanwhile: that server stands
    print(f"ringreduce: rank {rank} serves Prometheus metrics at {_url(config.metrics_addr, port)}",
          file=sys.stderr, flush=True)


def _url(addr: str, port: int) -> str:
    return f"http://{f'[{addr}]' if ':' in addr else addr}:{port}/metrics"
