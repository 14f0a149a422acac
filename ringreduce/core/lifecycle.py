"""Joining and leaving the ring: init(), shutdown(), what a forked child
inherits, and the world's rank and size."""
from __future__ import annotations

import atexit
import os
import threading

from .. import _core
from ..errors import RingReduceError
from . import (autotune as _autotune, config as _config, host_rings as _host_rings, mpi_backend, rendezvous_client,
               shm as _shm, world as _world)
from . import device_ipc as _device_ipc
from . import listeners as _listeners
from . import flight_recorder as _flight_recorder
from .communicator import Ring, current as _state
from .protocol import closing_header


def init(backend: str | None = None, comm=None) -> None:
    """Joins the ring. See ringreduce.core.world for how the world is found.

    backend: "socket" (TCP, the default outside mpirun), "mpi" (the default
    under mpirun when the MPI transport is built), or None to choose.
    comm: an mpi4py communicator to run the ring over (a process set); implies "mpi".

    Calling it again with the same arguments (or none) does nothing; with a
    different backend or communicator it raises: call shutdown() first.
    """
    with _state.lock:
        if _state.comm is not None:
            _check_same_init(backend, comm)
            return
        config = _config.Config.from_env()  # a setting that makes no sense raises here
        _config.warn_unknown()  # a misspelt one is warned about
        _autotune.enabled()  # so does RINGREDUCE_AUTOTUNE
        _flight_recorder.configure(config.flight_recorder, config.flight_dir, restart_numbers=True)
        backend = backend or config.backend or None
        if comm is not None and backend not in (None, "mpi"):
            raise ValueError("init(comm=...) runs over MPI; backend must be 'mpi' or None")
        if backend not in (None, "mpi", "socket"):
            raise ValueError(f"unknown backend {backend!r}; choose 'socket' or 'mpi'")
        declared = _world.discover()
        if comm is not None or backend == "mpi" or (
                backend is None and declared.source == "mpirun" and mpi_backend.available() is None):
            world, ring = mpi_backend.connect(config, comm)
            if comm is None and declared.size > 1 and world.size != declared.size:
                ring.close()
                raise RingReduceError(
                    f"the {declared.source} declares a world of {declared.size} ranks, but MPI sees {world.size}: "
                    f"this process was not started by mpirun -np {declared.size}. Under ringrun (or with "
                    "RINGREDUCE_* set) use the socket backend: init() or init(backend='socket'), "
                    "RINGREDUCE_BACKEND unset or 'socket'")
            _state.world, _state.comm = world, ring
        else:
            w = declared
            if w.source == "mpirun" and w.size > 1:
                w.addr, w.secret = mpi_backend.bootstrap_over_mpi(w)
            # ringrun --elastic holds the rendezvous: it fills in rank, size and generation
            links = rendezvous_client.join(w) if w.source == "elastic" else _world.connect_ring(w)
            _state.comm = _core.Comm(w.rank, w.size, links.next_fd, links.prev_fd, links.ctrl_fds,
                                     config.ring_timeout, config.segment_bytes, config.spin,
                                     tx_shm=links.tx_shm_fd, rx_shm=links.rx_shm_fd)
            w.extra["links"] = links.kinds()
            _state.world = w
            try:
                _shm.agree_zero_copy(_state.comm, config.shm_zerocopy)
                _shm.agree_cma(_state.comm, w.rank, w.size, config.shm_cma)
                w.extra["arena"] = attach_arena(_state.comm, w.rank, w.size, "world", config)
            except BaseException:
                shutdown()  # a peer lost while agreeing: leave, so init() may be called again
                raise
        _state.init_args = (backend or ("mpi" if _state.world.source == "MPI communicator" else "socket"), comm)
        _state.broken = None
        _state.generation = _state.world.extra.get("generation", 0)
        _state.small_limit = _state.world.config.small_limit(_state.world.size, _state.world.extra.get("arena", False))
        _state.ring = Ring(_state.comm, _state.world.rank, _state.world.size, _state.small_limit,
                            list(range(_state.world.size)))
        try:  # the hosts' rings of the hierarchical allreduce, where the world spans hosts (core/hierarchy.py)
            _state.ring.hierarchy = _host_rings.build(_state, _state.world.config.hierarchical)
        except BaseException:
            shutdown()  # a peer lost, or the ranks disagree: leave, so init() may be called again
            raise
        _state.world.extra["hierarchy"] = _state.ring.hierarchy.describe() if _state.ring.hierarchy else None
        if _autotune.enabled() and _state.world.size > 1:  # before any user collective (ringreduce/core/autotune.py)
            try:
                _state.world.config = _autotune.tune_ring(_state.ring, _state.world, _state.init_args[0])
            except BaseException:
                shutdown()  # a peer lost while calibrating: leave, so init() may be called again
                raise
            _state.small_limit = _state.ring.small_limit
        try:
            _listeners.initialized(config)  # the layers above (RINGREDUCE_METRICS_PORT: the exporter starts)
        except BaseException:
            shutdown()  # this rank cannot run as asked: leave (its peers see it gone); init() may be retried
            raise
        # SIGUSR1 dumps; the marker tells ringrun so, which then asks a rank still running after a failure
        if _flight_recorder.install_signal_handler():
            _flight_recorder.announce(os.environ.get("RINGREDUCE_REPORT_DIR"), _state.world.rank)


def attach_arena(comm, rank: int, size: int, tag: str, config: _config.Config) -> bool:
    """The host arena for a socket ring whose ranks share one host (ringreduce/core/shm.py)."""
    return _shm.attach_arena(comm, rank, size, tag, config.arena_slot, config.spin, reduce=config.arena_reduce)


def _check_same_init(backend, comm) -> None:
    running_backend, running_comm = _state.init_args
    if backend is not None and backend != running_backend:
        raise RingReduceError(f"ringreduce is already initialized with backend {running_backend!r}; "
                              f"init(backend={backend!r}) needs shutdown() first")
    if comm is not None and comm is not running_comm:
        raise RingReduceError("ringreduce is already initialized over another communicator; "
                              "init(comm=...) with a new one needs shutdown() first")


def shutdown() -> None:
    """Leaves the ring and ends every process set; init() may join a new one
    later. A collective running on another thread (the engine's) is
    interrupted, so this rank leaves at once and its peers learn that it
    left, instead of waiting it out."""
    if not _state.lock.acquire(blocking=False):
        for comm in _state.comms():
            comm.interrupt()
        _state.lock.acquire()
    try:
        for comm in _state.comms():
            if comm.busy:  # a Comm call on a thread that took no lock (or took it first)
                comm.interrupt()
        # A peer waiting in a collective on any ring of this rank hears at once that this rank leaves,
        # whichever ring it waits on: the rings with no closing pass close first (the peer's collective
        # fails there at once), then the others run their closing passes at once (device_ipc.release_all:
        # where a ring agreed on IPC its peers close what they opened of this rank's first).
        rings = [ring for ring in _state.sets.values() if ring.comm is not None]
        rings += [_state.ring] if _state.ring is not None else []
        if _state.ring is not None and _state.ring.hierarchy is not None:
            _state.ring.hierarchy.close()
        for ring in rings:
            if not _device_ipc.closes_with_pass(ring):
                ring.comm.close()
        _device_ipc.release_all(rings, closing_header())
        for ring in _state.sets.values():
            if ring.comm is not None:
                ring.comm.close()
            for ps in ring.owners:
                ps.invalidate()
        _state.sets.clear()
        if _state.comm is not None:
            _state.comm.close()
        _state.comm = _state.world = _state.ring = None
    finally:
        _state.lock.release()


def _forget_in_child() -> None:
    """A forked child inherits the parent's ring (sockets, shared mappings, a
    control thread that did not survive the fork): it must neither use nor
    close it. The child starts uninitialised; the C side leaks its copy."""
    _state.lock = threading.RLock()  # another thread may have held it at the fork
    for ring in _state.sets.values():
        for ps in ring.owners:
            ps.invalidate()
    _state.sets.clear()
    _state.comm = _state.world = _state.ring = None


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(shutdown)


def is_initialized() -> bool:
    return _state.comm is not None


def rank() -> int:
    return _state.require_world().rank


def size() -> int:
    return _state.require_world().size


def local_rank() -> int:
    return _state.require_world().local_rank


def local_size() -> int:
    return _state.require_world().local_size


def backend() -> str | None:
    """The transport the running ring was made with: "socket" or "mpi";
    None when not initialized."""
    return _state.init_args[0] if _state.comm is not None else None
