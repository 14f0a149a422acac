"""Balanced batches for mixed clusters: a slower rank takes a smaller share
of the global batch, so that every rank's compute takes about as long and
none waits for a straggler at the allreduce.

    bal = rr.balance.BatchBalancer(global_batch_size=256, every=20)
    for step in range(steps):
        lo, hi = bal.rows(step)                      # this rank's rows of global batch `step`
        with bal.measure():                          # compute only: not the allreduce's wait
            grad = gradient(x[perm[lo:hi]], y[perm[lo:hi]])
        grad = rr.allreduce(grad, op="avg", weight=bal.local_batch_size)   # = one batch of 256
        apply(grad)
        bal.step()                                   # every 20th: shares move toward measured speeds

What holds:
- Shares are integers, at least `min_batch` each, summing to the global
  batch; every rank holds the same shares at every step. They change only
  in step(), on every `every`-th call, from measurements every rank
  allgathered (its compute seconds and samples since the last change), by
  the same arithmetic on every rank: so all decide alike.
- The target: shares proportional to each rank's throughput (samples per
  compute second), smoothed: est = smoothing * est + (1 - smoothing) *
  measured (the first measurement is taken as it is), then apportioned by
  largest remainders (ties to the lower rank). A rank that measured nothing
  in a period keeps its estimate; with no estimate for some rank the shares
  stay.
- With weighted averaging (rr.allreduce(weight=local_batch_size), or the TF
  layer's local_batch_size=) and each rank's loss its batch's mean, a step
  equals one step on the whole global batch: balancing changes speed, not
  the result (up to float rounding).
- Ranks built with a different global batch, period or process set, or
  a measurement that is negative or not finite: ValueError on every rank at
  the exchange, naming the ranks (a bad local measurement is refused at
  once by record()).

Only public calls: the exchange is rr.allgather (or any function given as
`allgather`, e.g. the TensorFlow layer's through its engine).
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np

from .core import allgather as _allgather, global_process_set


class BatchBalancer:
    """Unequal, measured shares of a global batch (see the module docstring).

    global_batch_size: samples per step over all ranks. every: steps between
    rebalances (M). smoothing: weight of the previous throughput estimate in
    [0, 1). min_batch: the least share of any rank. shares: the starting
    shares (default: as equal as integers allow, the remainder to the lower
    ranks). process_set: the ranks that share the batch (default: the world).
    allgather: f(np.ndarray) -> the rows of every rank in rank order (default
    rr.allgather over the process set)."""

    def __init__(self, global_batch_size: int, every: int = 10, smoothing: float = 0.5, min_batch: int = 1,
                 shares=None, process_set=None, allgather=None):
        self.process_set = global_process_set if process_set is None else process_set
        self.size = self.process_set.size()
        self.rank = self.process_set.rank()
        for label, value, least in (("global_batch_size", global_batch_size, 1), ("every", every, 1),
                                    ("min_batch", min_batch, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(f"{label} must be an integer >= {least}, not {value!r}")
        if not (isinstance(smoothing, (int, float)) and 0 <= smoothing < 1):
            raise ValueError(f"smoothing must be in [0, 1), not {smoothing!r}")
        if global_batch_size < min_batch * self.size:
            raise ValueError(f"global_batch_size {global_batch_size} cannot give each of {self.size} ranks "
                             f"min_batch={min_batch}")
        self.global_batch_size, self.every = int(global_batch_size), int(every)
        self.smoothing, self.min_batch = float(smoothing), int(min_batch)
        if shares is None:
            q, rem = divmod(self.global_batch_size, self.size)
            shares = [q + (1 if r < rem else 0) for r in range(self.size)]
        shares = [int(s) for s in shares]
        if len(shares) != self.size or sum(shares) != self.global_batch_size or min(shares) < self.min_batch:
            raise ValueError(f"shares must be {self.size} integers >= {self.min_batch} summing to "
                             f"{self.global_batch_size}, not {shares}")
        self._shares = tuple(shares)
        self._allgather = allgather or (lambda a: _allgather(a, name="ringreduce.balance",
                                                             process_set=self.process_set))
        self.estimates = [None] * self.size  # smoothed samples per compute second, per rank
        self.steps = 0  # step() calls so far
        self.history = []  # (step, shares) at every change, the first included
        self.history.append((0, self._shares))
        self._seconds = 0.0
        self._samples = 0

    # ----------------------------------------------------------------- the shares

    @property
    def shares(self) -> tuple:
        """Every rank's batch size now (the same on every rank)."""
        return self._shares

    @property
    def local_batch_size(self) -> int:
        return self._shares[self.rank]

    @property
    def offset(self) -> int:
        """Where this rank's rows start in a global batch."""
        return sum(self._shares[:self.rank])

    def rows(self, step: int) -> tuple[int, int]:
        """[lo, hi): this rank's rows of global batch `step` (rows step * global_batch_size onwards of the
        epoch's order): the ranks' rows are disjoint and together the whole global batch."""
        lo = step * self.global_batch_size + self.offset
        return lo, lo + self.local_batch_size

    # ----------------------------------------------------------------- measuring

    def record(self, seconds: float, samples: int | None = None) -> None:
        """Adds one step's compute time on this rank (seconds, excluding the
        wait for the other ranks) for `samples` rows (default: this rank's
        share now)."""
        if not (isinstance(seconds, (int, float, np.integer, np.floating)) and math.isfinite(seconds)
                and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, not {seconds!r}")
        samples = self.local_batch_size if samples is None else samples
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise ValueError(f"samples must be an integer >= 0, not {samples!r}")
        self._seconds += float(seconds)
        self._samples += int(samples)

    @contextlib.contextmanager
    def measure(self, samples: int | None = None):
        """Times the block (time.perf_counter) and records it: wrap the
        compute of one step, not its allreduce."""
        start = time.perf_counter()
        yield
        self.record(time.perf_counter() - start, samples)

    # ----------------------------------------------------------------- deciding

    def step(self) -> bool:
        """Counts a step. On every `every`-th, every rank exchanges its
        measurements and all move to the same new shares; returns whether
        the shares changed (on every rank alike). Called by every rank
        after every step."""
        self.steps += 1
        if self.steps % self.every:
            return False
        mine = np.array([self._seconds, self._samples, self.global_batch_size, self.every], dtype=np.float64)
        self._seconds, self._samples = 0.0, 0
        gathered = np.asarray(self._allgather(mine.reshape(1, 4)), dtype=np.float64).reshape(self.size, 4)
        new = self.decide(gathered)
        changed = new != self._shares
        if changed:
            self._shares = new
            self.history.append((self.steps, new))
        return changed

    def decide(self, gathered: np.ndarray) -> tuple:
        """The next shares from every rank's [seconds, samples, global batch,
        every] (rank order); updates the estimates. Pure arithmetic on data
        every rank holds alike: every rank decides the same."""
        for column, label in ((2, "global_batch_size"), (3, "every")):
            values = gathered[:, column]
            if np.any(values != values[0]):
                raise ValueError(f"BatchBalancer: ranks disagree on {label}: " +
                                 ", ".join(f"rank {r} has {int(v)}" for r, v in enumerate(values)))
        bad = [r for r in range(self.size) if not (np.isfinite(gathered[r, 0]) and gathered[r, 0] >= 0
                                                   and np.isfinite(gathered[r, 1]) and gathered[r, 1] >= 0)]
        if bad:
            raise ValueError(f"BatchBalancer: bad measurements from rank(s) {bad}: {gathered[bad, :2].tolist()}")
        for r in range(self.size):
            seconds, samples = gathered[r, 0], gathered[r, 1]
            if seconds > 0 and samples > 0:
                measured = samples / seconds
                old = self.estimates[r]
                self.estimates[r] = measured if old is None else self.smoothing * old + (1 - self.smoothing) * measured
        if any(e is None for e in self.estimates):
            return self._shares
        return apportion(self.global_batch_size, self.estimates, self.min_batch)


def apportion(total: int, weights, least: int = 1) -> tuple:
    """Integers >= least, summing to total, proportional to weights (the
    largest remainder method: floors first, the rest one each to the largest
    fractional parts, ties to the lower index). Ranks whose proportional
    share falls below `least` get `least`, and the rest is shared among the
    others in proportion."""
    n = len(weights)
    weights = [float(w) for w in weights]
    fixed = [False] * n
    while True:
        free = [i for i in range(n) if not fixed[i]]
        budget = total - least * (n - len(free))
        mass = math.fsum(weights[i] for i in free)
        ideal = {i: budget * weights[i] / mass if mass > 0 else budget / len(free) for i in free}
        low = [i for i in free if ideal[i] < least]
        if not low:
            break
        for i in low:
            fixed[i] = True
    out = [least] * n
    floors = {i: int(math.floor(ideal[i])) for i in free}
    for i in free:
        out[i] = floors[i]
    rest = budget - sum(floors.values())
    for i in sorted(free, key=lambda i: (-(ideal[i] - floors[i]), i))[:rest]:
        out[i] += 1
    return tuple(out)
