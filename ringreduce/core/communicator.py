"""The communicator of this process: the world, its ring, the process sets'
rings and the lock that orders init, shutdown and the registry of sets.
One object, `current`, read through communicator() and its methods; only
core/ assigns its fields (lifecycle.py, process_sets.py)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import RingReduceError
from . import world as _world


@dataclass
class Ring:
    """What a collective runs over: the world's ring, or a process set's
    (process_sets.py). `ranks[i]` is the world rank of ring rank i."""
    comm: object
    rank: int
    size: int
    small_limit: int
    ranks: list
    owners: list = field(default_factory=list)  # the ProcessSet objects naming it, invalidated at its end
    # held through each collective on this ring (its C calls must not interleave with another thread's);
    # taken after the communicator's lock, never before it (see process_sets.lookup)
    lock: object = field(default_factory=threading.RLock, repr=False, compare=False)
    # allreduce's fast path: (shape, dtype, op, name) -> Plan of a small allreduce this ring already ran
    plans: dict = field(default_factory=dict, repr=False)
    # the world's ring only: its hierarchical allreduce (ringreduce/core/hierarchy.py), or None: the flat ring
    hierarchy: object = field(default=None, repr=False, compare=False)
    # whether this ring's GPU allreduces go device to device (core/device_ipc.py), agreed by every rank on its
    # first one; None: not yet agreed
    ipc: object = field(default=None, repr=False, compare=False)
    # whether a small GPU allreduce, while ipc is None, takes the ring's device path so that the ring agrees;
    # False once such a pass met a host rank (core/device_ipc.py: small_agrees_first)
    small_asks_ipc: bool = field(default=True, repr=False, compare=False)
    # weak references to the devices (ringreduce._core.Device) this rank ran the ring's IPC collectives on: each keeps windows for
    # the ring until device_ipc.release, collective, before the ring closes
    ipc_devices: list = field(default_factory=list, repr=False, compare=False)

    def __setattr__(self, attr, value):
        if attr == "small_limit" and "plans" in self.__dict__:  # autotune moved the limit: decide afresh
            self.plans.clear()
        object.__setattr__(self, attr, value)

    @property
    def allreduce_limit(self) -> int:
        """Largest allreduce on the small path. small_limit spends a budget of
        bytes the busiest rank sends (Config.small_limit: N-1 tensors around
        the ring); recursive doubling over MPI sends only comm.small_rounds
        tensors (log2 N, +1 off powers of two), so a larger tensor fits the
        same budget. (+ N-2: the budget back whole from its floor division.)"""
        rounds = self.comm.small_rounds if self.size > 1 else 1
        return (self.small_limit * (self.size - 1) + self.size - 2) // rounds if rounds else self.small_limit


class Plan(NamedTuple):
    """What a checked small allreduce decided, for the next one of the same
    shape, dtype, op and name on its ring: the header (the path's decision in
    its inline flag), the shape (for the output), the codes, and the
    comm.small_rounds the limit was computed with (Comm.set_small_algorithm
    may change it between calls)."""
    head: bytes
    shape: tuple
    code: int
    opc: int
    rounds: int


MAX_PLANS = 4096  # a ring whose callers make up a new name for every call starts over beyond this


class Communicator:
    """The world this process joined and the rings it runs collectives on.
    Fields are read freely; init, shutdown and the process set registry
    change them under `lock`, each collective holds its ring's lock (taken
    after `lock`, never before it: process_sets.lookup)."""

    def __init__(self):
        self.lock = threading.RLock()  # init, shutdown, the registry of sets; each ring has its own (Ring.lock)
        self.world: _world.World | None = None
        self.comm = None
        self.ring: Ring | None = None  # the world's
        self.sets: dict = {}  # process set id -> Ring (comm None on a non-member), see process_sets.py
        self.broken: str | None = None
        self.small_limit = 0
        self.init_args: tuple = (None, None)  # (backend, comm) the running ring was made with
        self.generation = 0  # of the elastic rendezvous (0: not elastic); rides in every header

    def require_world(self) -> _world.World:
        """The world joined; RingReduceError when not initialized."""
        if self.world is None:
            raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
        return self.world

    def usable_comm(self):
        """The world's C communicator; RingReduceError when not initialized or broken."""
        if self.broken is not None:
            raise RingReduceError(f"communicator is unusable after an earlier error: {self.broken}")
        if self.comm is None:
            raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
        return self.comm

    def world_ring(self) -> "Ring":
        """The world's ring; RingReduceError when not initialized or broken."""
        if self.ring is None:
            raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
        if self.broken is not None:
            raise RingReduceError(f"communicator is unusable after an earlier error: {self.broken}")
        return self.ring

    def set_ring(self, set_id: int) -> "Ring | None":
        """The ring of registered process set set_id (comm None where this
        rank is no member), None when no such set is registered."""
        return self.sets.get(set_id)

    def comms(self) -> list:
        """Every open C communicator: the world's, its hierarchy's rings, then each set's this rank is a member of."""
        hier = self.ring.hierarchy.comms() if self.ring is not None and self.ring.hierarchy is not None else []
        return [c for c in [self.comm, *hier, *(ring.comm for ring in tuple(self.sets.values()))] if c is not None]


current = Communicator()


def communicator() -> Communicator:
    """This process's communicator (one per process, for its whole life)."""
    return current
