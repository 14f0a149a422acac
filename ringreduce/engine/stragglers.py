"""Which rank the others wait for: per-rank lateness from the engine's negotiation.

Every request the engine runs was offered by every rank that runs it, each at
its own moment. A rank's *age* for a cycle that agreed to run something is the
time from its latest offer among that cycle's requests to the end of the
negotiation pass that agreed them, on its own clock. The pass ends at nearly
the same moment on every rank (it is one header pass of the ring: it ends once
the last rank's message has gone round), so ages are durations that compare
across hosts whatever their clocks say. Each rank sends its age, the cycle's
period (the time since the previous such pass ended) and how much of that
period its callers spent blocked in Engine.wait, all on its own clock, in its
next negotiation message (negotiation.py, flags bit 6: 12 bytes); every rank
then holds every rank's, and computes the same numbers from them with the same
code.

For a cycle:

    lateness(r) = max over ranks of age - age(r)

the time from the first rank's offer to rank r's: how long the others waited
for r. The rank with the largest lateness arrived last. A rank's *busy* time
in the cycle is its period less the time it was blocked waiting for results
(its compute, data loading, everything but waiting for the others); over the
window (the last RINGREDUCE_STRAGGLER_WINDOW cycles, default 100):

    score(r) = min over ranks of mean busy / mean busy(r)

(each mean busy time taken as at least MIN_BUSY, 1 ms: below it busy times
are the engine's own overhead and timer noise, and a rank that spent a cycle
all blocked, busy 0, would otherwise score every other rank 0),
1.0 for the fastest rank, 0.5 for one that takes twice as long between two
collectives as the fastest (after NVIDIA's resiliency extension's relative
performance score; here measured by the engine, with no timer in the user's
code). Busy time counts any caller blocked in Engine.wait as the rank
waiting (several threads at once count once); a rank whose callers never
block there (results taken by callback) is busy all the time, and scores
compare nothing then: the lateness still does.

RINGREDUCE_STRAGGLER_THRESHOLD says when rank 0 logs a warning
(logging.getLogger("ringreduce")) naming a rank: a number in (0, 1) is a
score (default 0.5: a rank whose score is below it), a duration ("0.2s",
"150ms") a median lateness (a rank whose median lateness is above it); "off"
never warns. Only a full window counts (the rank stays late); rank 0 looks
at it every tenth of a window, and names a rank at most once a minute. Rank 0 writes the report as stragglers.json into
RINGREDUCE_REPORT_DIR (set by ringrun, which prints a summary) when its engine
shuts down and when the process exits.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import math
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..core.config import Config, straggler_threshold

log = logging.getLogger("ringreduce")

THRESHOLD_ENV, REPORT_DIR_ENV = "RINGREDUCE_STRAGGLER_THRESHOLD", "RINGREDUCE_REPORT_DIR"
REPORT_FILE = "stragglers.json"
WARN_EVERY = 60.0  # seconds between two warnings naming the same rank
_now = time.monotonic  # the rate limit's clock

WIRE = struct.Struct("<III")  # age, period, blocked: microseconds, NONE when not known
NONE = 0xFFFFFFFF
_LONGEST = NONE - 1  # about 71 minutes
MIN_BUSY = 1e-3  # seconds: the least mean busy time a score compares (shorter ones count as this)


@dataclass(frozen=True)
class Threshold:
    """When a rank is a straggler: its score below `score`, or its median
    lateness above `seconds` (one of the two is set)."""
    text: str
    score: float | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Threshold | None":
        """RINGREDUCE_STRAGGLER_THRESHOLD's value (core.config.straggler_threshold:
        ValueError naming the variable for nonsense); None for "off"."""
        meaning = straggler_threshold(text)
        return None if meaning is None else cls(text.strip(), **{meaning[0]: meaning[1]})

    def exceeded(self, score: float, median: float) -> bool:
        if self.score is not None:
            return score < self.score
        return median > self.seconds


@dataclass(frozen=True)
class Settings:
    window: int = Config.straggler_window
    threshold: Threshold | None = Threshold.parse(Config.straggler_threshold)

    @classmethod
    def from_config(cls, config: Config) -> "Settings":
        return cls(config.straggler_window, Threshold.parse(config.straggler_threshold))

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        """RINGREDUCE_STRAGGLER_WINDOW and _THRESHOLD (checked with every
        setting: ValueError naming the variable for nonsense)."""
        return cls.from_config(Config.from_env(env))


@dataclass(frozen=True)
class Cycle:
    lateness: np.ndarray  # per rank, seconds; NaN for a rank that offered none of the cycle's requests
    busy: np.ndarray  # per rank, seconds of the cycle's period it did not spend blocked in Engine.wait
    last: int | None  # the rank that arrived last


def _micros(seconds: float | None) -> int:
    if seconds is None:
        return NONE
    return min(max(int(seconds * 1e6), 0), _LONGEST)


def _seconds(micros: int) -> float | None:
    return None if micros == NONE else micros / 1e6


def encode(report: tuple) -> bytes:
    """A period past the wire's longest (about 71 minutes) is sent as the
    longest with its blocked time cut by as much: the receiver's busy time
    (period less blocked) stays the rank's own, up to that longest."""
    age, period, blocked = report
    if period is not None and blocked is not None and period > _LONGEST / 1e6:
        busy = max(period - blocked, 0.0)
        period = _LONGEST / 1e6
        blocked = max(period - busy, 0.0)
    return WIRE.pack(_micros(age), _micros(period), _micros(blocked))


def decode(blob, at: int) -> tuple:
    return tuple(map(_seconds, WIRE.unpack_from(blob, at)))


class Tracker:
    """One rank's straggler bookkeeping. The engine's thread calls
    agreed / outgoing / sent / observe (through the Negotiator); report() may
    be called from any thread."""

    def __init__(self, settings: Settings | None = None):
        self.settings = settings or Settings()
        self.rank: int | None = None  # this rank's, once it has negotiated
        self._lock = threading.Lock()
        self._window: collections.deque[Cycle] = collections.deque(maxlen=self.settings.window)
        self._pending: tuple | None = None  # (age, period, blocked) of the last agreed cycle, sent in the next pass
        self._last_done: float | None = None  # when the last pass that agreed something ended, this clock
        self._blocked_then = 0.0  # _blocked_at(_last_done)
        self._waiters = 0  # callers blocked in Engine.wait now
        self._blocked_since = 0.0  # when the first of them began
        self._blocked_total = 0.0  # seconds some caller was blocked, up to _blocked_since
        self._warned_at: dict[int, float] = {}
        self._observed = 0  # cycles compared so far
        self._check_every = max(1, self.settings.window // 10)  # cycles between rank 0's looks at the window

    # -- this rank's side ------------------------------------------------------

    @contextlib.contextmanager
    def blocking(self):
        """Around a caller's wait for a result (Engine.wait): time this rank
        does nothing but wait for the others. Several threads waiting at
        once count once."""
        with self._lock:
            if self._waiters == 0:
                self._blocked_since = time.monotonic()
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
                if self._waiters == 0:
                    self._blocked_total += time.monotonic() - self._blocked_since

    def _blocked_at(self, now: float) -> float:
        with self._lock:
            return self._blocked_total + (max(now - self._blocked_since, 0.0) if self._waiters else 0.0)

    def agreed(self, done: float, ages: list) -> None:
        """A pass that ended at `done` (time.monotonic) agreed to run
        something; ages: this rank's, of each agreed request it offered."""
        blocked = self._blocked_at(done)
        if self._last_done is None:
            self._pending = (min(ages) if ages else None, None, None)
        else:
            self._pending = (min(ages) if ages else None, done - self._last_done, blocked - self._blocked_then)
        self._last_done, self._blocked_then = done, blocked

    def outgoing(self) -> tuple | None:
        return self._pending

    def sent(self) -> None:
        """The pending report went out in a negotiation pass every rank took part in."""
        self._pending = None

    # -- every rank's ------------------------------------------------------------

    def observe(self, reports: list, me: int) -> dict | None:
        """Every rank's report (None where it sent none) from one pass; the
        lateness of each rank in the cycle they describe (None: nothing to
        compare). Rank 0 warns here."""
        global _latest
        if self.rank is None:  # the engine negotiating now: its report is the one written at exit
            _latest = weakref.ref(self)
        self.rank = me
        period = reports[0][1] if reports and reports[0] is not None else None
        if period is None:  # the first agreed cycle (its waits include start-up), or none at all
            return None
        ages = {r: rep[0] for r, rep in enumerate(reports)
                if rep is not None and rep[0] is not None and rep[1] is not None}
        if len(ages) < 2:
            return None
        first = max(ages.values())
        lateness = {r: first - a for r, a in ages.items()}
        last = max(lateness, key=lambda r: (lateness[r], -r))
        row, busy = np.full((2, len(reports)), np.nan)
        for r in ages:
            row[r] = lateness[r]
            busy[r] = max(reports[r][1] - reports[r][2], 0.0)  # its period less its waits, on its clock
        with self._lock:
            if self._window and len(self._window[0].lateness) != len(reports):  # another world: start afresh
                self._window.clear()
            self._window.append(Cycle(row, busy, last if lateness[last] > 0 else None))
            self._observed += 1
            check = len(self._window) == self.settings.window and self._observed % self._check_every == 0
        if me == 0 and check and self.settings.threshold is not None:
            self._warn()
        return lateness

    def _warn(self) -> None:
        report = self.report()
        now = _now()
        for r in report["stragglers"]:
            if now - self._warned_at.get(r, -math.inf) < WARN_EVERY:
                continue
            self._warned_at[r] = now
            line = next(x for x in report["ranks"] if x["rank"] == r)
            log.warning("ringreduce: rank %d is a straggler: the others waited %s for it on median (p90 %s) over "
                        "the last %d engine cycles, it arrived last in %.0f%% of them; score %.2f (%s=%s)",
                        r, ms(line["median_lateness"]), ms(line["p90_lateness"]), report["cycles"],
                        100 * line["last_fraction"], line["score"], THRESHOLD_ENV, self.settings.threshold.text)

    def report(self) -> dict:
        """Per rank over the window: the fraction of cycles it arrived last,
        its median and p90 lateness (seconds), its score; and the ranks past
        the threshold over a full window."""
        with self._lock:
            cycles = list(self._window)
        width = len(cycles[0].lateness) if cycles else 0  # the world's size (a tracker's engine has one world)
        late = np.stack([c.lateness for c in cycles]) if cycles else np.empty((0, 0))
        busy = np.stack([c.busy for c in cycles]) if cycles else np.empty((0, 0))
        counts = np.sum(~np.isnan(late), axis=0)
        ranks = [int(r) for r in np.flatnonzero(counts)]  # those compared at least once
        late, busy, counts = late[:, ranks], busy[:, ranks], counts[ranks]
        last = np.zeros(width)
        for c in cycles:
            if c.last is not None:
                last[c.last] += 1
        last = last[ranks]
        lines = []
        if ranks:
            mean_busy = np.maximum(np.nanmean(busy, axis=0), MIN_BUSY)
            fastest = mean_busy.min()
            medians, p90s = _percentiles(late, counts, (0.5, 0.9))
            for i, r in enumerate(ranks):
                score = min(max(fastest / mean_busy[i], 0.0), 1.0)
                lines.append({"rank": r, "cycles": int(counts[i]), "last_fraction": float(last[i] / counts[i]),
                              "median_lateness": float(medians[i]), "p90_lateness": float(p90s[i]),
                              "score": float(score)})
        threshold = self.settings.threshold
        full = len(cycles) == self.settings.window
        stragglers = [x["rank"] for x in lines
                      if full and threshold is not None and threshold.exceeded(x["score"], x["median_lateness"])]
        return {"cycles": len(cycles), "window": self.settings.window,
                "threshold": threshold.text if threshold is not None else "off", "ranks": lines,
                "stragglers": stragglers}

    def write(self, directory: str | None = None) -> str | None:
        """Rank 0: the report as stragglers.json in `directory` (default
        RINGREDUCE_REPORT_DIR); the path written, or None (another rank, no
        directory, nothing negotiated yet, or a directory it cannot write
        to: logged, the job's own result stands)."""
        directory = directory or os.environ.get(REPORT_DIR_ENV)
        if self.rank != 0 or not directory:
            return None
        path = os.path.join(directory, REPORT_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.report(), f, indent=1)
            os.replace(tmp, path)  # ringrun never reads half a file
        except OSError as exc:
            log.warning("ringreduce: could not write %s: %s", path, exc)
            return None
        return path


def _percentiles(values, counts, qs):
    """np.nanpercentile's linear interpolation per column, without its
    per-column Python loop: NaNs sort last, each column's count says where
    its numbers end."""
    ordered = np.sort(values, axis=0)
    out = []
    for q in qs:
        at = q * (counts - 1)
        lo = np.floor(at).astype(int)
        hi = np.minimum(lo + 1, counts - 1)
        low = np.take_along_axis(ordered, lo[None, :], axis=0)[0]
        high = np.take_along_axis(ordered, hi[None, :], axis=0)[0]
        out.append(low + (high - low) * (at - lo))
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


_latest = None  # the Tracker whose engine began negotiating last (weakly): its report is written at exit


@atexit.register
def _write_at_exit() -> None:
    tracker = _latest() if _latest is not None else None
    if tracker is not None:
        tracker.write()


def timeline_values(lateness: dict) -> dict:
    """A cycle's lateness as a timeline counter's series: milliseconds per rank."""
    return {f"rank {r}": round(seconds * 1e3, 3) for r, seconds in sorted(lateness.items())}
