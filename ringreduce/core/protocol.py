"""The header pass that starts every operation, and the agreement it checks.

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

import contextlib
import functools
import math
import struct
import threading

import numpy as np

from ..errors import MismatchError, PeerLostError, RingReduceError, StaleGenerationError
from .arrays import BFLOAT16, DTYPE_NAMES, DTYPES, OP_NAMES, as_raw
from .communicator import Ring, current as _state
from .hierarchy import run_allreduce


ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, BARRIER = range(5)
ALLTOALL = 6  # 5 is the engine's negotiation
NEGOTIATE = 5  # the engine's negotiation pass (ringreduce/engine/negotiation.py)
JOINED, LEFT = 1, 4  # flags in a negotiation blob's first byte (negotiation.JOINED, negotiation.LEFT)
KIND_NAMES = ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "engine negotiation", "alltoall"]

# magic, generation, kind, op, dtype code, inline?, root, ndim, name length,
# dtype descriptor length, number of splits; then shape, splits (int64 each),
# name, descriptor. The descriptor (str of the numpy dtype) lets ranks catch a
# dtype mismatch on ops that only move bytes, whose dtypes have no code. The
# generation (0 outside elastic jobs; ringreduce/launch/rendezvous_server.py) keeps an
# operation of an old ring from ever pairing with one of the new.
HEAD = struct.Struct("<4sIBBBBiIIHI")
MAGIC = b"RRH3"
_KIND_AT = 8  # the kind's byte in a header (after magic and generation)


class _Marks(threading.local):
    engine = False  # this thread is the engine's (mark_engine_thread)


marks = _Marks()
ENGINE_RUN = 4  # the inline byte's bit 2: the engine's thread runs this collective, negotiated beforehand


def mark_engine_thread() -> None:
    """The calling thread is the engine's: the collectives it runs carry the
    engine's mark in their headers (ENGINE_RUN). A joined member's serving
    pass on a process set's ring (serve_beside_join) that meets them steps
    aside for that rank's engine, which runs its stand-ins for them."""
    marks.engine = True


def header(kind, op, dtype, shape, name, root=0, inline=False, descr=None, splits=(), device=False) -> bytes:
    """descr: the numpy dtype; None takes the name of code `dtype`. device: this
    rank runs the operation on a device (the inline byte's bit 1). It changes
    nothing on the wire: a device rank runs the host ring on a pinned mirror
    (csrc/schedule/ring.c, the staged path), with the same paths and byte order.
    The engine's thread marks its headers (bit 2, mark_engine_thread)."""
    return _header_of(_state.generation, kind, op, dtype, shape, name, root,
                      int(inline) | (2 if device else 0) | (ENGINE_RUN if marks.engine else 0), descr, splits)


@functools.lru_cache(maxsize=4096)
def _header_of(generation, kind, op, dtype, shape, name, root, inline, descr, splits) -> bytes:
    encoded = (name or "").encode()
    described = (str(descr) if descr is not None else DTYPE_NAMES.get(dtype, "")).encode()
    if len(described) > 0xFFFF:
        raise TypeError(f"dtype {descr} is too complex to describe in a header")
    return (HEAD.pack(MAGIC, generation, kind, op, dtype, int(inline), root, len(shape), len(encoded), len(described),
                       len(splits))
            + struct.pack(f"<{len(shape)}q{len(splits)}q", *shape, *splits) + encoded + described)


def parse(blob: bytes) -> dict:
    magic, generation, kind, op, dtype, inline, root, ndim, nlen, dlen, nsplits = HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise RingReduceError("malformed header from a peer")
    if generation != _state.generation:
        raise StaleGenerationError(f"a header of generation {generation} met this ring of generation "
                                   f"{_state.generation}: refused, an old ring's operation never pairs with a new one")
    at = HEAD.size
    shape = struct.unpack_from(f"<{ndim}q", blob, at)
    at += 8 * ndim
    splits = struct.unpack_from(f"<{nsplits}q", blob, at)
    at += 8 * nsplits
    name = blob[at:at + nlen].decode(errors="replace")
    at += nlen
    described = blob[at:at + dlen].decode(errors="replace")
    return {"kind": kind, "op": op, "dtype": described, "code": dtype, "root": root, "shape": shape, "name": name,
            "splits": splits, "inline": bool(inline & 1), "device": bool(inline & 2),
            "engine": bool(inline & ENGINE_RUN),
            "payload": memoryview(blob)[at + dlen:]}


def _describe(field, value):
    if field == "kind":
        return KIND_NAMES[value] if value < len(KIND_NAMES) else str(value)
    if field == "op":
        return OP_NAMES.get(value, str(value))
    if field == "dtype":
        return str(value)
    return repr(value)


AUTOTUNE_PREFIX = "ringreduce.autotune"  # the names of autotune's collectives (ringreduce/core/autotune.py)
# a collective named so stands for one this rank refuses (bad input of its own): the others then raise,
# naming it and the reason, instead of waiting for it (ringreduce/compression/base.py)
REFUSED_PREFIX = "ringreduce.refused:"
# the barrier of a rank closing a ring whose peers must hear it first (device_ipc.release): the others'
# collectives that meet it raise PeerLostError naming that rank, never pair with it
CLOSING_NAME = "ringreduce.closing"


def closing_header() -> bytes:
    """The header of a rank's last pass on a ring it closes (CLOSING_NAME)."""
    return header(BARRIER, 0, 0, (), CLOSING_NAME)


def check_agreement(heads, fields, what: str, ranks=None) -> None:
    """Raises MismatchError on every rank alike: all hold the same headers.
    ranks: how to name each header's sender ("rank 2"; a process set's
    members as "world rank 5 (rank 1 of set 3)"), default rank i."""
    ranks = [f"rank {i}" for i in range(len(heads))] if ranks is None else ranks
    refused = [f"{r}: {h['name'][len(REFUSED_PREFIX):].strip()}" for r, h in zip(ranks, heads)
               if h["name"].startswith(REFUSED_PREFIX)]
    if refused and len(refused) < len(heads):  # a rank met the others only to say why it cannot go on
        raise MismatchError(f"a rank refused this {what}: {'; '.join(refused)}")
    tuning = [i for i, h in enumerate(heads) if h["name"].startswith(AUTOTUNE_PREFIX)]  # the world's only
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


def agree(blobs, head: bytes, fields, what, ring: Ring | None = None, beside_joined: bool = False) -> None:
    """Raises MismatchError when ranks disagree on a field, on every rank
    alike (all hold the same blobs). Headers that differ only in the inline
    flag (RINGREDUCE_SMALL_BYTES differs between ranks) agree: the caller
    then takes the ring, as every rank does. The communicator stays usable:
    no data has moved. A pass that met joined ranks (rr.join; on a set's
    ring their serving passes, serve_beside_join) agrees only
    for an allreduce (beside_joined: the caller then runs the ring, the
    joined ranks adding zeros, _allreduce_beside_joined); anything else
    raises here on every rank that called it, and the joined ranks stay
    joined."""
    if "trailing" in fields or any(b[:len(head)] != head for b in blobs):
        _check_none_closing(blobs, what, ring)
        found = _joined_in(blobs)
        if found is not None:
            problem = _beside_joined(*found, _world_ranks(ring))
            if problem is not None:
                raise problem
            if not beside_joined:  # every allreduce header is sent by a caller that runs the ring after it
                raise RingReduceError(f"{what} met joined ranks where only an allreduce can go on")
            return
        check_agreement(_parse_all(blobs, what, ring), fields, what, _rank_names(ring))


def _parse_all(blobs, what, ring) -> list:
    """Every rank's header, parsed; RingReduceError naming the first rank
    whose blob is no header: that rank is out of step with this one (it
    runs a pass of its own, an IPC handshake or the agreement's, where this
    one runs `what`'s header pass). Alike on every rank that parses them."""
    for q, b in enumerate(blobs):
        if bytes(b[:len(MAGIC)]) != MAGIC or len(b) < HEAD.size:
            names, world = _rank_names(ring), _world_ranks(ring)
            raise RingReduceError(f"{names[q] if names else f'rank {q}'} sent no header in this rank's {what} "
                                  "header pass: its collectives are out of step with this rank's",
                                  rank=q if world is None else world[q])
    return [parse(b) for b in blobs]


def _check_none_closing(blobs, what, ring) -> None:
    """Raises PeerLostError, naming the rank, where a rank's header in this
    pass is its last one on the ring (closing_header): it is closing the
    ring (rr.shutdown(), remove_process_set) while this rank runs `what`."""
    closing = closing_header()
    at = next((q for q, b in enumerate(blobs) if b == closing), None)
    if at is not None:
        world = _world_ranks(ring)
        names = _rank_names(ring)
        raise PeerLostError(f"{names[at] if names else f'rank {at}'} closed the ring (rr.shutdown() or "
                            f"remove_process_set) while this rank's {what} waited for it",
                            rank=at if world is None else world[at])


def _joined_in(blobs):
    """(the joined ranks, every rank's parsed header) when this pass of the
    world's ring paired a collective with the engine negotiation of ranks
    that have called rr.join(), and with nothing else; None otherwise (a rank
    whose engine negotiates without having joined makes it a plain mismatch).
    Decided from the blobs alone: alike on every rank."""
    if not any(len(b) > _KIND_AT and b[_KIND_AT] == NEGOTIATE for b in blobs):  # the usual case, unparsed
        return None
    heads = [parse(b) for b in blobs]
    joined = [r for r, h in enumerate(heads) if h["kind"] == NEGOTIATE and len(h["payload"])
              and h["payload"][0] & JOINED]
    if not joined or len(joined) == len(heads) or any(
            h["kind"] == NEGOTIATE for r, h in enumerate(heads) if r not in joined):
        return None
    return joined, heads


def _beside_joined(joined, heads, world=None):
    """What the ranks that have not joined asked for beside the joined ones:
    None for an allreduce they all agree on (it runs on the ring, the joined
    ranks adding zeros: Horovod's join, avg still dividing by every rank),
    else the MismatchError those ranks raise (the joined ranks do nothing),
    its .joined the joined ranks and .left those of them that have shut
    down, for callers that name the operation in their own terms (world
    ranks; world: a process set's world rank of each ring rank)."""
    problem = _problem_beside_joined(joined, heads, world)
    if problem is not None:
        problem.joined = [r if world is None else world[r] for r in joined]
        problem.left = [r if world is None else world[r] for r in joined if heads[r]["payload"][0] & LEFT]
    return problem


def _problem_beside_joined(joined, heads, world):
    live = [r for r in range(len(heads)) if r not in joined]
    left = [r for r in joined if heads[r]["payload"][0] & LEFT]
    kind = heads[live[0]]["kind"]
    what = KIND_NAMES[kind] if kind < len(KIND_NAMES) else f"collective {kind}"
    named = (lambda rs: "rank(s) " + ", ".join(map(str, rs))) if world is None else \
        (lambda rs: "world rank(s) " + ", ".join(str(world[r]) for r in rs))
    whose = named(joined)
    try:
        check_agreement([heads[r] for r in live], ("name",) if kind != ALLREDUCE else
                        ("op", "dtype", "shape", "name"), what,
                        [f"rank {r}" if world is None else f"world rank {world[r]}" for r in live])
    except MismatchError as exc:
        return MismatchError(f"{exc} (beside {whose}, joined)")
    name = heads[live[0]]["name"]
    if left:
        return MismatchError(f"{what} cannot run: {named(left)} have shut down")
    if kind != ALLREDUCE:
        return MismatchError(f"{what} cannot run while {whose} have joined (rr.join): until every "
                             "rank has joined only allreduce goes on")
    if name.startswith((REFUSED_PREFIX, AUTOTUNE_PREFIX)):  # every live rank refused alike: nothing runs
        return MismatchError(f"every rank with data refused this allreduce beside {whose}, joined: {name}")
    return None


def negotiation_pass(head: bytes, blob: bytes):
    """The engine's negotiation pass on the world's ring (its caller holds
    the communicator's lock): every rank's blob, or None when this joined
    rank's pass met the other ranks' direct allreduce instead, which it then
    ran with them, adding zeros (or, for anything else, let them raise:
    _beside_joined)."""
    ring = _state.ring
    if ring is None:
        _state.usable_comm()  # raises: not initialized
    with ring.lock:
        blobs = _state.usable_comm().exchange_blobs(head, blob)
        found = _joined_in(blobs) if any(b[:len(head)] != head for b in blobs) else None
        if found is None:
            agree(blobs, head, ("name",), "engine negotiation")
            return blobs
        if _beside_joined(*found) is None:
            _allreduce_beside_joined(blobs, found[1][[r for r in range(len(blobs)) if r not in found[0]][0]], ring)
        return None


def _world_ranks(ring: Ring | None) -> list | None:
    """A process set's world rank of each of its ring ranks; None for the world's."""
    return None if ring is None or ring is _state.ring else ring.ranks


def voided(blobs, ring: Ring | None) -> bool:
    """Whether this pass of a process set's ring paired the engine's
    collective (headers marked ENGINE_RUN) with joined members' serving
    passes: the pass is void on every rank alike, and the ranks with data
    run it again, then meeting the joined members' engines, which run their
    stand-ins for what the world's negotiation agreed (so a compressor's
    several collectives take one path alike on every member)."""
    if ring is None or ring is _state.ring or not any(len(b) > _KIND_AT and b[_KIND_AT] == NEGOTIATE for b in blobs):
        return False
    found = _joined_in(blobs)
    return found is not None and all(h["engine"] for r, h in enumerate(found[1]) if r not in found[0])


SERVED, REFUSED, STEPPED_ASIDE, ALL_JOINED = "served", "refused", "stepped aside", "all joined"
JOINED_NAME = "ringreduce.joined"  # the name of a joined member's serving pass on a process set's ring


def serve_beside_join(ring: Ring, timeout: float, left: bool = False) -> str:
    """One serving pass of a joined member (rr.join) on a process set's ring:
    it waits, for as long as it takes (the members with data may run no
    collective on the set for a long time), for the others' next collective
    on the set, then does there what a joined rank does on the world's ring:
    an allreduce goes on with this rank's zeros (_allreduce_beside_joined:
    SERVED), anything else raises on the members that called it (REFUSED).
    STEPPED_ASIDE: the engine's collective met it, which this rank's engine
    runs (voided). ALL_JOINED: every member's serving pass met; the caller
    stops serving. timeout: RINGREDUCE_TIMEOUT, what every later wait is
    held to again, the allreduce's ring steps too."""
    head = header(NEGOTIATE, 0, 0, (), JOINED_NAME)
    with ring.lock:
        ring.comm.set_timeout(math.inf)
        try:
            blobs = ring.comm.exchange_blobs(head, bytes([JOINED | (LEFT if left else 0)]))
        finally:
            ring.comm.set_timeout(timeout)
        found = _joined_in(blobs)
        if found is None:
            return ALL_JOINED if all(b[:len(head)] == head for b in blobs) else REFUSED
        if voided(blobs, ring):
            return STEPPED_ASIDE
        if _beside_joined(*found, ring.ranks) is not None:
            return REFUSED
        _allreduce_beside_joined(blobs, found[1][[r for r in range(len(blobs)) if r not in found[0]][0]], ring)
        return SERVED


def _allreduce_beside_joined(blobs, live, ring) -> None:
    """A joined rank's share of the allreduce the others run (live: one of
    their headers), reduced on the ring like any rank's data: zeros for sum
    and avg (Horovod's join: avg still divides by every rank), the op's
    identity for min, max and prod (those of the ranks with data), as the
    engine's stand-ins (engine/scheduler.py _stand_in)."""
    code, op = live["code"], OP_NAMES[live["op"]]
    dtype = next(d for d, c in DTYPES.items() if c == code)
    fill = 1 if op == "prod" else 0
    if op in ("min", "max"):
        if dtype.kind == "f" or dtype == BFLOAT16:
            fill = np.inf if op == "min" else -np.inf
        else:
            fill = np.iinfo(dtype).max if op == "min" else np.iinfo(dtype).min
    src = np.full(live["shape"], fill, dtype=dtype)
    dst = np.empty_like(src)
    run_allreduce(ring, any_device(blobs) if ring.hierarchy else False, src, dst, code,
                  live["op"])  # the path the ranks with data take


def all_device(blobs) -> bool:
    """Whether every rank's header says it runs the operation on a device."""
    return all(parse(b)["device"] for b in blobs)


def any_device(blobs) -> bool:
    """Whether any rank's header says it runs the operation on a device."""
    return any(parse(b)["device"] for b in blobs)


def _rank_names(ring: Ring | None) -> list | None:
    """How errors name a ring's ranks: a process set's by world rank and
    rank in the set, the world's as they are (None)."""
    if ring is None or ring is _state.ring or not ring.owners:
        return None
    set_id = ring.owners[0].process_set_id
    return [f"world rank {w} (rank {i} of set {set_id})" for i, w in enumerate(ring.ranks)]


def exchange(head: bytes, data, fields, what, ring: Ring | None = None, beside_joined: bool = False):
    """The header pass that starts every operation (data rides along when
    small): returns every rank's blob (of ring's members; default the world).
    Under the ring's lock: the collectives hold it already; the engine's
    negotiation and process_sets' passes, which hold _state.lock, take it here.
    beside_joined: the caller is an allreduce that runs the ring next (agree)."""
    held = ring if ring is not None else _state.ring
    with held.lock if held is not None else contextlib.nullcontext():
        comm = _state.usable_comm() if ring is None or ring is _state.ring else ring.comm
        blobs = comm.exchange_blobs(head, data)
        while voided(blobs, ring):  # joined members' engines run it: again, with them
            blobs = comm.exchange_blobs(head, data)
    agree(blobs, head, fields, what, ring, beside_joined)
    return blobs


def all_inline(blobs) -> bool:
    """Whether every rank sent its data with its header: the path is decided
    from the agreed headers, never from one rank's own settings."""
    return all(parse(b)["inline"] for b in blobs)


def payloads(blobs, head_len):
    return [memoryview(b)[head_len:] for b in blobs]

