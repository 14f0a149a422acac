"""How the engine's ranks agree, each cycle, on which collectives run next.

Each cycle every rank sends one message in one header pass of the ring
(every rank then holds every rank's message):

    flags (u8: bit 0 = this rank has called join; bit 1 = a stall verdict
    follows; bit 3 = a fusion threshold follows; bit 4 = a cache capacity
    follows; bit 5 = a served count follows; bit 6 = an arrival report
    follows), n (u32),
    [with bit 3: this rank's fusion threshold (u64), sent when it differs
    from the one agreed: rank 0's holds on every rank, so all fuse alike]
    [with bit 4: this rank's response cache capacity (u32), sent in the first
    pass only: rank 0's holds on every rank, so every cache stays identical]
    [with bit 5: how many of the other ranks' direct allreduces this joined
    rank has served since it joined (u32; protocol.negotiation_pass):
    of ranks whose join is first seen in one cycle, the one that served
    fewest joined last]
    [with bit 6: this rank's arrival report for the last cycle that agreed
    to run something (u32 age, u32 period, u32 blocked, microseconds;
    ringreduce/engine/stragglers.py), sent in the next pass]
    n bytes: a bit per response-cache slot whose request is ready here,
    JSON: the full key of every ready request the cache does not hold (with a
    stall verdict: {"full": those keys, "stalled": [[process_set, name, why]]})

A key is what must be the same on every rank for a request to run:
(name, kind, dtype, shape, op, root, process_set); kinds whose ranks may
differ in dim 0 (allgather) carry -1 there. A request runs once every rank
that has not joined has it ready (the AND of the bit vectors, and the same
name in every rank's list); a request of a process set needs only the set's
members (the others never hold it, and negotiate on as usual: negotiation
always runs on the world's ring); requests that disagree fail on every rank,
the rest wait for a later cycle. A request that some ranks have had ready
for RINGREDUCE_TIMEOUT while others never submitted it (a rank built another
model, or skipped a collective) is a stall: rank 0, whose clock decides,
names it in its next message, and it fails on every rank with
MismatchError naming the ranks that have it and those that do not, instead
of waiting for ever (Horovod's stall inspector only warns). Every rank decides from the same messages with
the same code, so all decide alike; the cache (ringreduce/engine/response_cache.py)
then changes the same way everywhere: agreed requests are recorded in agreed
order, a name that failed loses its slot.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field

from ..core.communicator import communicator
from ..core import protocol as _protocol
from ..core.protocol import header, negotiation_pass
from ..errors import MismatchError
from .response_cache import ResponseCache
from . import stragglers as _stragglers

NEGOTIATE = _protocol.NEGOTIATE  # header kind of a negotiation pass (see protocol.KIND_NAMES)
_FLAGS = struct.Struct("<BI")
JOINED, STALL_VERDICT, LEFT, FUSION, CAPACITY, SERVED = _protocol.JOINED, 2, _protocol.LEFT, 8, 16, 32  # protocol
# reads JOINED and LEFT (a direct collective's pass that met joined ranks)
ARRIVAL = 64
_FUSION = struct.Struct("<Q")
_CAPACITY = struct.Struct("<I")

# Key fields, by position.
NAME, KIND, DTYPE, SHAPE, OP, ROOT, PROCESS_SET = range(7)


@dataclass
class Message:
    joined: bool
    bits: int  # bit s: the request in cache slot s is ready on this rank
    entries: dict  # (process_set, name) -> key, requests sent in full, in this rank's order
    stalled: list = field(default_factory=list)  # rank 0's stall verdict: [process_set, name, why]
    left: bool = False  # this rank is shutting down (Engine.leave): joined, and runs nothing more
    fusion: int | None = None  # this rank's fusion threshold, when it differs from the agreed one
    capacity: int | None = None  # this rank's response cache capacity, in the first pass
    served: int = 0  # direct allreduces this joined rank served since it joined
    arrival: tuple | None = None  # (age, period, blocked) in seconds, any None: stragglers.Tracker.agreed


@dataclass
class Agreement:
    run: list = field(default_factory=list)  # keys, in the order every rank runs them
    failed: list = field(default_factory=list)  # (key, message): fails on every rank holding it
    joined: list = field(default_factory=list)  # ranks that have called join, this cycle
    join_done: int | None = None  # every rank has joined and nothing is left: the last to join
    waiting: dict = field(default_factory=dict)  # (process_set, name) -> (ranks that have it, ranks that do not)
    left: list = field(default_factory=list)  # ranks shutting down (also in joined)
    # this joined rank's pass met the others' direct collective instead (protocol.negotiation_pass):
    # no negotiation took place, nothing changed; the engine asks again at once
    served: bool = False
    # rank -> seconds the others waited for it in the last cycle that agreed something (stragglers.py)
    lateness: dict | None = None


@dataclass
class Stats:
    """What negotiating cost this rank so far (the benchmark reads it)."""
    cycles: int = 0
    bytes_sent: int = 0  # this rank's share of the header pass: every blob but its next's, framed
    seconds: float = 0.0


def encode(keys: list, joined: bool, cache: ResponseCache, stalled: list = (), left: bool = False,
           fusion: int | None = None, capacity: int | None = None, served: int = 0,
           arrival: tuple | None = None) -> bytes:
    bits, full = 0, []
    for key in keys:
        slot = cache.slot(key)
        if slot is None:
            full.append([key[NAME], key[KIND], key[DTYPE], list(key[SHAPE]), key[OP], key[ROOT], key[PROCESS_SET]])
        else:
            bits |= 1 << slot
    vector = bits.to_bytes((bits.bit_length() + 7) // 8, "little")
    flags = (JOINED if joined or left else 0) | (STALL_VERDICT if stalled else 0) | (LEFT if left else 0) | (
        FUSION if fusion is not None else 0) | (CAPACITY if capacity is not None else 0) | (SERVED if served else 0) | (
        ARRIVAL if arrival is not None else 0)
    body = {"full": full, "stalled": list(stalled)} if stalled else full
    return (_FLAGS.pack(flags, len(vector)) + (_FUSION.pack(fusion) if fusion is not None else b"")
            + (_CAPACITY.pack(capacity) if capacity is not None else b"")
            + (_CAPACITY.pack(served) if served else b"")
            + (_stragglers.encode(arrival) if arrival is not None else b"") + vector
            + (json.dumps(body).encode() if body else b""))


def decode(blob) -> Message:
    flags, n = _FLAGS.unpack_from(blob)
    at = _FLAGS.size
    fusion = None
    if flags & FUSION:
        (fusion,), at = _FUSION.unpack_from(blob, at), at + _FUSION.size
    capacity = None
    if flags & CAPACITY:
        (capacity,), at = _CAPACITY.unpack_from(blob, at), at + _CAPACITY.size
    served = 0
    if flags & SERVED:
        (served,), at = _CAPACITY.unpack_from(blob, at), at + _CAPACITY.size
    arrival = None
    if flags & ARRIVAL:
        arrival, at = _stragglers.decode(blob, at), at + _stragglers.WIRE.size
    bits = int.from_bytes(bytes(blob[at:at + n]), "little")
    rest = bytes(blob[at + n:])
    body = json.loads(rest) if rest else []
    stalled = []
    if flags & STALL_VERDICT:
        body, stalled = body["full"], body["stalled"]
    entries = {}
    for e in body:
        key = (e[0], e[1], e[2], tuple(e[3]), e[4], e[5], e[6])
        entries[(key[PROCESS_SET], key[NAME])] = key
    return Message(bool(flags & JOINED), bits, entries, stalled, bool(flags & LEFT), fusion, capacity, served,
                   arrival)


def _set_bits(bits: int):
    slot = 0
    while bits:
        if bits & 1:
            yield slot
        bits >>= 1
        slot += 1


def describe(key) -> str:
    text = f"{key[KIND]} {key[DTYPE]} shape {_shape_text(key[SHAPE])}"
    if key[OP]:
        text += f" op {key[OP]}"
    if key[KIND] == "broadcast":
        text += f" root {key[ROOT]}"
    return text


def _whose(process_set: int, ranks) -> str:
    """Ranks as a message names them: negotiation numbers every rank as the
    world does, which a process set's request says (its set numbers them otherwise)."""
    listed = ", ".join(map(str, ranks))
    return f"world rank(s) {listed} (of process set {process_set})" if process_set else f"rank(s) {listed}"


def _shape_text(shape) -> str:
    if shape and shape[0] == -1:
        return "(*, " + ", ".join(map(str, shape[1:])) + ")" if len(shape) > 1 else "(*,)"
    return str(tuple(shape))


def agree(messages: list[Message], cache: ResponseCache, members=None) -> Agreement:
    """The decision every rank makes alike from every rank's message; then
    updates the cache alike. members(process_set) -> the world ranks of that
    set (default: every rank, the global set's); a set's request needs only
    its members, and only its members ever hold it."""
    everyone = list(range(len(messages)))
    members = members or (lambda ps: everyone)
    out = Agreement(joined=[r for r, m in enumerate(messages) if m.joined],
                    left=[r for r, m in enumerate(messages) if m.left])
    stalled = {(ps, name): why for ps, name, why in messages[0].stalled}

    def outcome(ps, have):
        """Whether a request of set ps held by the ranks `have` runs, and the
        members that hold it not: it runs when every member that has not
        joined holds it (when all have joined, any holder suffices)."""
        missing = [r for r in members(ps) if not messages[r].joined and r not in have]
        return not missing and bool(have), missing

    names = {}  # (process_set, name) of every request sent in full, first-seen order across ranks
    for m in messages:
        names.update(dict.fromkeys(m.entries))
    contested = set()  # cached slots of names some rank sent in full: decided by comparison below
    for ps, name in names:
        slot = cache.slot_for_name(ps, name)
        if slot is not None:
            contested.add(slot)
    some_bits = 0
    for m in messages:
        some_bits |= m.bits
    for slot in _set_bits(some_bits):  # cached requests, in slot order
        if slot in contested:
            continue
        key = cache.key(slot)
        have = [r for r, m in enumerate(messages) if m.bits >> slot & 1]
        runs, missing = outcome(key[PROCESS_SET], have)
        if runs:
            out.run.append(key)
        elif (key[PROCESS_SET], key[NAME]) in stalled:
            out.failed.append((key, stalled[(key[PROCESS_SET], key[NAME])]))
            cache.invalidate(key[PROCESS_SET], key[NAME])
        else:
            out.waiting[(key[PROCESS_SET], key[NAME])] = (have, missing)

    for ps, name in names:
        slot = cache.slot_for_name(ps, name)
        views = {}
        for r, m in enumerate(messages):
            key = m.entries.get((ps, name))
            if key is None and slot is not None and m.bits >> slot & 1:
                key = cache.key(slot)
            if key is not None:
                views[r] = key
        _, missing = outcome(ps, list(views))
        if missing:  # some member has not got there yet, or never will: rank 0 judges (Negotiator)
            if (ps, name) in stalled:
                out.failed.append((next(iter(views.values())), stalled[(ps, name)]))
                cache.invalidate(ps, name)
            else:
                out.waiting[(ps, name)] = (sorted(views), missing)
            continue
        first_rank, first = next(iter(views.items()))
        differing = [(r, k) for r, k in views.items() if k != first]
        if differing:
            rank = "world rank" if ps else "rank"  # see _whose
            text = ", ".join(f"{rank} {r} has {describe(k)}" for r, k in differing)
            where = f" of process set {ps}" if ps else ""
            out.failed.append((first, f"tensor {name!r}{where} differs between ranks: {rank} {first_rank} has "
                                      f"{describe(first)}, {text}"))
            cache.invalidate(ps, name)  # a changed request under a cached name: its slot goes everywhere
        else:
            out.run.append(first)

    if out.joined:
        kept = []
        for key in out.run:
            joined_here = [r for r in out.joined if r in members(key[PROCESS_SET])]
            left_here = [r for r in out.left if r in members(key[PROCESS_SET])]
            if left_here:  # a member has shut down: no zeros stand in for a rank that left
                where = "" if key[PROCESS_SET] else " of its process set"  # a set's: _whose names it
                out.failed.append((key, f"{key[KIND]} {key[NAME]!r} cannot run: "
                                        f"{_whose(key[PROCESS_SET], left_here)}{where} have shut down"))
            elif key[KIND] == "allreduce" or not joined_here:
                kept.append(key)
            else:
                out.failed.append((key, f"{key[KIND]} {key[NAME]!r} cannot run while "
                                        f"{_whose(key[PROCESS_SET], joined_here)} have joined (rr.join): "
                                        "until every rank has joined only allreduce goes on"))
        out.run = kept

    for key in out.run:
        cache.put(key)
    return out


class Negotiator:
    """One rank's side of negotiation: the cache, the join order, the cost."""

    def __init__(self, capacity: int, stall_seconds: float = float("inf"),
                 stragglers: _stragglers.Settings | None = None):
        """stragglers: the straggler report's settings (default: RINGREDUCE_STRAGGLER_*,
        ValueError for nonsense there)."""
        self.cache = ResponseCache(capacity)
        self.stragglers = _stragglers.Tracker(stragglers or _stragglers.Settings.from_env())
        self.stats = Stats()
        self._cycle = 0
        self._joined_at: dict[int, tuple] = {}  # rank -> (cycle its join was first seen, -passes it served then)
        self._served = 0  # the others' direct allreduces this rank served since it joined
        self.stall_seconds = stall_seconds
        self._waiting_since: dict[tuple, float] = {}  # (process_set, name) -> when first seen on some ranks only
        self._stalled: list = []  # rank 0's verdict, sent with its next message
        # The engine's fusion threshold, rank 0's: buckets cut at different sizes on different ranks
        # would pair one rank's fused buffer with another's of other tensors (RINGREDUCE_FUSION_THRESHOLD
        # set differently per rank). None until the first pass, where every rank sends its own.
        self.fusion: int | None = None

    def negotiate(self, keys: list, joined: bool, left: bool = False, fusion: int | None = None,
                  offered: list | None = None) -> Agreement:
        """fusion: this rank's fusion threshold now; self.fusion is rank 0's after the pass.
        offered: when each of keys was handed over (time.monotonic), for the
        straggler report; None: this rank sends no arrival reports."""
        t0 = time.perf_counter()
        first = self._cycle == 0  # every cache is empty yet: each rank says its capacity
        if not (joined or left):
            self._served = 0
        blob = encode(keys, joined, self.cache, self._stalled, left, fusion if fusion != self.fusion else None,
                      self.cache.capacity if first else None, min(self._served, 0xFFFFFFFF),
                      self.stragglers.outgoing())
        head = header(NEGOTIATE, 0, 0, (), "", 0, False)
        with communicator().lock:
            try:
                blobs = negotiation_pass(head, blob)
            except MismatchError:
                if joined and not keys:  # the others disagree among themselves: each of them raises, and
                    return Agreement(served=True)  # a joined rank with nothing of its own stays joined
                raise
            if blobs is None:
                self._served += 1
                return Agreement(served=True)
            done = time.monotonic()  # the pass ends at about this moment on every rank: ages compare
            me = communicator().world.rank
            # Sets are added and removed by passes of the world's ring, so every
            # rank holds the same registry at the same negotiation pass.
            sets = {ps: ring.ranks for ps, ring in communicator().sets.items()}
        messages = [decode(memoryview(b)[len(head):]) for b in blobs]
        self.stragglers.sent()
        if messages[0].fusion is not None:
            self.fusion = messages[0].fusion
        if first and messages[0].capacity is not None:  # rank 0's capacity (RINGREDUCE_CACHE_CAPACITY may
            # differ per rank): caches that evict differently would read one slot as different requests
            self.cache.capacity = messages[0].capacity
        everyone = list(range(len(messages)))
        out = agree(messages, self.cache, lambda ps: sets.get(ps, everyone) if ps else everyone)
        out.lateness = self.stragglers.observe([m.arrival for m in messages], me)
        if offered is not None and out.run:
            agreed = set(out.run)
            self.stragglers.agreed(done, [done - t for key, t in zip(keys, offered) if key in agreed])
        self._stalled = self._judge_stalls(out.waiting) if me == 0 else []
        self._cycle += 1
        for r in out.joined:
            self._joined_at.setdefault(r, (self._cycle, -messages[r].served))
        if len(out.joined) == len(messages) and not out.run and not out.failed and not any(
                m.bits or m.entries for m in messages):
            # the rank that joined last; ranks first seen in the same cycle: the one that served the fewest
            # direct allreduces (it joined after those), then the highest
            out.join_done = max(self._joined_at, key=lambda r: (self._joined_at[r], r))
            self._joined_at.clear()
            self._served = 0
        self.stats.cycles += 1
        self.stats.bytes_sent += sum(len(b) + 8 for b in blobs) - (len(blobs[(me + 1) % len(blobs)]) + 8)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _judge_stalls(self, waiting: dict) -> list:
        """Rank 0: requests some ranks have had ready for stall_seconds while
        the others never submitted them."""
        now = time.monotonic()
        self._waiting_since = {k: self._waiting_since.get(k, now) for k in waiting}
        verdict = []
        for (ps, name), since in self._waiting_since.items():
            if now - since >= self.stall_seconds:
                have, missing = waiting[(ps, name)]
                verdict.append([ps, name, (
                    f"tensor {name!r} was submitted by {_whose(ps, have)} but not by {_whose(ps, missing)} "
                    f"for {now - since:.0f} s (RINGREDUCE_TIMEOUT): do all ranks "
                    "build the same model and run the same collectives?")])
        for ps, name, _ in verdict:
            del self._waiting_since[(ps, name)]
        return verdict
