"""The header pass that starts every operation, and the agreement it checks.

Every operation starts with one ring pass of small blobs (rr_exchange_blobs):
each rank's header, and for small tensors (Config.small_limit) the data itself.
Every rank then holds every header, so a disagreement raises MismatchError on
all of them alike. Small allreduces finish right there, reducing the blobs in
rank order (N-1 hops instead of the ring's 3(N-1)); large ones run the ring.
Over MPI both passes run by recursive doubling instead (log2 N rounds, the
small allreduce reducing as it goes: csrc/recursive_doubling.c).
When every rank shares one host the pass is no ring at all: the blobs meet in
a shared arena (csrc/host_arena.h), each written once and read in place.
"""
from __future__ import annotations

import contextlib
import functools
import struct

from ..errors import MismatchError, RingReduceError, StaleGenerationError
from .arrays import DTYPE_NAMES, OP_NAMES
from .communicator import Ring, current as _state


ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, BARRIER = range(5)
ALLTOALL = 6  # 5 is the engine's negotiation
KIND_NAMES = ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "engine negotiation", "alltoall"]

# magic, generation, kind, op, dtype code, inline?, root, ndim, name length,
# dtype descriptor length, number of splits; then shape, splits (int64 each),
# name, descriptor. The descriptor (str of the numpy dtype) lets ranks catch a
# dtype mismatch on ops that only move bytes, whose dtypes have no code. The
# generation (0 outside elastic jobs; ringreduce/launch/rendezvous_server.py) keeps an
# operation of an old ring from ever pairing with one of the new.
HEAD = struct.Struct("<4sIBBBBiIIHI")
MAGIC = b"RRH3"


def header(kind, op, dtype, shape, name, root=0, inline=False, descr=None, splits=(), device=False) -> bytes:
    """descr: the numpy dtype; None takes the name of code `dtype`. device: this
    rank runs the operation on a device (the inline byte's bit 1, see byte_order)."""
    return _header_of(_state.generation, kind, op, dtype, shape, name, root, int(inline) | (2 if device else 0),
                      descr, splits)


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
            "payload": memoryview(blob)[at + dlen:]}


@contextlib.contextmanager
def byte_order(comm, blobs):
    """The ring operation inside runs on every rank in one byte order. The
    zero-copy path (csrc/ring.c ring_steps_zero_copy) sends slice-major, the
    staged device path step-major: when any rank's header says it runs on a
    device, every rank takes the copying path this once (decided from the
    agreed headers, alike everywhere)."""
    if not comm.zero_copy or not any(parse(b)["device"] for b in blobs):
        yield
        return
    comm.set_zero_copy(False)
    try:
        yield
    finally:
        comm.set_zero_copy(True)


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


def agree(blobs, head: bytes, fields, what, ring: Ring | None = None) -> None:
    """Raises MismatchError when ranks disagree on a field, on every rank
    alike (all hold the same blobs). Headers that differ only in the inline
    flag (RINGREDUCE_SMALL_BYTES differs between ranks) agree: the caller
    then takes the ring, as every rank does. The communicator stays usable:
    no data has moved."""
    if "trailing" in fields or any(b[:len(head)] != head for b in blobs):
        check_agreement([parse(b) for b in blobs], fields, what, _rank_names(ring))


def _rank_names(ring: Ring | None) -> list | None:
    """How errors name a ring's ranks: a process set's by world rank and
    rank in the set, the world's as they are (None)."""
    if ring is None or ring is _state.ring or not ring.owners:
        return None
    set_id = ring.owners[0].process_set_id
    return [f"world rank {w} (rank {i} of set {set_id})" for i, w in enumerate(ring.ranks)]


def exchange(head: bytes, data, fields, what, ring: Ring | None = None):
    """The header pass that starts every operation (data rides along when
    small): returns every rank's blob (of ring's members; default the world).
    Under the ring's lock: the collectives hold it already; the engine's
    negotiation and process_sets' passes, which hold _state.lock, take it here."""
    held = ring if ring is not None else _state.ring
    with held.lock if held is not None else contextlib.nullcontext():
        blobs = (_state.usable_comm() if ring is None or ring is _state.ring else ring.comm).exchange_blobs(head, data)
    agree(blobs, head, fields, what, ring)
    return blobs


def all_inline(blobs) -> bool:
    """Whether every rank sent its data with its header: the path is decided
    from the agreed headers, never from one rank's own settings."""
    return all(parse(b)["inline"] for b in blobs)


def payloads(blobs, head_len):
    return [memoryview(b)[head_len:] for b in blobs]

