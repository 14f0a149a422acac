"""The ring over MPI: a communicator in, a ringreduce Comm out.

Used by init(backend="mpi") and init(comm=...), and by default under mpirun
when the MPI transport is built (see setup.py) and mpi4py imports.
"""
from __future__ import annotations

import os
import sys
import time

from . import _core
from .config import Config
from .errors import RingReduceError
from .world import World

ABORT_GRACE = 0.5  # seconds; on a loaded machine Hydra dropped the reason without it


def available() -> str | None:
    """None if the MPI backend can run here, else what is missing."""
    # mpi4py first: it loads the MPI library of this environment, which then
    # serves _mpi too (whatever library path the build machine baked in).
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:
        return "mpi4py is not installed: pip install 'ringreduce[mpi]'"
    try:
        from . import _mpi  # noqa: F401
    except ImportError:
        return ("ringreduce was built without the MPI transport: pip install 'ringreduce[mpi]', then rebuild "
                "with MPICC=<path to mpicc> pip install -e .")
    return None


def connect(config: Config, comm=None, tag: str = "world"):
    """Returns (World, _core.Comm) for the ring over `comm` (default COMM_WORLD).
    When all its ranks share one host they also share a host arena for small
    operations (world.extra["arena"]; tag names its file, see attach_arena)."""
    problem = available()
    if problem:
        raise RingReduceError(problem)
    from mpi4py import MPI

    from . import _mpi
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm == MPI.COMM_NULL:
        raise RingReduceError("init(comm=...) got MPI.COMM_NULL: this process is not in that process set")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    world = World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local.Get_rank(),
                  local_size=local.Get_size(), config=config, source="MPI communicator")
    local.Free()
    _check_alike(comm, "RINGREDUCE_SMALL_ALGORITHM", config.small_algorithm or "doubling")
    abort_on_uncaught_exception()
    transport = _mpi.create(comm.py2f(), config.ring_timeout, _pids_on_one_host(comm))
    ring = _core.Comm(world.rank, world.size, -1, -1, (), config.ring_timeout, config.segment_bytes, config.spin,
                      transport)
    if config.small_algorithm:  # small operations by recursive doubling unless "ring" (docs/architecture.md)
        ring.set_small_algorithm(config.small_algorithm)
    try:
        world.extra["arena"] = attach_arena(ring, comm, tag, config)
    except BaseException:
        ring.close()
        raise
    return world, ring


def attach_arena(ring, comm, tag: str, config: Config) -> bool:
    """The host arena (csrc/schedule/host_arena.h) for a ring over MPI whose ranks
    all share one host, as the socket backend's (ringreduce/shm.py): agreed
    with an allgather over `comm`, the communicator the ring was made from
    (its transport runs on a duplicate, so these never meet its messages).
    Small operations then take the arena before recursive doubling, and the
    transport's stalled() judges the arena's waits (csrc/transport/mpi_transport.c).
    Every rank of comm calls it at the same point."""
    from . import shm
    return shm.attach_arena(ring, comm.Get_rank(), comm.Get_size(), tag, config.arena_slot, config.spin,
                            allgather=lambda data: comm.allgather(bytes(data)), reduce=config.arena_reduce)


def _pids_on_one_host(comm):
    """Every rank's pid, in rank order, where all ranks share this host and
    pid namespace (the transport then sees a peer that died while the others
    wait for it in the host arena); else None."""
    from . import shm
    ids = comm.allgather((shm.host_identity(), shm.pid_namespace(), os.getpid()))
    # Namespace 0: unknown (no /proc), so ranks in different ones would look
    # alike, and a live peer's pid, not ours to see, dead.
    alike = ids[0][1] != 0 and all(i[:2] == ids[0][:2] for i in ids)
    return [pid for _, _, pid in ids] if alike else None


def _check_alike(comm, name: str, value: str) -> None:
    """Raises on every rank of comm, naming each rank's value, unless all
    ranks chose `value` alike: ranks on different small algorithms send
    messages the others never receive, and the job would hang."""
    values = comm.allgather(value)
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise ValueError(f"{name} must be alike on every rank ({per_rank})")


def abort_on_uncaught_exception() -> None:
    """A rank that dies of an exception must take the job down: otherwise its
    MPI_Finalize waits for peers that wait for it, and mpirun never returns.
    (What `python -m mpi4py` does, installed for every script.)"""
    if getattr(sys.excepthook, "_ringreduce", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        from mpi4py import MPI
        # The reason first, in one line: mpirun may drop the rest of a long
        # traceback once MPI_Abort starts killing ranks.
        sys.stderr.write(f"ringreduce: rank {MPI.COMM_WORLD.Get_rank()} aborts the MPI job: "
                         f"{kind.__name__}: {value}\n")
        sys.stderr.flush()
        previous(kind, value, tb)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE)  # let mpirun forward those lines before MPI_Abort kills its proxies
        MPI.COMM_WORLD.Abort(1)
    hook._ringreduce = True
    sys.excepthook = hook


def process_set_ring(config: Config, comm, members: list, rank: int):
    """A process set's ring over MPI: a sub-communicator of `comm` (the one
    the world's ring runs over; default COMM_WORLD) holding `members` (its
    ranks, in set order), split by every rank of comm. Returns the set's
    _core.Comm on a member, None elsewhere."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    member = rank in members
    sub = comm.Split(0 if member else MPI.UNDEFINED, members.index(rank) if member else 0)
    if not member:
        return None
    try:
        _, ring = connect(config, sub, tag="set")
    finally:
        sub.Free()  # the transport runs on its own duplicate
    return ring
