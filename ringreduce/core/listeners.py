"""Listeners to what core does, for observers in the layers above it (the
Prometheus exporter, ringreduce/metrics/): core calls them and knows none.

    add_listener(fn)       fn(kind, seconds, error) after every collective
                           this process runs (allreduce, broadcast, ...): its
                           wall time, and the exception it raised or None;
                           and fn("engine", None, error) when the engine
                           stops on an error (report())
    add_init_listener(fn)  fn(config) after every init() that joined a ring

A collective is reported once, by the outermost public call on its thread
(a GPU allreduce that reduces through the host allreduce is one allreduce).
The engine's ring operations are collectives too (a fused allreduce is one).
Listeners run on the thread that ran the collective, after it, with no lock
of core's held; they must be quick and must not call collectives. One that
raises is dropped from that call's report (logged), never failing the
collective: an observer cannot change what the ring did.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

log = logging.getLogger("ringreduce")

# Tuples, replaced whole on change: the collectives read them without a lock.
_listeners: tuple = ()
_init_listeners: tuple = ()
_change = threading.Lock()
_inside = threading.local()  # .depth: public collectives this thread is inside


def add_listener(fn) -> None:
    """fn(kind: str, seconds: float, error: BaseException | None) after every collective."""
    global _listeners
    with _change:
        if fn not in _listeners:
            _listeners = _listeners + (fn,)


def remove_listener(fn) -> None:
    global _listeners
    with _change:
        _listeners = tuple(f for f in _listeners if f is not fn)


def add_init_listener(fn) -> None:
    """fn(config: ringreduce.core.config.Config) after every init() that
    joined a ring. An exception it raises fails that init(): the rank leaves
    the ring again (its peers see it lost) and init() raises it."""
    global _init_listeners
    with _change:
        if fn not in _init_listeners:
            _init_listeners = _init_listeners + (fn,)


def remove_init_listener(fn) -> None:
    global _init_listeners
    with _change:
        _init_listeners = tuple(f for f in _init_listeners if f is not fn)


def initialized(config) -> None:
    """Called by init() once the ring is up; raises what a listener raised."""
    for fn in _init_listeners:
        fn(config)


def collective(kind: str):
    """Decorator of the public collective `kind`: reports each call to the
    listeners. With none registered it only costs a tuple's truth test."""
    def wrap(fn):
        @functools.wraps(fn)
        def reported(*args, **kwargs):
            if not _listeners or getattr(_inside, "depth", 0):
                return fn(*args, **kwargs)
            _inside.depth = 1
            error = None
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                seconds = time.perf_counter() - start
                _inside.depth = 0
                _report(kind, seconds, error)
        return reported
    return wrap


def report(kind: str, seconds: float | None, error: BaseException | None) -> None:
    """For a layer above core that runs ring operations of its own outside
    the collectives: the same report. The engine reports the error that
    stopped it as kind "engine", seconds None (a lost peer met while
    negotiating). An exception already reported (a collective the engine
    ran raised it) is not reported again: each error reaches a listener once."""
    if _listeners and not (error is not None and getattr(error, _REPORTED, False)):
        _report(kind, seconds, error)


_REPORTED = "_ringreduce_reported"  # set on an exception once reported


def _report(kind, seconds, error) -> None:
    if error is not None:
        try:
            setattr(error, _REPORTED, True)
        except Exception:  # an exception type without attributes: reported each time it is met
            pass
    for fn in _listeners:
        try:
            fn(kind, seconds, error)
        except Exception:  # an observer's bug must not fail the collective it observed
            log.exception("ringreduce: a collective listener (%r) raised; ignored", fn)
