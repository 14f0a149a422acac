"""The background engine: tensors handed over one by one travel in fused
ring allreduces on a thread of their own, while the caller goes on.

    h = engine().enqueue("dense/kernel", grad, op="avg")    # returns at once
    ...                                                     # more backprop
    reduced = engine().wait(h)

Ranks must agree on what goes next even when their tensors become ready in
different orders. The engine negotiates, as Horovod's coordinator does: each
cycle every rank sends the names (with dtype and shape) of the tensors it has
ready, in one ring pass of the header exchange; the tensors ready on every
rank go, in rank 0's order, packed into fusion buffers of up to
RINGREDUCE_FUSION_THRESHOLD bytes (one ring op for many small tensors); the
rest wait for a later cycle. A tensor whose dtype or shape differs between
ranks raises MismatchError on every rank, naming it.

Framework-free: the TensorFlow layer calls only enqueue and wait.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import collectives as _c
from .config import Config
from .errors import MismatchError, RingReduceError
from .timeline import Timeline

NEGOTIATE = 5  # header kind of a negotiation pass (see collectives._KIND_NAMES)


@dataclass
class Handle:
    name: str
    array: object  # numpy or cupy
    op: str
    seq: int
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    family: object = None  # how the collectives handle `array` (collectives._arrays_for)
    ready: object = None  # GPU arrays: an event after the caller's work on `array`


class Engine:
    def __init__(self, fusion_bytes: int | None = None, timeline_path: str | None = None):
        self.fusion_bytes = fusion_bytes if fusion_bytes is not None else Config.from_env().fusion_bytes
        self.timeline = Timeline(timeline_path or os.environ.get("RINGREDUCE_TIMELINE"))
        self._pending: dict[str, Handle] = {}
        self._cond = threading.Condition()
        self._seq = 0
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ringreduce-engine", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------

    def enqueue(self, name: str, array, op: str = "avg") -> Handle:
        """array: numpy, or a GPU array (cupy), reduced on its device."""
        family, array = _c._arrays_for(array)
        with family.on(array):
            array = family.xp.ascontiguousarray(array)
        ready = family.mark(array)  # the engine's thread reads array after the caller's stream wrote it
        _c._op_code(op)
        with self._cond:
            if self._error is not None:
                raise RingReduceError(f"the engine stopped after an earlier error: {self._error}")
            if name in self._pending:
                raise ValueError(f"tensor {name!r} is already in flight")
            self._seq += 1
            h = Handle(name, array, op, self._seq, family=family, ready=ready)
            self._pending[name] = h
            self.timeline.begin(name, "QUEUE")
            self._cond.notify()
        return h

    def wait(self, h: Handle):
        self.timeline.begin(h.name, "WAIT")
        h.done.wait()
        self.timeline.end(h.name, "WAIT")
        if h.error is not None:
            raise h.error
        return h.result

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self.timeline.close()

    # -- the engine's side ---------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                ready = sorted(self._pending.values(), key=lambda h: h.seq)
            try:
                self._cycle(ready)
            except BaseException as exc:  # every waiter learns, on every rank
                with self._cond:
                    self._error = exc
                    for h in self._pending.values():
                        h.error = exc
                        h.done.set()
                    self._pending.clear()
                return

    def _cycle(self, ready: list[Handle]) -> None:
        mine = [[h.name, h.array.dtype.str, list(h.array.shape), h.op] for h in ready]
        everyone = self._negotiate(mine)
        ready_everywhere = [entry for entry in everyone[0] if all(entry[0] in by_name for by_name in everyone[1:])]
        agreed = []
        for entry in ready_everywhere:  # every rank holds the same lists, so all decide alike
            problem = _disagreement(entry, everyone[1:])
            if problem is None:
                agreed.append(entry)
            else:  # fails this tensor on every rank; the engine and the ring go on
                with self._cond:
                    h = self._pending.pop(entry[0])
                h.error = MismatchError(problem)
                self.timeline.end(h.name, "QUEUE")
                h.done.set()
        if not agreed:
            time.sleep(0.001)  # some rank is still computing; ask again shortly
            return
        with self._cond:
            handles = [self._pending[e[0]] for e in agreed]
        for bucket in self._buckets(handles):
            self._run(bucket)

    def _negotiate(self, mine: list) -> list:
        """Every rank's ready list; rank 0's as a list, the others as dicts by name."""
        blob = json.dumps(mine).encode()
        head = _c._header(NEGOTIATE, 0, 0, (), "", 0, False)
        with _c._state.lock:
            blobs = _c._exchange(head, blob, ("name",), "engine negotiation")
        lists = [json.loads(bytes(b[len(head):])) for b in blobs]
        return [lists[0]] + [{e[0]: e for e in lst} for lst in lists[1:]]

    def _buckets(self, handles: list[Handle]):
        """Consecutive tensors of one dtype and op, up to the fusion threshold."""
        bucket, size = [], 0
        for h in handles:
            if bucket and (h.array.dtype != bucket[0].array.dtype or h.op != bucket[0].op
                           or size + h.array.nbytes > self.fusion_bytes):
                yield bucket
                bucket, size = [], 0
            bucket.append(h)
            size += h.array.nbytes
        if bucket:
            yield bucket

    def _run(self, bucket: list[Handle]) -> None:
        for h in bucket:
            self.timeline.end(h.name, "QUEUE")
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
            result = _c.allreduce(flat, op=bucket[0].op)
        phases = _c._state.comm.last_phases()
        if phases[0] < t0:  # the one-pass small algorithm ran: no ring phases to show
            phases = None
        self.timeline.ring_op([h.name for h in bucket], label, flat.nbytes, t0, time.monotonic(), phases)
        at = 0
        with self._cond:
            for f, h in zip(families, bucket):
                n = h.array.size
                h.result = result[at:at + n].reshape(h.array.shape)
                if mixed:
                    h.result = f.from_host(h.result, like=h.array)
                at += n
                del self._pending[h.name]
                h.done.set()


def _disagreement(entry, others) -> str | None:
    for r, by_name in enumerate(others, start=1):
        theirs = by_name[entry[0]]
        if theirs[1:] != entry[1:]:
            return (f"tensor {entry[0]!r} differs between ranks: rank 0 has dtype {entry[1]} shape "
                    f"{tuple(entry[2])} op {entry[3]}, rank {r} has dtype {theirs[1]} shape "
                    f"{tuple(theirs[2])} op {theirs[3]}")
    return None


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The process's engine, started on first use (after ringreduce.init())."""
    global _engine
    with _engine_lock:
        if _engine is None or not _engine._thread.is_alive():
            _engine = Engine()
        return _engine
