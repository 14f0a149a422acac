"""The collectives over numpy arrays: input checks, dtype mapping, the
header that lets ranks catch a mismatch before data moves, and the calls
into the C ring (ringreduce._core).

Every operation starts with one ring pass of small blobs (rr_exchange_blobs):
each rank's header, and for small tensors (Config.small_limit) the data itself.
Every rank then holds every header, so a disagreement raises MismatchError on
all of them alike. Small allreduces finish right there, reducing the blobs in
rank order (N-1 hops instead of the ring's 3(N-1)); large ones run the ring.
Over MPI both passes run by recursive doubling instead (log2 N rounds, the
small allreduce reducing as it goes: csrc/schedule/recursive_doubling.c).
When every rank shares one host the pass is no ring at all: the blobs meet in
a shared arena (csrc/schedule/host_arena.h), each written once and read in place.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import _core, autotune as _autotune, config as _config, cuda as _cuda, mpi_backend, shm as _shm, world as _world
from .errors import MismatchError, RingReduceError, StaleGenerationError


_DTYPES = {
    np.dtype(np.float16): _core.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): _core.BFLOAT16,
    np.dtype(np.float32): _core.FLOAT32,
    np.dtype(np.float64): _core.FLOAT64,
    np.dtype(np.int8): _core.INT8,
    np.dtype(np.uint8): _core.UINT8,
    np.dtype(np.int32): _core.INT32,
    np.dtype(np.int64): _core.INT64,
    np.dtype(np.int16): _core.INT16,
    np.dtype(np.uint16): _core.UINT16,
}
_OPS = {"sum": _core.SUM, "prod": _core.PROD, "min": _core.MIN, "max": _core.MAX, "avg": _core.AVG}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_DTYPE_NAMES = {v: str(k) for k, v in _DTYPES.items()}

ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, BARRIER = range(5)
ALLTOALL = 6  # 5 is the engine's negotiation
NEGOTIATE = 5  # the engine's negotiation pass (ringreduce/negotiation.py): its blob's first byte after the header
_JOINED, _LEFT = 1, 4  # holds its flags, negotiation.JOINED and negotiation.LEFT among them
_KIND_NAMES = ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "engine negotiation", "alltoall"]

# magic, generation, kind, op, dtype code, inline?, root, ndim, name length,
# dtype descriptor length, number of splits; then shape, splits (int64 each),
# name, descriptor. The descriptor (str of the numpy dtype) lets ranks catch a
# dtype mismatch on ops that only move bytes, whose dtypes have no code. The
# generation (0 outside elastic jobs; ringreduce/rendezvous.py) keeps an
# operation of an old ring from ever pairing with one of the new.
_HEAD = struct.Struct("<4sIBBBBiIIHI")
_MAGIC = b"RRH3"
_KIND_AT = 8  # the kind's byte in a header (after magic and generation)


@dataclass
class _Ring:
    """What a collective runs over: the world's ring, or a process set's
    (ringreduce/process_sets.py). `ranks[i]` is the world rank of ring rank i."""
    comm: object
    rank: int
    size: int
    small_limit: int
    ranks: list
    owners: list = field(default_factory=list)  # the ProcessSet objects naming it, invalidated at its end
    # held through each collective on this ring (its C calls must not interleave with another thread's);
    # taken after _state.lock, never before it (see _lookup)
    lock: object = field(default_factory=threading.RLock, repr=False, compare=False)
    # allreduce's fast path: (shape, dtype, op, name) -> _Plan of a small allreduce this ring already ran
    plans: dict = field(default_factory=dict, repr=False)

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


class _Plan(NamedTuple):
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


_MAX_PLANS = 4096  # a ring whose callers make up a new name for every call starts over beyond this


class _State:
    def __init__(self):
        self.lock = threading.RLock()  # init, shutdown, the registry of sets; each ring has its own (_Ring.lock)
        self.world: _world.World | None = None
        self.comm = None
        self.ring: _Ring | None = None  # the world's
        self.sets: dict = {}  # process set id -> _Ring (comm None on a non-member), see process_sets.py
        self.broken: str | None = None
        self.small_limit = 0
        self.init_args: tuple = (None, None)  # (backend, comm) the running ring was made with
        self.generation = 0  # of the elastic rendezvous (0: not elastic); rides in every header


_state = _State()


# --------------------------------------------------------------------------- world


def init(backend: str | None = None, comm=None) -> None:
    """Joins the ring. See ringreduce.world for how the world is found.

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
                w.addr, w.secret = _world.bootstrap_over_mpi(w)
            links = _world.rendezvous(w)
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
        _state.ring = _Ring(_state.comm, _state.world.rank, _state.world.size, _state.small_limit,
                            list(range(_state.world.size)))
        if _autotune.enabled() and _state.world.size > 1:  # before any user collective (ringreduce/autotune.py)
            try:
                _state.world.config = _autotune.tune_ring(_state.ring, _state.world, _state.init_args[0])
            except BaseException:
                shutdown()  # a peer lost while calibrating: leave, so init() may be called again
                raise
            _state.small_limit = _state.ring.small_limit


def attach_arena(comm, rank: int, size: int, tag: str, config: _config.Config) -> bool:
    """The host arena for a socket ring whose ranks share one host (ringreduce/shm.py)."""
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
        for comm in [_state.comm, *(ring.comm for ring in _state.sets.values())]:
            if comm is not None:
                comm.interrupt()
        _state.lock.acquire()
    try:
        for comm in [_state.comm, *(ring.comm for ring in _state.sets.values())]:
            if comm is not None and comm.busy:  # a Comm call on a thread that took no lock (or took it first)
                comm.interrupt()
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


def _require_world() -> _world.World:
    if _state.world is None:
        raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
    return _state.world


def rank() -> int:
    return _require_world().rank


def size() -> int:
    return _require_world().size


def local_rank() -> int:
    return _require_world().local_rank


def local_size() -> int:
    return _require_world().local_size


# --------------------------------------------------------------------------- checks


def _dtype_code(dtype: np.dtype) -> int:
    try:
        return _DTYPES[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(_DTYPE_NAMES.values())
        raise TypeError(f"ringreduce does not support dtype {dtype}; supported: {supported}") from None


def _check_movable(dtype: np.dtype) -> None:
    """Ops that only move bytes (allgather, broadcast, alltoall) take any
    fixed-size dtype whose bytes are its value: not objects (pointers)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.itemsize == 0 or dtype.kind == "T":
        raise TypeError(f"ringreduce cannot move dtype {dtype}: only fixed-size dtypes without Python objects")
    if len(str(dtype).encode()) > 0xFFFF:  # the header's limit (_header_of), refused here before pairing stops
        raise TypeError(f"dtype of {len(dtype.names or ())} fields is too complex to describe in a header")


# A name longer than this is refused before it is sent (the header pass's blob cap is 64 MiB).
MAX_NAME_BYTES = 1 << 20


def _check_name(name) -> None:
    """A collective's name is None or a str that UTF-8 can carry: anything
    else is refused on this rank before data moves (and so on every rank),
    never found while the header is built, after this rank stopped pairing."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"a collective's name must be a str or None, not {type(name).__name__}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"a collective's name must be encodable as UTF-8: {exc.reason} at position {exc.start}") \
            from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"a collective's name is {size} bytes; at most {MAX_NAME_BYTES}")


def _op_code(op: str) -> int:
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(_OPS)}")
    return _OPS[op]


class _HostArrays:
    """numpy arrays: the ring reads and writes them where they are. The GPU
    counterpart is ringreduce.cuda.DeviceArrays; the collectives below are
    written once over either."""

    xp = np

    @staticmethod
    def asarray(x):
        return np.asarray(x)

    @staticmethod
    def to_host(x):
        return x

    @staticmethod
    def from_host(a, like):
        return a

    @staticmethod
    def on(x):
        return contextlib.nullcontext()

    @staticmethod
    def mark(x):
        return None

    @staticmethod
    def wait(marker) -> None:
        pass

    @staticmethod
    def allreduce(comm, src, dst, code, opc):
        comm.allreduce(_raw(src), _raw(dst), code, opc)

    @staticmethod
    def reduce_scatter(comm, src, dst, code, opc):
        comm.reduce_scatter(_raw(src), _raw(dst), code, opc)

    @staticmethod
    def allgather(comm, flat, nbytes):
        comm.allgather(flat, nbytes)

    @staticmethod
    def broadcast(comm, buf, root):
        comm.broadcast(_bytes(buf), root)  # any dtype: the buffer protocol has no code for some


@functools.lru_cache(maxsize=None)
def _device_arrays():
    return _cuda.DeviceArrays()


def _arrays_for(x, reduces: bool = True):
    """The array family of x, and x as one of its arrays, its dtype checked:
    reducible (reduces) or merely movable."""
    family = _device_arrays() if _cuda.is_device_array(x) else _HostArrays
    arr = family.asarray(x)
    if family is _HostArrays:
        arr = _native(arr)
    if reduces:
        _dtype_code(arr.dtype)
    else:
        _check_movable(arr.dtype)
    return family, arr


def _native(a: np.ndarray) -> np.ndarray:
    """a in this machine's byte order (a '>f4' array becomes '<f4' on x86):
    the kernels and the wire work in native order; results come back so."""
    if a.dtype.isnative or a.dtype.hasobject:
        return a
    return a.astype(a.dtype.newbyteorder("="))


def _header(kind, op, dtype, shape, name, root=0, inline=False, descr=None, splits=(), device=False) -> bytes:
    """descr: the numpy dtype; None takes the name of code `dtype`. device: this
    rank runs the operation on a device (the inline byte's bit 1). It changes
    nothing on the wire: a device rank runs the host ring on a pinned mirror
    (csrc/ring.c, the staged path), with the same paths and byte order."""
    return _header_of(_state.generation, kind, op, dtype, shape, name, root, int(inline) | (2 if device else 0),
                      descr, splits)


@functools.lru_cache(maxsize=4096)
def _header_of(generation, kind, op, dtype, shape, name, root, inline, descr, splits) -> bytes:
    encoded = (name or "").encode()
    described = (str(descr) if descr is not None else _DTYPE_NAMES.get(dtype, "")).encode()
    if len(described) > 0xFFFF:
        raise TypeError(f"dtype {descr} is too complex to describe in a header")
    return (_HEAD.pack(_MAGIC, generation, kind, op, dtype, int(inline), root, len(shape), len(encoded), len(described),
                       len(splits))
            + struct.pack(f"<{len(shape)}q{len(splits)}q", *shape, *splits) + encoded + described)


def _parse(blob: bytes) -> dict:
    magic, generation, kind, op, dtype, inline, root, ndim, nlen, dlen, nsplits = _HEAD.unpack_from(blob)
    if magic != _MAGIC:
        raise RingReduceError("malformed header from a peer")
    if generation != _state.generation:
        raise StaleGenerationError(f"a header of generation {generation} met this ring of generation "
                                   f"{_state.generation}: refused, an old ring's operation never pairs with a new one")
    at = _HEAD.size
    shape = struct.unpack_from(f"<{ndim}q", blob, at)
    at += 8 * ndim
    splits = struct.unpack_from(f"<{nsplits}q", blob, at)
    at += 8 * nsplits
    name = blob[at:at + nlen].decode(errors="replace")
    at += nlen
    described = blob[at:at + dlen].decode(errors="replace")
    return {"kind": kind, "op": op, "dtype": described, "code": dtype, "root": root, "shape": shape, "name": name,
            "splits": splits, "inline": bool(inline & 1), "device": bool(inline & 2),
            "payload": memoryview(blob)[at + dlen:]}


def _describe(field, value):
    if field == "kind":
        return _KIND_NAMES[value] if value < len(_KIND_NAMES) else str(value)
    if field == "op":
        return _OP_NAMES.get(value, str(value))
    if field == "dtype":
        return str(value)
    return repr(value)


_AUTOTUNE_PREFIX = "ringreduce.autotune"  # the names of autotune's collectives (ringreduce/autotune.py)
# a collective named so stands for one this rank refuses (bad input of its own): the others then raise,
# naming it and the reason, instead of waiting for it (ringreduce/compression/base.py)
REFUSED_PREFIX = "ringreduce.refused:"


def _refuse(kind: int, problem: Exception, process_set=None) -> None:
    """This rank refuses its own bad input (a TypeError or ValueError found
    before any data moves), but still meets the others' collective, under a
    name saying why: they raise MismatchError naming this rank, instead of
    pairing their collective with this rank's next one (silently wrong data)
    or waiting for it (a hang). The caller then raises its own error."""
    try:
        ring = _lookup(process_set)
        with ring.lock:
            why = f"{REFUSED_PREFIX} {problem}"[:400].encode(errors="replace").decode()  # sendable whatever it holds
            head = _header(kind, 0, 0, (), why)
            _agree(ring.comm.exchange_blobs(head, b""), head, (), _KIND_NAMES[kind], ring)
    except (RingReduceError, TypeError, ValueError):
        pass  # not initialized, or the others refused too, or a peer is lost: this rank's own error says most


def _check_agreement(heads, fields, what: str, ranks=None) -> None:
    """Raises MismatchError on every rank alike: all hold the same headers.
    ranks: how to name each header's sender ("rank 2"; a process set's
    members as "world rank 5 (rank 1 of set 3)"), default rank i."""
    ranks = [f"rank {i}" for i in range(len(heads))] if ranks is None else ranks
    refused = [f"{r}: {h['name'][len(REFUSED_PREFIX):].strip()}" for r, h in zip(ranks, heads)
               if h["name"].startswith(REFUSED_PREFIX)]
    if refused and len(refused) < len(heads):  # a rank met the others only to say why it cannot go on
        raise MismatchError(f"a rank refused this {what}: {'; '.join(refused)}")
    tuning = [i for i, h in enumerate(heads) if h["name"].startswith(_AUTOTUNE_PREFIX)]  # the world's only
    if tuning and len(tuning) < len(heads):  # before any field: the mismatch is the setting, not a dtype
        raise MismatchError(f"RINGREDUCE_AUTOTUNE=1 on rank(s) {', '.join(map(str, tuning))} only: those ranks "
                            "calibrate at init() while the others run collectives; set RINGREDUCE_AUTOTUNE "
                            "alike on every rank")
    for f in ["kind", *fields]:
        values = [h[f] if f != "trailing" else h["shape"][1:] for h in heads]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"{r}: {_describe(f, v)}" for r, v in zip(ranks, values))
            if f == "kind":
                raise MismatchError(f"ranks disagree on which collective to run ({per_rank})")
            label = "shape[1:]" if f == "trailing" else f
            raise MismatchError(f"ranks disagree on the {label} of {what} ({per_rank})")


def _usable_comm():
    if _state.broken is not None:
        raise RingReduceError(f"communicator is unusable after an earlier error: {_state.broken}")
    if _state.comm is None:
        raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
    return _state.comm


def _agree(blobs, head: bytes, fields, what, ring: _Ring | None = None, beside_joined: bool = False) -> None:
    """Raises MismatchError when ranks disagree on a field, on every rank
    alike (all hold the same blobs). Headers that differ only in the inline
    flag (RINGREDUCE_SMALL_BYTES differs between ranks) agree: the caller
    then takes the ring, as every rank does. The communicator stays usable:
    no data has moved. A pass that met joined ranks (rr.join) agrees only
    for an allreduce (beside_joined: the caller then runs the ring, the
    joined ranks adding zeros, _allreduce_beside_joined); anything else
    raises here on every rank that called it, and the joined ranks stay
    joined."""
    if "trailing" in fields or any(b[:len(head)] != head for b in blobs):
        found = _joined_in(blobs) if ring is None or ring is _state.ring else None
        if found is not None:
            problem = _beside_joined(*found)
            if problem is not None:
                raise problem
            if not beside_joined:  # every allreduce header is sent by a caller that runs the ring after it
                raise RingReduceError(f"{what} met joined ranks where only an allreduce can go on")
            return
        _check_agreement([_parse(b) for b in blobs], fields, what, _rank_names(ring))


def _joined_in(blobs):
    """(the joined ranks, every rank's parsed header) when this pass of the
    world's ring paired a collective with the engine negotiation of ranks
    that have called rr.join(), and with nothing else; None otherwise (a rank
    whose engine negotiates without having joined makes it a plain mismatch).
    Decided from the blobs alone: alike on every rank."""
    if not any(len(b) > _KIND_AT and b[_KIND_AT] == NEGOTIATE for b in blobs):  # the usual case, unparsed
        return None
    heads = [_parse(b) for b in blobs]
    joined = [r for r, h in enumerate(heads) if h["kind"] == NEGOTIATE and len(h["payload"])
              and h["payload"][0] & _JOINED]
    if not joined or len(joined) == len(heads) or any(
            h["kind"] == NEGOTIATE for r, h in enumerate(heads) if r not in joined):
        return None
    return joined, heads


def _beside_joined(joined, heads):
    """What the ranks that have not joined asked for beside the joined ones:
    None for an allreduce they all agree on (it runs on the ring, the joined
    ranks adding zeros: Horovod's join, avg still dividing by every rank),
    else the MismatchError those ranks raise (the joined ranks do nothing)."""
    live = [r for r in range(len(heads)) if r not in joined]
    left = [r for r in joined if heads[r]["payload"][0] & _LEFT]
    kind = heads[live[0]]["kind"]
    what = _KIND_NAMES[kind] if kind < len(_KIND_NAMES) else f"collective {kind}"
    whose = ", ".join(map(str, joined))
    try:
        _check_agreement([heads[r] for r in live], ("name",) if kind != ALLREDUCE else
                         ("op", "dtype", "shape", "name"), what, [f"rank {r}" for r in live])
    except MismatchError as exc:
        return MismatchError(f"{exc} (beside rank(s) {whose}, joined)")
    name = heads[live[0]]["name"]
    if left:
        return MismatchError(f"{what} cannot run: rank(s) {', '.join(map(str, left))} have shut down")
    if kind != ALLREDUCE:
        return MismatchError(f"{what} cannot run while rank(s) {whose} have joined (rr.join): until every "
                             "rank has joined only allreduce goes on")
    if name.startswith((REFUSED_PREFIX, _AUTOTUNE_PREFIX)):  # every live rank refused alike: nothing runs
        return MismatchError(f"every rank with data refused this allreduce beside rank(s) {whose}, joined: {name}")
    return None


def _negotiation_pass(head: bytes, blob: bytes):
    """The engine's negotiation pass on the world's ring (its caller holds
    _state.lock): every rank's blob, or None when this joined rank's pass met
    the other ranks' direct allreduce instead, which it then ran with them,
    adding zeros (or, for anything else, let them raise: _beside_joined)."""
    ring = _state.ring
    if ring is None:
        _usable_comm()  # raises: not initialized
    with ring.lock:
        blobs = _usable_comm().exchange_blobs(head, blob)
        found = _joined_in(blobs) if any(b[:len(head)] != head for b in blobs) else None
        if found is None:
            _agree(blobs, head, ("name",), "engine negotiation")
            return blobs
        if _beside_joined(*found) is None:
            _allreduce_beside_joined(blobs, found[1][[r for r in range(len(blobs)) if r not in found[0]][0]], ring)
        return None


def _allreduce_beside_joined(blobs, live, ring) -> None:
    """A joined rank's share of the allreduce the others run (live: one of
    their headers), reduced on the ring like any rank's data: zeros for sum
    and avg (Horovod's join: avg still divides by every rank), the op's
    identity for min, max and prod (those of the ranks with data), as the
    engine's stand-ins (engine._stand_in)."""
    code, op = live["code"], _OP_NAMES[live["op"]]
    dtype = next(d for d, c in _DTYPES.items() if c == code)
    fill = 1 if op == "prod" else 0
    if op in ("min", "max"):
        if dtype.kind == "f" or dtype == _BFLOAT16:
            fill = np.inf if op == "min" else -np.inf
        else:
            fill = np.iinfo(dtype).max if op == "min" else np.iinfo(dtype).min
    src = np.full(live["shape"], fill, dtype=dtype)
    dst = np.empty_like(src)
    ring.comm.allreduce(_raw(src), _raw(dst), code, live["op"])


def _rank_names(ring: _Ring | None) -> list | None:
    """How errors name a ring's ranks: a process set's by world rank and
    rank in the set, the world's as they are (None)."""
    if ring is None or ring is _state.ring or not ring.owners:
        return None
    set_id = ring.owners[0].process_set_id
    return [f"world rank {w} (rank {i} of set {set_id})" for i, w in enumerate(ring.ranks)]


def _exchange(head: bytes, data, fields, what, ring: _Ring | None = None, beside_joined: bool = False):
    """The header pass that starts every operation (data rides along when
    small): returns every rank's blob (of ring's members; default the world).
    Under the ring's lock: the collectives hold it already; the engine's
    negotiation and process_sets' passes, which hold _state.lock, take it here.
    beside_joined: the caller is an allreduce that runs the ring next (_agree)."""
    held = ring if ring is not None else _state.ring
    with held.lock if held is not None else contextlib.nullcontext():
        blobs = (_usable_comm() if ring is None or ring is _state.ring else ring.comm).exchange_blobs(head, data)
    _agree(blobs, head, fields, what, ring, beside_joined)
    return blobs


def _ring(process_set) -> _Ring:
    """The ring a collective runs over: the world's for None or the global
    set; a process set's, which this rank must be a member of."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        if _state.ring is None:
            raise RingReduceError("ringreduce is not initialized: call ringreduce.init() first")
        if _state.broken is not None:
            raise RingReduceError(f"communicator is unusable after an earlier error: {_state.broken}")
        return _state.ring
    from .process_sets import ring_of  # process_sets imports this module
    return ring_of(process_set)


def _lookup(process_set) -> _Ring:
    """The ring a collective runs over, looked up under _state.lock; the
    collective then holds the ring's own lock (`with ring.lock:`).
    Collectives on one ring run one at a time (a header pass and the ring
    steps of one must not interleave with another thread's); those on
    different rings (the world's, a process set's) run at once, as on other
    ranks. _state.lock is released before the ring's lock is taken: a
    thread holding a ring's lock never waits for _state.lock (held by init,
    shutdown, add_process_set and the engine's negotiation, which take ring
    locks inside it). A ring closed by shutdown() in between fails its next
    C call ("shut down"). (Not a context manager: one cost ~1.5 us more.)"""
    with _state.lock:
        return _ring(process_set)


def _all_inline(blobs) -> bool:
    """Whether every rank sent its data with its header: the path is decided
    from the agreed headers, never from one rank's own settings."""
    return all(_parse(b)["inline"] for b in blobs)


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, flat."""
    return a.reshape(-1).view(np.uint8)


def _raw(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array as the C core takes it (the buffer protocol has no
    code for bfloat16, so those go as bytes)."""
    return a.reshape(-1).view(np.uint8) if a.dtype == _BFLOAT16 else a


def _deliver(result, out, xp=np):
    if out is None:
        return result
    if out is not result:
        xp.copyto(out, result.reshape(out.shape))
    return out


# --------------------------------------------------------------------------- collectives


def _payloads(blobs, head_len):
    return [memoryview(b)[head_len:] for b in blobs]


# Averaged as running means, never as sums that could overflow (csrc/kernels/reduce_math.h).
_MEAN_CODES = (_core.FLOAT16, _core.BFLOAT16)


def _reduce_blobs(payloads, dtype, code, opc, shape):
    """Every rank reduces the same payloads in rank order: the same bits everywhere."""
    acc = np.frombuffer(payloads[0], dtype=dtype).copy()
    flat = _raw(acc)
    mean = opc == _core.AVG and code in _MEAN_CODES
    for k, p in enumerate(payloads[1:], start=2):
        if mean:
            _core.mean_fold(flat, p, code, k)
        else:
            _core.reduce(flat, p, code, opc)
    if opc == _core.AVG and not mean:
        _core.divide(flat, code, len(payloads))
    return acc.reshape(shape)


def allreduce(x, op: str = "sum", out=None, name: str | None = None, process_set=None):
    """Reduces x over all ranks (of process_set); returns a new array, or writes `out` (may be x) and returns it."""
    # The fast path: small allreduces are all latency (a 4 KiB one takes ~4 us
    # in C), so a call whose shape, dtype, op and name this ring has already
    # seen take the small path reuses that call's plan (ring.plans) and makes
    # one C call, without the checks below. Buffers the C call cannot use as
    # given, or input never planned, take the checked path, which refuses bad
    # input.
    if type(x) is np.ndarray:
        dtype = x.dtype
        try:
            ring = _state.ring if process_set is None else _ring(process_set)
            plan = ring.plans.get((x.shape, dtype, op, name))
        except Exception:  # not initialized, a bad process set or an unhashable op: the checked path says so
            plan = None
        if plan is not None and plan.rounds == ring.comm.small_rounds:
            # out's shape is compared in C (a Python tuple each costs more than the compare)
            dst = np.empty(plan.shape, dtype) if out is None else \
                out if type(out) is np.ndarray and out.dtype is dtype else None
            if dst is not None:
                # The ring's lock still: another thread's collective may be between its C calls
                # (a header pass, then the ring), and ours must not run in there.
                with ring.lock:
                    # another thread may have run shutdown() and init() since ring was read: then the checked path
                    blobs = ring.comm.try_allreduce_small(plan.head, x, dst, plan.code, plan.opc) \
                        if process_set is not None or ring is _state.ring else NotImplemented
                    if blobs is None:  # every header the same: reduced in that pass
                        return dst
                    if blobs is not NotImplemented:  # headers differ: a mismatch, or a rank that takes the ring
                        return _allreduce_unlike(blobs, plan.head, ring, x, dst, out, plan.code, plan.opc)
    return _allreduce_checked(x, op, out, name, process_set)


def _allreduce_checked(x, op, out, name, process_set):
    """allreduce with every check: any input, refused on every rank when bad;
    a small one that all ranks ran alike leaves its plan for the fast path."""
    if type(x) is not np.ndarray and _cuda.is_device_array(x):
        return _allreduce_device(x, op, out, name, process_set)
    try:
        if type(x) is not np.ndarray:
            x = np.asarray(x)
        code = _DTYPES.get(x.dtype)
        if code is None:
            x = _native(x)
            code = _dtype_code(x.dtype)  # raises the TypeError
        opc = _OPS.get(op)
        if opc is None:
            _op_code(op)  # raises the ValueError
        _check_name(name)
        if out is not None and (type(out) is not np.ndarray or out.shape != x.shape
                                or out.dtype.newbyteorder("=") != x.dtype or not out.flags.writeable):
            raise ValueError(f"out must be a writeable numpy array of shape {x.shape} and dtype {x.dtype}")
    except (TypeError, ValueError) as exc:
        _refuse(ALLREDUCE, exc, process_set)
        raise
    ring = _lookup(process_set)
    with ring.lock:
        rounds = ring.comm.small_rounds if ring.size > 1 else None
        small = x.nbytes <= ring.allreduce_limit
        head = _header(ALLREDUCE, opc, code, x.shape, name, small)
        in_place = out is not None and out.flags.c_contiguous and out.flags.writeable and out.dtype == x.dtype
        src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        dst = out if in_place else np.empty(x.shape, dtype=x.dtype)
        raw = code == _core.BFLOAT16  # the buffer protocol has no bfloat16: pass bytes
        if small:
            blobs = ring.comm.allreduce_small(head, _bytes(src) if raw else src, _bytes(dst) if raw else dst,
                                              code, opc)
            if blobs is None:  # every header the same: reduced in that pass
                if not raw and rounds is not None and type(name) in (str, type(None)):
                    if len(ring.plans) >= _MAX_PLANS:
                        ring.plans.clear()
                    ring.plans[(x.shape, x.dtype, op, name)] = _Plan(head, x.shape, code, opc, rounds)
                return dst if out is None or dst is out else _deliver(dst, out)
            return _allreduce_unlike(blobs, head, ring, src, dst, out, code, opc)
        blobs = _exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
        return _allreduce_ring(blobs, ring, src, dst, out, code, opc)


def _allreduce_unlike(blobs, head, ring, src, dst, out, code, opc):
    """A small allreduce's headers differed: MismatchError on every rank, or,
    when only the path differs (RINGREDUCE_SMALL_BYTES differs between ranks)
    or the others are joined ranks' negotiation (rr.join: _agree), the ring,
    as every rank takes it. src and dst are C-contiguous; called with the
    lock held."""
    _agree(blobs, head, ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
    return _allreduce_ring(blobs, ring, src, dst, out, code, opc)


def _allreduce_ring(blobs, ring, src, dst, out, code, opc):
    """The ring allreduce of src into dst, after the header pass agreed."""
    if dst is not src and np.may_share_memory(dst, src):
        src = src.copy()
    ring.comm.allreduce(_raw(src), _raw(dst), code, opc)
    _note_phases(ring.comm)
    return _deliver(dst, out)


_phase_log = threading.local()  # .log: the list record_phases() collects in on this thread, or None


@contextlib.contextmanager
def record_phases():
    """Collects the phases of every ring allreduce this thread runs inside:
    (start, ScatterReduce done, end), CLOCK_MONOTONIC seconds as the C core
    timed them (comm.last_phases), one per ring op, read under the ring's
    lock right after the op. The small one-pass allreduces (arena, recursive
    doubling, the blob pass) have no such phases and add nothing. The
    engine's timeline shows them (ringreduce/timeline.py)."""
    log, outer = [], getattr(_phase_log, "log", None)
    _phase_log.log = log
    try:
        yield log
    finally:
        _phase_log.log = outer


def _note_phases(comm) -> None:
    log = getattr(_phase_log, "log", None)
    if log is not None:
        log.append(comm.last_phases())


def _allreduce_device(x, op, out, name, process_set=None):
    try:
        g, x = _arrays_for(x)
        code, opc = _dtype_code(x.dtype), _op_code(op)
        _check_name(name)
        if out is not None and (not _cuda.is_device_array(out) or out.shape != x.shape or out.dtype != x.dtype):
            raise ValueError(f"out must be a GPU array of shape {x.shape} and dtype {x.dtype}")
    except (TypeError, ValueError) as exc:
        _refuse(ALLREDUCE, exc, process_set)
        raise
    ring = _lookup(process_set)
    if x.nbytes <= ring.allreduce_limit:  # outside the ring's lock, which allreduce() takes after _state.lock
        # Latency-bound: one copy each way through a pinned bounce buffer and
        # the host path in place there (host kernels: the host ring's bits).
        def reduce(host):
            allreduce(host, op, out=host, name=name, process_set=process_set)
        with g.on(x):
            got = g.allreduce_small(x, out, reduce)
            if got is None:  # the device busy with other threads: through pageable memory
                got = g.from_host(allreduce(g.to_host(x), op, name=name, process_set=process_set), like=x)
            return _deliver(got, out, g.xp)
    with ring.lock, g.on(x):
        head = _header(ALLREDUCE, opc, code, x.shape, name, False, device=True)
        _exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
        src = g.xp.ascontiguousarray(x)
        dst = out if out is not None and out.flags.c_contiguous else g.xp.empty_like(src)
        if dst is not src and g.xp.may_share_memory(dst, src):
            src = src.copy()
        g.allreduce(ring.comm, src, dst, code, opc)
        _note_phases(ring.comm)
        return _deliver(dst, out, g.xp)


def _chunk_bounds(count: int, n: int, i: int) -> tuple[int, int]:
    """Chunk i of count elements over n ranks, as csrc/schedule/ring.c cuts it."""
    base, extra = divmod(count, n)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def reduce_scatter(x, op: str = "sum", name: str | None = None, process_set=None):
    """Returns this rank's chunk of the flattened reduction (chunks in rank order)."""
    try:
        g, x = _arrays_for(x)
        code, opc = _dtype_code(x.dtype), _op_code(op)
        _check_name(name)
    except (TypeError, ValueError) as exc:
        _refuse(REDUCE_SCATTER, exc, process_set)
        raise
    w = _lookup(process_set)
    with w.lock, g.on(x):
        small = x.nbytes <= w.small_limit
        head = _header(REDUCE_SCATTER, opc, code, x.shape, name, inline=small, device=g is not _HostArrays)
        blobs = _exchange(head, g.to_host(x).tobytes() if small else b"",
                          ("op", "dtype", "shape", "name"), "reduce_scatter", w)
        lo, hi = _chunk_bounds(x.size, w.size, w.rank)
        if _all_inline(blobs):
            mine = _reduce_blobs(_payloads(blobs, len(head)), x.dtype, code, opc, (x.size,))[lo:hi].copy()
            return g.from_host(mine, like=x)
        work = g.xp.empty(x.size, dtype=x.dtype)
        g.reduce_scatter(w.comm, g.xp.ascontiguousarray(x), work, code, opc)
        return work[lo:hi].copy()


def allgather(x, name: str | None = None, process_set=None):
    """Concatenates every rank's x along axis 0 (ranks may differ in dim 0 only)."""
    try:
        g, x = _arrays_for(x, reduces=False)
        _check_name(name)
    except (TypeError, ValueError) as exc:
        _refuse(ALLGATHER, exc, process_set)
        raise
    if x.ndim == 0:
        x = x.reshape(1)
    w = _lookup(process_set)
    with w.lock, g.on(x):
        small = x.nbytes <= w.small_limit
        head = _header(ALLGATHER, 0, 0, x.shape, name, inline=small, descr=x.dtype, device=g is not _HostArrays)
        blobs = _exchange(head, g.to_host(x).tobytes() if small else b"",
                          ("dtype", "trailing", "name"), "allgather", w)
        heads = [_parse(b) for b in blobs]
        rows = [h["shape"][0] for h in heads]
        shape = (sum(rows),) + x.shape[1:]
        if all(h["inline"] for h in heads):
            joined = np.concatenate([np.frombuffer(h["payload"], dtype=np.uint8) for h in heads])
            return g.from_host(joined.view(x.dtype).reshape(shape), like=x)
        out = g.xp.empty(shape, dtype=x.dtype)
        flat = _bytes(out)
        row_bytes = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        nbytes = [r * row_bytes for r in rows]
        at = sum(nbytes[:w.rank])
        flat[at:at + nbytes[w.rank]] = _bytes(g.xp.ascontiguousarray(x))
        g.allgather(w.comm, flat, nbytes)
        return out


def broadcast(x, root: int = 0, name: str | None = None, process_set=None):
    """Returns a new array holding root's x (same shape and dtype on every rank).
    root is a world rank; with a process set, one of its members (as Horovod's)."""
    try:
        g, x = _arrays_for(x, reduces=False)
        _check_name(name)
    except (TypeError, ValueError) as exc:
        _refuse(BROADCAST, exc, process_set)
        raise
    w = _lookup(process_set)
    if not isinstance(root, (int, np.integer)):  # 0.0 == 0 would pass `in` below, then fail in struct.pack
        # on one rank but hit another's cached header for 0 (_header_of): their collectives one off
        problem = TypeError(f"root must be an integer rank, not {type(root).__name__} {root!r}")
        _refuse(BROADCAST, problem, process_set)
        raise problem
    if root not in w.ranks:  # refused outside the ring's lock, which _refuse takes after _state.lock
        problem = ValueError(f"root {root} is not a rank of this world of {w.size}" if w is _state.ring
                             else f"root {root} is not a member of process set {process_set.process_set_id} "
                                  f"(ranks {w.ranks})")
        _refuse(BROADCAST, problem, process_set)
        raise problem
    with w.lock, g.on(x):
        root = w.ranks.index(root) if w is not _state.ring else root
        small = x.nbytes <= w.small_limit
        head = _header(BROADCAST, 0, 0, x.shape, name, root=root, inline=small, descr=x.dtype)
        blobs = _exchange(head, g.to_host(x).tobytes() if small and w.rank == root else b"",
                          ("dtype", "shape", "root", "name"), "broadcast", w)
        if _all_inline(blobs):
            # Copied as bytes: numpy copies a padded structured dtype field by field, dropping the padding.
            data = np.frombuffer(blobs[root], np.uint8, offset=len(head)).copy().view(x.dtype).reshape(x.shape)
            return g.from_host(data, like=x)
        buf = g.xp.empty(x.shape, dtype=x.dtype)
        if w.rank == root:  # as bytes, padding included (see above)
            _bytes(buf)[...] = _bytes(g.xp.ascontiguousarray(x))
        g.broadcast(w.comm, buf, root)
        return buf


# How a rank asked alltoall to split its rows (the header's op byte).
_SPLITS_GIVEN, _SPLITS_EQUAL = 0, 1


def _read_splits(splits) -> tuple:
    """splits as a tuple of ints; a TypeError (on this rank, before any
    communication, like any unsupported input) when they are not integers."""
    if hasattr(splits, "numpy"):  # a TensorFlow tensor
        splits = splits.numpy()
    if _cuda.is_device_array(splits):
        splits = _device_arrays().to_host(splits)
    a = np.asarray(splits)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise TypeError(f"alltoall splits must be a 1-d sequence of integers, not {a.dtype} of shape {a.shape}")
    given = tuple(int(v) for v in a)
    if any(v >= 1 << 63 for v in given):  # uint64 splits pass the integer check; the header's int64 would refuse
        # with a struct.error on this rank alone, after the refusal window: the others one collective off
        raise ValueError(f"alltoall splits must fit in int64; got {max(given)}")
    return given


def _split_matrix(heads, n: int) -> list:
    """Every rank's splits (rows it sends to each rank), checked the same way
    on every rank from the same headers: bad splits raise ValueError on all
    of them, before data moves, and the ring stays usable."""
    matrix = []
    for r, h in enumerate(heads):
        rows = h["shape"][0]
        if h["op"] == _SPLITS_EQUAL:
            if rows % n:
                raise ValueError(f"alltoall without splits needs rows divisible by the {n} ranks: rank {r} has "
                                 f"{rows}; pass splits")
            matrix.append([rows // n] * n)
            continue
        splits = list(h["splits"])
        if len(splits) != n:
            raise ValueError(f"alltoall splits need one entry per rank ({n}); rank {r} passed {len(splits)}: {splits}")
        if any(v < 0 for v in splits):
            raise ValueError(f"alltoall splits must not be negative; rank {r} passed {splits}")
        if sum(splits) != rows:
            raise ValueError(f"alltoall splits must sum to the rows of the tensor; rank {r} passed {splits} "
                             f"(sum {sum(splits)}) for {rows} rows")
        matrix.append(splits)
    return matrix


def alltoall(x, splits=None, name: str | None = None, process_set=None):
    """Sends rows of x to every rank: x is split along axis 0 into pieces of
    splits[i] rows for rank i (default: equal pieces; rows must then divide
    by size). Returns (received, received_splits): the pieces every rank sent
    this one, concatenated in rank order, and how many rows came from each
    (int32). Ranks must agree on dtype and shape[1:]; they may differ in rows.
    A GPU array goes through the host and comes back on its GPU."""
    try:
        g, x = _arrays_for(x, reduces=False)
        if x.ndim == 0:
            raise ValueError("alltoall needs a tensor of at least one dimension (its rows are split)")
        given = None if splits is None else _read_splits(splits)
        _check_name(name)
    except (TypeError, ValueError) as exc:
        _refuse(ALLTOALL, exc, process_set)
        raise
    host = np.ascontiguousarray(g.to_host(x))
    w = _lookup(process_set)
    with w.lock, g.on(x):
        n, me = w.size, w.rank
        small = host.nbytes <= w.small_limit
        head = _header(ALLTOALL, _SPLITS_EQUAL if given is None else _SPLITS_GIVEN, 0, host.shape, name,
                       inline=small, descr=host.dtype, splits=given or ())
        blobs = _exchange(head, host.tobytes() if small else b"", ("dtype", "trailing", "name"), "alltoall", w)
        heads = [_parse(b) for b in blobs]
        matrix = _split_matrix(heads, n)
        row_bytes = host.itemsize * int(np.prod(host.shape[1:], dtype=np.int64))
        received_splits = np.array([matrix[o][me] for o in range(n)], dtype=np.int32)
        out = np.empty((int(received_splits.sum()),) + host.shape[1:], dtype=host.dtype)
        flat = _bytes(out)
        if all(h["inline"] for h in heads):
            at = 0
            for o, h in enumerate(heads):
                start = sum(matrix[o][:me]) * row_bytes
                size = matrix[o][me] * row_bytes
                flat[at:at + size] = np.frombuffer(h["payload"], dtype=np.uint8)[start:start + size]
                at += size
        else:
            w.comm.alltoall(_bytes(host), flat, [rows * row_bytes for per in matrix for rows in per])
        return g.from_host(out, like=x), received_splits


def barrier(name: str | None = None, process_set=None) -> None:
    """Returns once every rank (of process_set) has entered the barrier."""
    try:
        _check_name(name)
    except (TypeError, ValueError) as exc:
        _refuse(BARRIER, exc, process_set)
        raise
    w = _lookup(process_set)
    with w.lock:
        head = _header(BARRIER, 0, 0, (), name)
        _exchange(head, b"", ("name",), "barrier", w)
