"""Process sets: collectives among some of the world's ranks, as Horovod's
hvd.ProcessSet / add_process_set / remove_process_set / global_process_set.

    evens = rr.add_process_set([0, 2])       # every rank calls it, same arguments, same order
    if evens.included():
        y = rr.allreduce(x, process_set=evens)   # ranks 0 and 2 only
    rr.remove_process_set(evens)             # every rank again

A set's ranks are sorted (as Horovod's); its rank i is ranks[i]. Each set
has its own ring: over MPI a sub-communicator of the world's, over sockets
its own connections among the members (world.connect_subring),
with its own control star whose rank 0 is the set's first member. Adding and
removing are collectives of the whole world: every rank takes part, so a
mismatch or a bad argument raises on every rank, and a set is added on every
rank or on none. shutdown() ends every set.
"""
from __future__ import annotations

import json
import operator
import re

import numpy as np

from .. import _core
from ..errors import MismatchError
from . import device_ipc as _device_ipc, mpi_backend, shm as _shm, traffic as _traffic, world as _world
from .arrays import DTYPES
from .communicator import Ring, current as _state
from .protocol import ALLGATHER, closing_header, exchange, header, parse
from ..errors import MismatchError, RingReduceError


class ProcessSet:
    """Some ranks of the world, to run collectives among. Pass it to
    add_process_set() (on every rank), then as process_set= to any collective."""

    def __init__(self, ranks):
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator, as Horovod also takes
            raise NotImplementedError("ProcessSet(mpi_comm) is not supported: pass the world ranks of its members "
                                      "(the same list on every rank), e.g. ProcessSet([0, 2])")
        try:
            self.ranks = sorted(operator.index(r) for r in ranks)
        except TypeError:
            raise ValueError(f"ProcessSet needs a sequence of integer ranks, got {ranks!r}") from None
        self.process_set_id: int | None = None
        self.mpi_comm = None  # as Horovod's ProcessSet; sets here are always made from ranks

    def size(self) -> int:
        """How many ranks the set holds."""
        return len(self.ranks)

    def included(self) -> bool:
        """Whether this process is a member."""
        return _state.require_world().rank in self.ranks

    def rank(self) -> int:
        """This process's rank within the set (its index in ranks)."""
        me = _state.require_world().rank
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of {self}")
        return self.ranks.index(me)

    def invalidate(self) -> None:
        """Called when the set is removed; the ranks stay, so it may be added again."""
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank of the world: the set collectives use by default."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self):
        return list(range(_state.require_world().size)) if (_state.comm is not None) else []

    def invalidate(self) -> None:
        pass  # the global set is never removed


global_process_set = _GlobalProcessSet()

_generation = 0  # sets added (or tried) since init, the same count on every rank: names each set's links


def add_process_set(process_set) -> ProcessSet:
    """Registers a set (a ProcessSet or a sequence of ranks) and returns it.

    Every rank of the world calls it, with the same ranks, in the same order
    as every other collective. Raises on every rank: ValueError when any
    rank's ranks are invalid (not integers, out of range, repeated, empty,
    or equal to a registered set's, the global one included), MismatchError
    when ranks disagree, RingReduceError when the set's ring cannot be built."""
    global _generation
    with _state.lock:
        ring = _state.world_ring()  # raises when not initialized
        ps, problem = None, None
        try:
            ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
            problem = _invalid(ps, ring.size)
        except ValueError as exc:
            problem = str(exc)
        ranks = ps.ranks if ps is not None and problem is None else None
        sockets = _state.world.source != "MPI communicator"
        listener = None
        if ranks is not None and sockets and ring.rank in ranks and len(ranks) > 1:
            try:
                listener = _world.open_subring_listener(_state.world)
            except OSError as exc:  # told to every rank in the pass below, not raised alone
                ranks, problem = None, f"cannot listen for the set's ring: {exc}"
        try:
            offers = _agree({"ranks": ranks, "error": problem, "port": listener.port if listener else None},
                            "ringreduce.add_process_set", "add_process_set")
            _generation += 1  # counted once every rank has run this pass: a rank that joined (rr.join) ran none
            _check_offers(offers, "add_process_set")
            set_id = min(set(range(1, len(_state.sets) + 2)) - set(_state.sets))
            comm, links, failure = None, None, None
            try:
                comm, links = _connect(ring, ranks, set_id, [o["port"] for o in offers], listener)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
                failure = f"{type(exc).__name__}: {exc}"
        finally:
            if listener is not None:
                listener.close()  # connect_subring closed it already, unless it never ran (closing twice is fine)
        # Added everywhere or nowhere: every rank learns whether every member made its ring.
        outcome = _agree({"error": failure}, "ringreduce.add_process_set.done", "add_process_set")
        failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcome) if o.get("error")]
        if failed:
            if comm is not None:
                comm.close()
            raise RingReduceError(f"add_process_set({ranks}) failed: " + "; ".join(failed))
        member = ranks.index(ring.rank) if ring.rank in ranks else -1
        arena = comm is not None and comm.arena_slot > 0
        if comm is not None:
            comm = SetComm(comm, set_id, ranks, links)
        _state.sets[set_id] = Ring(comm, member, len(ranks),
                                          _state.world.config.small_limit(len(ranks), arena), ranks, [ps])
        ps.process_set_id = set_id
        return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a set added by add_process_set, closing its ring, and
    invalidates the set (its process_set_id becomes None; it may be added again). Every
    rank calls it, in the same order as every other collective. Returns
    False for the global set (never removed), True otherwise."""
    if process_set is global_process_set or getattr(process_set, "process_set_id", None) == 0:
        return False
    with _state.lock:
        _state.world_ring()
        set_id = getattr(process_set, "process_set_id", None)
        problem = None
        if not isinstance(process_set, ProcessSet):
            problem = f"remove_process_set needs a ProcessSet, got {type(process_set).__name__}"
        elif set_id not in _state.sets or _state.sets[set_id].ranks != process_set.ranks:
            problem = f"{process_set} is not a registered process set"
        offers = _agree({"ranks": str(process_set) if problem is None else None, "error": problem},
                        "ringreduce.remove_process_set", "remove_process_set")
        _check_offers(offers, "remove_process_set")
        ring = _state.sets.pop(set_id)
        if ring.comm is not None:
            with ring.lock:  # a collective on the set from another thread ends first, as it did under _state.lock
                _traffic.retire(ring.comm)  # its bytes sent still count in rr.stats()
                _device_ipc.release(ring, closing_header())  # collective: the peers close what they opened of ours first
                ring.comm.close()
        for ps in ring.owners:
            ps.invalidate()
        return True


def ring_of(process_set) -> Ring:
    """The ring a collective runs over: the world's for None or the global
    set; a process set's, which this rank must be a member of (ValueError at
    once on a set not registered or not this rank's, TypeError on anything
    that is no ProcessSet)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return _state.world_ring()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ringreduce.ProcessSet, got {type(process_set).__name__}")
    _state.world_ring()  # raises when not initialized
    ring = _state.sets.get(process_set.process_set_id)
    if ring is None or process_set.process_set_id is None or ring.ranks != process_set.ranks:
        raise ValueError(f"{process_set} is not registered: call add_process_set on every rank first "
                         "(shutdown() and remove_process_set end a set)")
    if ring.comm is None:
        raise ValueError(f"rank {_state.require_world().rank} is not a member of {process_set}: only its members "
                         "may call collectives on it")
    return ring


def lookup(process_set) -> Ring:
    """The ring a collective runs over, looked up under the communicator's
    lock; the collective then holds the ring's own lock (`with ring.lock:`).
    Collectives on one ring run one at a time (a header pass and the ring
    steps of one must not interleave with another thread's); those on
    different rings (the world's, a process set's) run at once, as on other
    ranks. The communicator's lock is released before the ring's lock is
    taken: a thread holding a ring's lock never waits for the communicator's
    (held by init, shutdown, add_process_set and the engine's negotiation,
    which take ring locks inside it). A ring closed by shutdown() in between
    fails its next C call ("shut down"). (Not a context manager: one cost
    ~1.5 us more.)"""
    with _state.lock:
        return ring_of(process_set)


def find_process_set(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: global_process_set); ValueError if none."""
    if process_set_id == 0:
        return global_process_set
    _state.world_ring()  # raises when not initialized
    ring = _state.sets.get(process_set_id)
    if ring is None or not ring.owners:
        raise ValueError(f"no process set has id {process_set_id!r}: add_process_set returns the ids")
    return ring.owners[0]


# --------------------------------------------------------------------------- internals


def _invalid(ps: ProcessSet, size: int) -> str | None:
    """Why ps cannot be added on this world, or None."""
    if not ps.ranks:
        return "a process set needs at least one rank"
    if ps.ranks[0] < 0 or ps.ranks[-1] >= size:
        return f"ranks {ps.ranks} are not all ranks of this world of {size}"
    if len(set(ps.ranks)) != len(ps.ranks):
        return f"ranks {ps.ranks} repeat a rank"
    if ps.ranks == list(range(size)):
        return f"ranks {ps.ranks} are the global process set's"
    for set_id, ring in _state.sets.items():
        if ring.ranks == ps.ranks:
            return f"ranks {ps.ranks} are already process set {set_id}'s"
    if ps.process_set_id is not None and ps.process_set_id in _state.sets:
        return f"{ps} is already registered"
    return None


def _agree(obj: dict, name: str, what: str) -> list:
    """Every world rank's obj, in rank order: one header pass of the world's
    ring, which fails with MismatchError on every rank if a rank runs another
    collective meanwhile. Beside ranks that have joined (rr.join), which run
    no such pass until join() returns, it fails on the ranks that called it,
    naming `what` and the joined ranks; the joined ranks stay joined and hold
    the same registry of sets as before (nothing was added or removed)."""
    data = json.dumps(obj).encode()
    head = header(ALLGATHER, 0, DTYPES[np.dtype(np.uint8)], (len(data),), name, inline=True)
    try:
        blobs = exchange(head, data, ("dtype", "trailing", "name"), name)
    except MismatchError as exc:
        joined, left = getattr(exc, "joined", None), getattr(exc, "left", None)
        if left:
            raise MismatchError(f"{what} cannot run: rank(s) {', '.join(map(str, left))} have shut down") from None
        if joined:
            raise MismatchError(f"{what} cannot run while rank(s) {', '.join(map(str, joined))} have joined "
                                "(rr.join): every rank adds and removes process sets alike, before join() or "
                                "once it has returned") from None
        raise
    return [json.loads(bytes(parse(b)["payload"])) for b in blobs]


def _check_offers(offers: list, what: str) -> None:
    """Raises on every rank alike (all hold the same offers)."""
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(offers) if o.get("error")]
    if errors:
        raise ValueError(f"{what} failed: " + "; ".join(errors))
    wanted = [o["ranks"] for o in offers]
    if any(w != wanted[0] for w in wanted):
        per_rank = ", ".join(f"rank {r}: {w}" for r, w in enumerate(wanted))
        raise MismatchError(f"ranks disagree on the process set to {what.split('_')[0]} ({per_rank})")


def _connect(ring, ranks: list, set_id: int, ports: list, listener):
    """This rank's _core.Comm for the new set (None on a non-member), and how
    its links move data (None over MPI)."""
    world = _state.world
    if world.source == "MPI communicator":
        return mpi_backend.process_set_ring(world.config, _state.init_args[1], ranks, ring.rank), None
    if ring.rank not in ranks:
        return None, None
    me = ranks.index(ring.rank)
    links = _world.connect_subring(world, listener, me, ranks, [ports[r] for r in ranks],
                                   f"process set {set_id}", _generation) if listener is not None else _world.Links()
    cfg = world.config
    comm = _core.Comm(me, len(ranks), links.next_fd, links.prev_fd, links.ctrl_fds, cfg.ring_timeout,
                      cfg.segment_bytes, cfg.spin, tx_shm=links.tx_shm_fd, rx_shm=links.rx_shm_fd)
    try:
        _shm.attach_arena(comm, me, len(ranks), f"set{set_id}", cfg.arena_slot, cfg.spin, reduce=cfg.arena_reduce)
        _shm.agree_zero_copy(comm, cfg.shm_zerocopy)
        _shm.agree_cma(comm, me, len(ranks), cfg.shm_cma)
    except BaseException:
        comm.close()
        raise
    return comm, links.kinds()


class SetComm:
    """A set's _core.Comm whose errors name world ranks: the C core knows
    only the set's ranks, so every rank its message names (the lost one, the
    one that waited, the one that reported) is rewritten as "world rank W
    (rank r of set S)", and .rank is the lost member's world rank
    (.set_rank: its rank in the set)."""

    def __init__(self, comm, set_id: int, ranks: list, links: dict | None):
        self._comm, self._set_id, self._ranks = comm, set_id, ranks
        self.links = links  # {"next": "shm" or "tcp", "prev": ...}; None over MPI

    def __getattr__(self, attr):
        fn = getattr(self._comm, attr)
        if attr == "broken" and fn is not None:  # why the ring is unusable: a C message, in set ranks
            return f"{self._where()}: {in_world_terms(fn, self._ranks, self._set_id)}"
        if not callable(fn):  # an attribute (small_rounds)
            return fn

        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except RingReduceError as exc:
                raise self._in_world_terms(exc) from None
        return call

    def _where(self) -> str:
        return f"process set {self._set_id} (world ranks {self._ranks})"

    def _in_world_terms(self, exc: RingReduceError) -> RingReduceError:
        message = f"{self._where()}: {in_world_terms(str(exc), self._ranks, self._set_id)}"
        if exc.rank is None or not 0 <= exc.rank < len(self._ranks):
            return type(exc)(message)
        new = type(exc)(message, self._ranks[exc.rank])
        new.set_rank = exc.rank
        return new


# "rank 3" or "this rank (3)" in a message of the C core, whose ranks are the set's.
_SET_RANK = re.compile(r"(?<!world )\b(?:this rank \((\d+)\)|rank (\d+))")


def in_world_terms(message: str, ranks: list, set_id: int) -> str:
    """message (from a set's ring, which numbers its members 0..k-1) with each
    rank named as "world rank W (rank r of set S)", where W is ranks[r]."""
    def rewrite(m: re.Match) -> str:
        this, r = m.group(1) is not None, int(m.group(1) or m.group(2))
        if not 0 <= r < len(ranks):
            return m.group(0)
        if this:
            return f"this rank (world rank {ranks[r]}, rank {r} of set {set_id})"
        return f"world rank {ranks[r]} (rank {r} of set {set_id})"
    return _SET_RANK.sub(rewrite, message)
