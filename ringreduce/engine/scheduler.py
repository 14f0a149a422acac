"""The background engine: collectives handed over one by one run on a thread
of their own, allreduces fused, while the caller goes on.

    h = engine().enqueue("dense/kernel", grad, op="avg")    # returns at once
    g = engine().enqueue("ids", ids, kind="allgather")      # any kind, any order
    reduced, rows = engine().wait(h), engine().wait(g)
    last = join()                                           # out of data (Horovod's hvd.join)

Ranks pair collectives BY NAME, so they may be issued in any order and from
several threads at once. Each cycle the ranks agree on what runs
(ringreduce/engine/negotiation.py, with its response cache): what is ready on every
rank runs, allreduces packed into fusion buffers of up to
RINGREDUCE_FUSION_THRESHOLD bytes (rank 0's, negotiated: every rank cuts
the same buckets), per dtype and op; the rest waits. A
request whose kind, dtype, shape, op or root differs between ranks fails on
every rank with MismatchError naming it and the ranks; the engine goes on.

compression=: a compressor of ringreduce.compression (PowerSGD, Int8,
TopK) reduces the allreduce lossily; its tag (name and parameters) is part
of the negotiated op, so ranks with different compressors fail with
MismatchError; compressed tensors with the same compressor fuse into
buckets of their own.

A rank that calls join() goes on negotiating with nothing of its own: it
adds zeros to every allreduce the others run, through their engines or
directly with rr.allreduce (protocol.negotiation_pass; on the rings of its
process sets, _serve_set), so avg still divides by every rank, as
Horovod's, until every rank has joined; then join() returns the rank that
joined last, on every rank.

Framework-free: the TensorFlow layer calls only enqueue, wait, withdraw,
refuse (a bad argument it found itself, so the other ranks fail at once
instead of waiting for it), join and start_timeline.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import core
from ..core import autotune as _autotune, flight_recorder
from ..core.arrays import DTYPES, HostArrays, arrays_for, op_code
from ..core import listeners as _listeners
from ..core.collectives import record_phases
from ..core.communicator import communicator
from ..core.process_sets import ring_of
from ..core.protocol import ALL_JOINED, STEPPED_ASIDE, mark_engine_thread, serve_beside_join
from ..core.config import Config
from ..errors import MismatchError, RingReduceError, WithdrawnError
from .negotiation import DTYPE, KIND, NAME, OP, PROCESS_SET, SHAPE, Negotiator
from .stragglers import Settings, Tracker, timeline_values
from .timeline import Timeline

GLOBAL_PROCESS_SET = 0  # process set ids: 0 the world, others ringreduce/core/process_sets.py's


@dataclass(frozen=True)
class Kind:
    """What the engine needs to know of a collective. run(handle) does it
    (None: the engine's fused allreduce); reduces: takes an op; rooted:
    takes a root; ragged: ranks may differ in dim 0."""
    run: Callable | None
    reduces: bool = False
    rooted: bool = False
    ragged: bool = False


KINDS: dict[str, Kind] = {}


def register_kind(name: str, run: Callable | None, *, reduces=False, rooted=False, ragged=False) -> None:
    """Lets engine().enqueue(..., kind=name) run `run(handle)`; handle.array,
    .op, .root, .name, .group (the ProcessSet, None for the world: pass it as
    process_set=) and .extra (enqueue's extra keywords) are there to use."""
    KINDS[name] = Kind(run, reduces, rooted, ragged)


# A request this rank refused (bad input): its key differs from every valid one (Engine._refuse).
REFUSED = "refused"
register_kind("allreduce", None, reduces=True)
register_kind("reduce_scatter", lambda h: core.reduce_scatter(h.array, op=h.op, name=h.name, process_set=h.group),
              reduces=True)
register_kind("allgather", lambda h: core.allgather(h.array, name=h.name, process_set=h.group), ragged=True)
register_kind("broadcast", lambda h: core.broadcast(h.array, root=h.root, name=h.name, process_set=h.group),
              rooted=True)
# rr.alltoall(x, splits, name) -> (received, received_splits)
register_kind("alltoall", lambda h: core.alltoall(h.array, h.extra.get("splits"), name=h.name, process_set=h.group),
              ragged=True)


@dataclass
class Handle:
    name: str
    array: object  # numpy or cupy
    kind: str
    op: str
    root: int
    process_set: int
    key: tuple  # what every rank must agree on (ringreduce/engine/negotiation.py)
    seq: int
    extra: dict = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    family: object = None  # how the collectives handle `array` (arrays.arrays_for)
    ready: object = None  # GPU arrays: an event after the caller's work on `array`
    stand_in: bool = False  # a joined rank's zeros: nobody waits for it
    group: object = None  # the ProcessSet the collective runs on; None: the world
    withdrawn: bool = False  # withdraw() was called: no later cycle offers it
    offered: float = field(default_factory=time.monotonic)  # handed over (the straggler report's clock)
    record: object = None  # its flight recorder entry (ringreduce/core/flight_recorder.py), None when off


IDLE_BACKOFF_MIN, IDLE_BACKOFF_MAX = 20e-6, 1e-3  # seconds between negotiation passes that agree on nothing


@dataclass(frozen=True)
class CycleStats:
    """The engine's working cycles (those that ran or failed some request):
    how many, their seconds in all (negotiation to the last result), the last one's."""
    cycles: int = 0
    seconds: float = 0.0
    last_seconds: float = 0.0


class Engine:
    def __init__(self, fusion_bytes: int | None = None, timeline_path: str | None = None,
                 cache_capacity: int | None = None):
        config = Config.from_env()
        self.fusion_bytes = fusion_bytes if fusion_bytes is not None else config.fusion_bytes
        # tuned at init (RINGREDUCE_AUTOTUNE=1) and no threshold given: tried from the cycles it runs, unless
        # rank 0 set one, which then holds on every rank (ringreduce/core/autotune.py): decided alike everywhere,
        # as the tuner's window allreduces must be, whatever this rank's environment says now
        self._fusion_tuner = None
        tuned = core.communicator().world.extra.get("autotune") if core.is_initialized() else None
        if fusion_bytes is None and tuned is not None:
            if tuned.get("fusion_bytes") is not None:
                self.fusion_bytes = tuned["fusion_bytes"]
            else:
                self._fusion_tuner = _autotune.FusionTuner()
                self.fusion_bytes = self._fusion_tuner.current
        self.negotiator = Negotiator(cache_capacity if cache_capacity is not None else config.cache_capacity,
                                     stall_seconds=config.timeout or float("inf"))
        self.timeline = Timeline(timeline_path or os.environ.get("RINGREDUCE_TIMELINE"))
        self._pending: dict[tuple, Handle] = {}  # (process_set, name) -> handle
        self._cond = threading.Condition()
        self._seq = 0
        self._error: BaseException | None = None
        self._stop = False
        self._joining: threading.Event | None = None  # set while this rank has joined
        self._last_joined: int | None = None
        self._join_error: BaseException | None = None  # why the last join() failed, the engine going on
        self._serving_stopped = False  # a failed join() ends its serving passes (_stop_serving)
        self._leaving = False  # leave() was called: this rank is shutting down
        # Some rank's request waited at the last pass (a process set's, say, whose
        # members are still coming): negotiate on with nothing of our own, as the
        # world's ring needs every rank in every pass.
        self._others_waiting = False
        self._idle_cycles = 0  # negotiation passes in a row that agreed on nothing
        # The requests the engine's thread is negotiating or running now, and an
        # event set when that cycle is over: withdraw() cannot take back a
        # request other ranks may be agreeing to run this very cycle.
        self._in_cycle: set[int] = set()
        self._cycle_over = threading.Event()
        self._stand_in_compressors: dict = {}  # compressor tag -> what a joined rank reduces its zeros with
        # While this rank has joined, a thread per process set it is a member of serves the set's ring
        # (_serve_set); _set_runs counts, per set, the cycles whose stand-ins this engine ran on it.
        self._set_cond = threading.Condition()
        self._set_runs: dict[int, int] = {}
        self._cycle_stats = CycleStats()
        self._thread = threading.Thread(target=self._loop, name="ringreduce-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self):
        """Negotiation cost so far: cycles, bytes_sent, seconds."""
        return self.negotiator.stats

    @property
    def cycle_stats(self) -> CycleStats:
        """The working cycles so far (replaced whole after each: read without waiting on the engine)."""
        return self._cycle_stats

    def queue_depth(self) -> int:
        """Requests handed over on this rank and not done yet: waiting for the
        other ranks, or running now."""
        with self._cond:
            return len(self._pending)

    # -- the caller's side -------------------------------------------------

    def enqueue(self, name: str, array, op: str = "avg", kind: str = "allreduce", root: int = 0,
                process_set=None, compression=None, **extra) -> Handle:
        """array: numpy, or a GPU array (cupy), reduced on its device. Returns
        at once; wait(handle) gives the result. process_set: a registered
        ProcessSet this rank belongs to, or its id (None or 0: the world);
        the request then waits for the set's members only and runs on the
        set's ring; root is a world rank, a member. extra: keywords a kind
        needs (alltoall: splits). op stays third, where callers of the
        allreduce-only engine passed it. compression: a
        ringreduce.compression compressor (allreduce of host floats, sum or
        avg, only), None for exact; compression_key= (in extra) names its
        state (error feedback, warm start) when the name changes every step."""
        spec = KINDS.get(kind)
        if spec is None:
            raise ValueError(f"unknown collective kind {kind!r}; the engine runs {', '.join(KINDS)}")
        if not isinstance(name, str) or not name:
            raise ValueError("every collective in the engine needs a name, the same on every rank")
        group, process_set = _resolve(process_set)
        try:
            return self._enqueue(name, array, op, kind, spec, root, group, process_set, compression, extra)
        except (TypeError, ValueError) as exc:
            self._refuse(name, kind, process_set, group, exc)
            raise

    def refuse(self, name: str, problem: Exception, kind: str = "allreduce", process_set=None) -> None:
        """For a caller that found this rank's input to collective `name` bad
        before enqueueing it: the others' request of that name fails on
        every rank with MismatchError naming this rank (and the problem), at
        once, instead of waiting RINGREDUCE_TIMEOUT. process_set as
        enqueue's. Returns once negotiated; the caller then raises."""
        group, set_id = _resolve(process_set)
        self._refuse(name, kind, set_id, group, problem)

    def _refuse(self, name, kind, process_set, group, problem) -> None:
        """This rank's bad input still meets the others' request of that name,
        as a refusal that differs from theirs: negotiation fails it on every
        rank at once, naming this one (collectives.refuse is the same for
        the direct calls), instead of their waiting RINGREDUCE_TIMEOUT. Returns
        once negotiated, so the name is free again when the caller raises."""
        key = (name, kind, f"(bad input: {problem})"[:300], (), "", 0, process_set)
        with self._cond:
            if self._error is not None or (process_set, name) in self._pending:
                return
            self._seq += 1
            h = Handle(name, np.zeros(0), REFUSED, "", 0, process_set, key, self._seq, family=HostArrays,
                       group=group)
            self._pending[(process_set, name)] = h
            self._cond.notify()
        h.done.wait()

    def _enqueue(self, name, array, op, kind, spec, root, group, process_set, compression, extra) -> Handle:
        family, array = arrays_for(array, reduces=spec.reduces)
        with family.on(array):
            array = family.xp.ascontiguousarray(array).reshape(array.shape)  # a 0-d array stays 0-d
        if spec.ragged and array.ndim == 0:
            array = array.reshape(1)
        if spec.reduces:
            op_code(op)
        else:
            op = ""
        if spec.rooted:
            size = core.size()
            if not (isinstance(root, (int, np.integer)) and 0 <= root < size):
                raise ValueError(f"root {root!r} is not a rank of this world of {size}")
            if group is not None and root not in group.ranks:
                raise ValueError(f"root {root} is not a member of {group}")
            root = int(root)
        else:
            root = 0
        shape = ((-1,) + tuple(array.shape[1:])) if spec.ragged else tuple(array.shape)
        wire_op = op
        if compression is not None:
            _check_compressible(name, kind, op, family, array)
            # negotiated: every rank must compress alike (and a joined rank's stand-in follows the tag)
            from ..compression import check_rebuildable  # lazily, as _stand_in_compressor's from_tag
            tag = compression.wire_tag(group, extra.get("compression_key", name), array.shape)
            check_rebuildable(compression, tag)  # a joined rank must make it from the tag: refused here if not
            wire_op = f"{op}|{tag}"
            extra["compression"] = compression
        key = (name, kind, array.dtype.name, shape, wire_op, root, process_set)
        ready = family.mark(array)  # the engine's thread reads array after the caller's stream wrote it
        with self._cond:
            if self._error is not None:
                raise self._stopped_error()
            if (process_set, name) in self._pending:
                raise ValueError(f"tensor {name!r} is already in flight")
            self._seq += 1
            h = Handle(name, array, kind, op, root, process_set, key, self._seq, extra,
                       family=family, ready=ready, group=group)
            self._pending[(process_set, name)] = h
            h.record = flight_recorder.enqueued(kind, name, array.nbytes, array.dtype, op, process_set)
            self.timeline.begin(name, "QUEUE")
            self._cond.notify()
        return h

    def wait(self, h: Handle):
        self.timeline.begin(h.name, "WAIT")
        with self.negotiator.stragglers.blocking():  # this rank's idle time (the straggler report's score)
            h.done.wait()
        self.timeline.end(h.name, "WAIT")
        if h.error is not None:
            raise h.error
        return h.result

    def start_timeline(self, path: str | None, mark_cycles: bool = False) -> None:
        """Writes the timeline to path from now on (None: stops it)."""
        old, self.timeline = self.timeline, Timeline(path, mark_cycles, rank=core.rank())
        old.close()

    def withdraw(self, h: Handle) -> None:
        """Takes back a request whose result nobody will read (its step
        failed): one not yet agreed leaves the queue, its wait() raising
        WithdrawnError; one agreed or running is waited out and its result
        dropped. Either way its name is free again at once. Every rank that
        handed it over must withdraw it too (a failed step fails on every
        rank alike): a rank that kept it would stall on it."""
        while True:
            with self._cond:
                h.withdrawn = True
                if h.done.is_set():
                    return
                if id(h) not in self._in_cycle:
                    if self._pending.get((h.process_set, h.name)) is h:
                        del self._pending[(h.process_set, h.name)]
                    h.error = WithdrawnError(f"tensor {h.name!r} was withdrawn before it ran")
                    flight_recorder.fail([h.record], h.error, dump_now=False)
                    self.timeline.end(h.name, "QUEUE")
                    h.done.set()
                    return
                over = self._cycle_over
            over.wait()

    def join(self) -> int:
        """This rank has no more data: until every rank has joined, it adds
        zeros to the allreduces of the others. Returns, on every rank once
        all have joined, the rank that joined last."""
        with self._cond:
            if self._error is not None:
                raise self._stopped_error()
            if self._joining is not None:
                raise RuntimeError("join() is already waiting on this rank")
            done = self._joining = threading.Event()
            servers = self._serve_sets()  # before this rank's first pass as a joined one
            self._cond.notify()
        done.wait()
        with self._cond:
            error = None
            if self._error is not None:
                error = self._stopped_error()
            elif self._join_error is not None:
                error, self._join_error = self._join_error, None
        if error is not None:
            self._stop_serving(servers)
            raise error
        for t, _ in servers:  # every member has joined too: their serving passes meet, and each ends
            t.join()
        return self._last_joined

    def _stopped_error(self) -> RingReduceError:
        """What a call after the engine stopped raises: the error that stopped
        it, again (a PeerLostError still names the lost rank, in .rank and
        in its text), of the same class where that is ringreduce's own."""
        first = self._error
        text = f"the engine stopped after an earlier error: {type(first).__name__}: {first}"
        rank = getattr(first, "rank", None)
        if isinstance(first, RingReduceError):
            try:
                return type(first)(text, rank)
            except TypeError:  # a subclass made otherwise
                pass
        return RingReduceError(text, rank)

    def _stop_serving(self, servers: list) -> None:
        """A join() that failed: this rank no longer stands in on its process
        sets. A serving pass still waiting on a set's ring would otherwise
        answer the members' next collective there with zeros, as if this rank
        were still joined (and hold the ring from this rank's own calls), so
        that ring is interrupted: the pass ends, the members' collective on
        the set fails naming this rank, and so does every later one on it
        here (remove the set and add it again to go on with it)."""
        with self._set_cond:
            self._serving_stopped = True
            self._set_cond.notify_all()
        for t, ring in servers:
            if t.is_alive():
                ring.comm.interrupt()
        for t, _ in servers:
            t.join(timeout=10)
        with self._set_cond:
            self._serving_stopped = False

    def _serve_sets(self) -> list:
        """A joined rank's presence on the rings of its process sets: a
        direct collective of the members with data on such a set meets it
        there (core.protocol.serve_beside_join), as one on the world's ring
        meets this rank's negotiation: an allreduce goes on with this rank's
        zeros, anything else raises on its callers, and no caller waits for
        a rank that will never come."""
        comm = communicator()
        timeout, left = comm.world.config.ring_timeout, self._leaving
        servers = []
        for set_id, ring in list(comm.sets.items()):
            if ring.comm is not None and ring.rank >= 0 and ring.size > 1:
                t = threading.Thread(target=self._serve_set, args=(set_id, ring, timeout, left),
                                     name=f"ringreduce-joined-set{set_id}", daemon=True)
                t.start()
                servers.append((t, ring))
        return servers

    def _serve_set(self, set_id: int, ring, timeout: float, left: bool) -> None:
        """Serving passes on one set's ring until every member's meet
        (all have joined). A pass the engine's collective met (STEPPED_ASIDE)
        leaves the ring to this rank's engine until it has run that cycle's
        stand-ins on the set: the members with data run the pass again with it."""
        try:
            while True:
                with self._set_cond:
                    seen = self._set_runs.get(set_id, 0)
                outcome = serve_beside_join(ring, timeout, left)
                if outcome == ALL_JOINED:
                    return
                if outcome == STEPPED_ASIDE:
                    with self._set_cond:
                        while (self._set_runs.get(set_id, 0) <= seen and self._error is None and not self._stop
                               and not self._serving_stopped):
                            self._set_cond.wait()
                        if self._error is not None or self._stop or self._serving_stopped:
                            return
        except RingReduceError:
            return  # the set's ring is lost or closed: its members' own calls say why

    def leave(self) -> None:
        """This rank is shutting down (Horovod's shutdown): as join(), it
        negotiates on with nothing of its own until every rank has joined or
        left, so the others' process sets it is not a member of go on without
        it. Unlike join(), no zeros stand in for it: a collective whose set
        holds it fails, on every rank, naming it. A lost peer ends it too."""
        self._leaving = True
        try:
            self.join()
        except RingReduceError:
            pass  # a peer is gone or the engine stopped: nothing left to leave cleanly
        finally:
            self._leaving = False

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        with self._set_cond:
            self._set_cond.notify_all()
        self._thread.join(timeout=5)
        self.timeline.close()
        self.negotiator.stragglers.write()  # rank 0, into RINGREDUCE_REPORT_DIR (ringrun prints it)

    def straggler_report(self) -> dict:
        """Which rank the others wait for (ringreduce/engine/stragglers.py):
        per rank over the last RINGREDUCE_STRAGGLER_WINDOW cycles, the
        fraction it arrived last, its median and p90 lateness, its score."""
        return self.negotiator.stragglers.report()

    # -- the engine's side ---------------------------------------------------

    def _loop(self) -> None:
        mark_engine_thread()
        while True:
            with self._cond:
                while not self._pending and self._joining is None and not self._stop and not self._others_waiting:
                    self._cond.wait()
                if self._stop:
                    return
                ready = sorted((h for h in self._pending.values() if not h.withdrawn), key=lambda h: h.seq)
                joined = self._joining is not None
                self._in_cycle = {id(h) for h in ready}
                self._cycle_over = threading.Event()
            try:
                self._cycle(ready, joined)
                self._end_cycle()
            except BaseException as exc:  # every waiter learns, on every rank
                _listeners.report("engine", None, exc)  # a lost peer met in negotiation, too (ringreduce.metrics)
                with self._cond:
                    self._end_cycle()
                    self._error = exc
                    flight_recorder.fail([h.record for h in self._pending.values()], exc)
                    for h in self._pending.values():
                        h.error = exc
                        h.done.set()
                    self._pending.clear()
                    if self._joining is not None:
                        self._joining.set()
                with self._set_cond:
                    self._set_cond.notify_all()
                return

    def _end_cycle(self) -> None:
        with self._cond:
            self._in_cycle = set()
            self._cycle_over.set()

    def _cycle(self, ready: list[Handle], joined: bool) -> None:
        started = time.perf_counter()
        try:
            agreement = self.negotiator.negotiate([h.key for h in ready], joined, self._leaving, self.fusion_bytes,
                                                  [h.offered for h in ready])
        except MismatchError as exc:  # a rank ran a collective outside the engine: no data moved
            self._fail_waiting(MismatchError(f"the engine's negotiation met another collective: {exc}"))
            return
        self._others_waiting = bool(agreement.waiting)  # the same on every rank: all stop cycling alike
        if agreement.lateness:
            self.timeline.counter("lateness (ms)", timeline_values(agreement.lateness))
        for key, problem in agreement.failed:  # fails this request on every rank; the engine goes on
            with self._cond:
                h = self._pending.pop((key[PROCESS_SET], key[NAME]), None)
            if h is not None:
                h.error = MismatchError(problem)
                flight_recorder.fail([h.record], h.error, dump_now=False)
                self.timeline.end(h.name, "QUEUE")
                h.done.set()
        if agreement.failed:  # a stall or a mismatch: one dump for the cycle
            flight_recorder.dump(reason=f"MismatchError: {agreement.failed[0][1]}")
        me = core.rank()
        with self._cond:  # every rank runs, in agreed order, what it is a member of
            handles = []
            for k in agreement.run:
                h = self._pending.get((k[PROCESS_SET], k[NAME]))
                # only what this rank offered in this pass: one handed over since (a joined rank's, from
                # another thread) was never negotiated, its shape or data not what the others agreed to
                if h is not None and id(h) in self._in_cycle:
                    handles.append(h)
                elif _member(k[PROCESS_SET], me):
                    handles.append(_stand_in(k))
        if handles:
            self.timeline.cycle(len(handles))
        reductions = [h for h in handles if h.kind == "allreduce"]
        if self.negotiator.fusion is not None:  # rank 0's threshold: every rank cuts the same buckets
            self.fusion_bytes = self.negotiator.fusion
        if self._fusion_tuner is not None and agreement.run:  # a working cycle: the same ones on every rank
            self.fusion_bytes = self._fusion_tuner.on_cycle(sum(h.array.nbytes for h in reductions))
        for bucket in self._buckets(reductions):
            self._run(bucket)
        for h in handles:
            if h.kind != "allreduce":
                self._run_one(h)
        ran_on = {h.process_set for h in handles if h.process_set}
        if ran_on:  # a joined member's serving pass that stepped aside for these goes on (_serve_set)
            with self._set_cond:
                for set_id in ran_on:
                    self._set_runs[set_id] = self._set_runs.get(set_id, 0) + 1
                self._set_cond.notify_all()
        if agreement.join_done is not None:
            with self._cond:
                self._last_joined = agreement.join_done
                done, self._joining = self._joining, None
            done.set()
        elif not handles and not agreement.failed and not agreement.served:
            # Some rank is still computing: ask again shortly, backing off from
            # a yield to a millisecond (an eager op's partner is often only
            # microseconds late; a rank still in backprop may be seconds away).
            time.sleep(min(IDLE_BACKOFF_MAX, IDLE_BACKOFF_MIN * 2 ** self._idle_cycles))
            self._idle_cycles = min(self._idle_cycles + 1, 10)  # 20 us * 2**10 > 1 ms: no further
            return
        self._idle_cycles = 0
        took = time.perf_counter() - started
        self._cycle_stats = CycleStats(self._cycle_stats.cycles + 1, self._cycle_stats.seconds + took, took)

    def _fail_waiting(self, exc: BaseException) -> None:
        with self._cond:
            flight_recorder.fail([h.record for h in self._pending.values()], exc)
            for h in self._pending.values():
                h.error = exc
                h.done.set()
            self._pending.clear()
            if self._joining is not None:
                self._join_error = exc
                self._joining.set()
                self._joining = None

    def _buckets(self, handles: list[Handle]):
        """Per dtype, op and process set (in agreed order), up to the fusion threshold."""
        groups: dict[tuple, list[Handle]] = {}
        for h in handles:
            groups.setdefault((h.key[DTYPE], h.key[OP], h.process_set), []).append(h)
        for group in groups.values():  # the op's text holds the compressor's tag: compressed tensors fuse apart
            bucket, size = [], 0
            for h in group:
                if bucket and size + h.array.nbytes > self.fusion_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append(h)
                size += h.array.nbytes
            if bucket:
                yield bucket

    def _run(self, bucket: list[Handle]) -> None:
        for h in bucket:
            self.timeline.end(h.name, "QUEUE")
        if "|" in bucket[0].key[OP]:
            return self._run_compressed(bucket)
        families = [h.family for h in bucket]
        for f, h in zip(families, bucket):
            f.wait(h.ready)
        mixed = any(f is not families[0] for f in families)
        with families[0].on(bucket[0].array):
            if len(bucket) == 1:
                flat = bucket[0].array.reshape(-1)
            elif mixed:  # host and GPU tensors in one bucket (buckets must match across ranks): fuse on the host
                flat = np.concatenate([f.to_host(h.array).reshape(-1) for f, h in zip(families, bucket)])
            else:
                flat = families[0].xp.concatenate([h.array.reshape(-1) for h in bucket])
            label = bucket[0].name if len(bucket) == 1 else f"fused {len(bucket)} tensors"
            t0 = time.monotonic()
            # phases: none when the one-pass small algorithm ran
            with record_phases() as phases, flight_recorder.running([h.record for h in bucket]):
                result = core.allreduce(flat, op=bucket[0].op, process_set=bucket[0].group)
        self.timeline.ring_op([h.name for h in bucket], label, flat.nbytes, t0, time.monotonic(), phases)
        if self.timeline.path:  # bytes this rank has sent on this ring so far (ringreduce/core/traffic.py)
            self.timeline.counter("bytes sent", dict(zip(("ring", "blobs", "alltoall"),
                                                        ring_of(bucket[0].group).comm.bytes())))
        at = 0
        with self._cond:
            for f, h in zip(families, bucket):
                n = h.array.size
                h.result = result[at:at + n].reshape(h.array.shape)
                if mixed:
                    h.result = f.from_host(h.result, like=h.array)
                at += n
                self._finish(h)

    def _run_compressed(self, bucket: list[Handle]) -> None:
        """One bucket through a compressor of its tag, each tensor in its
        caller's compressor's state (error feedback, warm starts), or on a
        joined rank a stand-in's fresh one."""
        tag = bucket[0].key[OP].partition("|")[2]
        # A compressor made from the negotiated tag runs the bucket on every rank, each tensor kept in its
        # owner's state: an owner's own parameters may differ from the tag's (PowerSGD past its warm-up is
        # negotiated as warmup_steps=0), and two models' compressors of one tag fuse; a joined rank's
        # stand-ins keep theirs in its fresh state (never its own compressor's: that tensor's error feedback
        # would go out instead of zeros).
        compressor = self._stand_in_compressor(tag)
        t0 = time.monotonic()
        # phases: of each ring allreduce the compressor runs (top-k's gather: none)
        with record_phases() as phases, flight_recorder.running([h.record for h in bucket]):
            results = compressor.reduce_bucket([h.name for h in bucket], [h.array for h in bucket], bucket[0].op,
                                               bucket[0].group,
                                               [h.extra.get("compression_key", h.name) for h in bucket],
                                               [h.extra.get("compression", compressor) for h in bucket])  # whose state
        label = f"{tag} " + (bucket[0].name if len(bucket) == 1 else f"fused {len(bucket)} tensors")
        self.timeline.ring_op([h.name for h in bucket], label, sum(h.array.nbytes for h in bucket), t0,
                              time.monotonic(), phases)
        with self._cond:
            for h, r in zip(bucket, results):
                h.result = r
                self._finish(h)

    def _stand_in_compressor(self, tag: str):
        """Fresh state every time: a joined rank adds exact zeros, with no
        error feedback or step count of its own (the tag says the path)."""
        from ..compression import from_tag
        if tag not in self._stand_in_compressors:
            self._stand_in_compressors[tag] = from_tag(tag)
        compressor = self._stand_in_compressors[tag]
        compressor.reset()
        return compressor

    def _run_one(self, h: Handle) -> None:
        self.timeline.end(h.name, "QUEUE")
        h.family.wait(h.ready)
        try:
            if h.kind != REFUSED:  # every rank refused it alike: nothing to run, nobody waits
                with h.family.on(h.array), flight_recorder.running([h.record]):
                    h.result = KINDS[h.kind].run(h)
        except MismatchError as exc:  # the collective's own header check: the ring stays usable
            h.error = exc
        with self._cond:
            self._finish(h)

    def _finish(self, h: Handle) -> None:
        if not h.stand_in:
            del self._pending[(h.process_set, h.name)]
        h.done.set()


_NUMPY_DTYPES = {str(d): d for d in DTYPES}


def _stand_in(key: tuple) -> Handle:
    """What a joined rank adds to an allreduce it has no tensor for: zeros
    for sum and avg (Horovod's join), the op's identity for the others, so
    min, max and prod are those of the ranks that have data. A request every
    member refused (Engine._refuse: its dtype field holds the problem) has
    nothing to stand in for: nothing runs."""
    if key[DTYPE] not in _NUMPY_DTYPES:
        return Handle(key[NAME], np.zeros(0), REFUSED, "", 0, key[PROCESS_SET], key, 0, family=HostArrays,
                      stand_in=True, group=_set_of(key[PROCESS_SET]))
    dtype, op = _NUMPY_DTYPES[key[DTYPE]], key[OP].partition("|")[0]  # a compressor's tag after the |
    if op == "prod":
        fill = 1
    elif op in ("min", "max"):
        if dtype.kind == "f" or key[DTYPE] == "bfloat16":
            fill = np.inf if op == "min" else -np.inf
        else:
            info = np.iinfo(dtype)
            fill = info.max if op == "min" else info.min
    else:
        fill = 0
    array = np.full(key[SHAPE], fill, dtype=dtype)
    return Handle(key[NAME], array, key[KIND], op, 0, key[PROCESS_SET], key, 0,
                  family=HostArrays, stand_in=True, group=_set_of(key[PROCESS_SET]))


def _check_compressible(name, kind, op, family, array) -> None:
    if kind != "allreduce" or op not in ("sum", "avg"):
        raise ValueError(f"compression= applies to allreduce with op sum or avg; {name!r} is {kind} op {op!r}")
    if family is not HostArrays or array.dtype.kind != "f":
        raise TypeError(f"compression= takes host (numpy) floating-point tensors; {name!r} is "
                        f"{type(array).__name__} of {array.dtype}")


def _resolve(process_set):
    """(ProcessSet or None for the world, its id) for enqueue's process_set=:
    ValueError/TypeError at once for a set that is not registered, or that
    this rank is not a member of."""
    if process_set is None:
        return None, GLOBAL_PROCESS_SET
    if isinstance(process_set, (int, np.integer)):
        process_set = _set_of(int(process_set))
        if process_set is None:
            return None, GLOBAL_PROCESS_SET
    elif getattr(process_set, "process_set_id", None) == GLOBAL_PROCESS_SET:
        return None, GLOBAL_PROCESS_SET
    ring_of(process_set)  # raises for an unknown set or a non-member
    return process_set, process_set.process_set_id


def _set_of(set_id: int):
    """The registered ProcessSet with this id (None: the world's)."""
    if set_id == GLOBAL_PROCESS_SET:
        return None
    ring = core.communicator().set_ring(set_id)
    if ring is None or not ring.owners:
        raise ValueError(f"process set {set_id} is not registered: call add_process_set on every rank first")
    return ring.owners[0]


def _member(set_id: int, rank: int) -> bool:
    if set_id == GLOBAL_PROCESS_SET:
        return True
    ring = core.communicator().set_ring(set_id)
    return ring is not None and rank in ring.ranks


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The process's engine, started on first use (after ringreduce.init())."""
    global _engine
    with _engine_lock:
        if _engine is None or not _engine._thread.is_alive():
            _engine = Engine()
        return _engine


def running() -> Engine | None:
    """The process's engine if one was started (and not reset), else None:
    engine() would start one, this never does."""
    return _engine


def reset() -> None:
    """Drops the process's engine (ringreduce.elastic, when the ring is
    re-formed): its thread is stopped and joined, whatever still waits fails
    with RingReduceError, and the next engine() starts a fresh one, its
    response cache empty on every rank of the new world alike. Call it after
    collectives.shutdown(), which interrupts a collective the thread is in."""
    global _engine
    with _engine_lock:
        old, _engine = _engine, None
    if old is not None:
        old.shutdown()
        old._fail_waiting(RingReduceError("the ring was reset (elastic): this collective was dropped"))


def straggler_report() -> dict:
    """The process's engine's straggler report (Engine.straggler_report;
    docs/api.md): {"cycles", "window", "threshold", "stragglers", "ranks":
    [{"rank", "cycles", "last_fraction", "median_lateness", "p90_lateness",
    "score"}, ...]}; lateness in seconds. Empty ranks before the engine ran
    anything (this call never starts one)."""
    eng = running()
    return eng.straggler_report() if eng is not None else Tracker(Settings.from_env()).report()


def join() -> int:
    """Horovod's hvd.join(): call it when this rank has run out of data. Until
    every rank has joined, allreduces the others issue, through the engine or
    directly (rr.allreduce), complete with this rank adding zeros (avg still
    divides by every rank); other collectives raise MismatchError on the
    ranks that issue them. Returns, on every rank, the rank that joined last."""
    # else a fresh engine fails to start: "stopped after an earlier error", misleading
    core.communicator().require_world()
    return engine().join()
