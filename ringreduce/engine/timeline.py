"""A Chrome trace (chrome://tracing, Perfetto) of what the engine did.

RINGREDUCE_TIMELINE=trace.json: one process row per rank, one thread row
per tensor, with its QUEUE (handed over, waiting for every rank), the fused
ring op it travelled in (split into the ScatterReduce and AllGather phases
of each ring allreduce it ran, compressed or not; the one-pass small
allreduces have none) and the caller's WAIT; counter tracks: the bytes sent,
and each rank's lateness per cycle (stragglers.py).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time


class Timeline:
    def __init__(self, path: str | None, mark_cycles: bool = False, rank: int | None = None):
        self.path = path
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._file = None
        if path:
            rank = str(rank) if rank is not None else os.environ.get("RINGREDUCE_RANK", "0")
            root, ext = os.path.splitext(path)
            self._file = open(f"{root}.rank{rank}{ext or '.json'}" if rank != "0" else path, "w")
            self._file.write("[\n")
            self._pid = int(rank)
            atexit.register(self.close)  # a script that never shuts the engine down still ends with valid JSON

    def _us(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) * 1e6

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file:  # closed meanwhile (stop_timeline) by another thread: dropped
                self._file.write(json.dumps(event) + ",\n")

    def _tid(self, name: str) -> int:
        if name not in self._tids:
            self._tids[name] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": self._tids[name],
                        "args": {"name": name}})
        return self._tids[name]

    def begin(self, name: str, what: str) -> None:
        if self._file:
            self._emit({"name": what, "ph": "B", "ts": self._us(), "pid": self._pid, "tid": self._tid(name)})

    def end(self, name: str, what: str) -> None:
        if self._file:
            self._emit({"name": what, "ph": "E", "ts": self._us(), "pid": self._pid, "tid": self._tid(name)})

    def cycle(self, n_run: int) -> None:
        """A negotiation cycle agreed to run n_run requests (with mark_cycles)."""
        if self._file and self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": self._us(), "pid": self._pid,
                        "tid": 0, "args": {"requests": n_run}})

    def ring_op(self, names, label: str, nbytes: int, t0: float, t1: float, phases=()) -> None:
        """One (fused) allreduce; phases: the (start, ScatterReduce done,
        end) of each ring op it ran (collectives.record_phases: a compressed
        bucket may run several), none when only one-pass small allreduces
        ran, or a compressor that gathers (args.path says which)."""
        if not self._file:
            return
        path = "ring" if phases else "no ring phases (one-pass small allreduces, or a gather)"
        for name in names:
            tid = self._tid(name)
            self._emit({"name": "ALLREDUCE", "ph": "X", "ts": self._us(t0), "dur": self._us(t1) - self._us(t0),
                        "pid": self._pid, "tid": tid, "args": {"op": label, "bytes": nbytes, "path": path}})
            for start, middle, end in phases:
                self._emit({"name": "ScatterReduce", "ph": "X", "ts": self._us(start),
                            "dur": self._us(middle) - self._us(start), "pid": self._pid, "tid": tid})
                self._emit({"name": "AllGather", "ph": "X", "ts": self._us(middle),
                            "dur": self._us(end) - self._us(middle), "pid": self._pid, "tid": tid})

    def counter(self, name: str, values: dict) -> None:
        """A counter track (e.g. bytes sent so far, by kind) at this moment."""
        if self._file:
            self._emit({"name": name, "ph": "C", "ts": self._us(), "pid": self._pid, "args": values})

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._file:
            with self._lock:
                self._file.write("{}]\n")
                self._file.close()
                self._file = None
