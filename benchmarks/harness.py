"""The benchmark harness every collective benchmark shares, after nccl-tests:
one small description per implementation, one harness that owns warm-up,
timing, the correctness check and the table.

Time is the median over repeats of the mean time of `iters` back-to-back
operations, the slowest rank's. GB = 1e9 bytes. busbw = algbw * factor, with
factor 2(N-1)/N for allreduce, (N-1)/N for reduce-scatter and allgather, 1 for
broadcast: the bandwidth each link must carry, comparable across N.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import ringreduce as rr

BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


@dataclass
class Impl:
    """One implementation of one collective at one size: `run()` does one
    operation; `wrong()` counts elements that differ from the expected result."""
    name: str
    run: Callable[[], None]
    wrong: Callable[[], int]


@dataclass
class Row:
    impl: str
    coll: str
    nbytes: int
    count: int
    dtype: str
    op: str
    seconds: float
    algbw: float
    busbw: float
    wrong: int
    peak_mib: float
    extra: dict = field(default_factory=dict)


def parse_bytes(text: str) -> int:
    """"64M", "1KiB", "4096" -> bytes (K, M, G: powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, b = [], min_bytes
    while b <= max_bytes:
        out.append(b)
        b *= factor
    return out


def iterations(nbytes: int, budget_bytes: float = 256e6) -> int:
    return int(min(200, max(3, budget_bytes // max(nbytes, 1))))


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def slowest(seconds: float) -> float:
    return float(rr.allreduce(np.array([seconds]), op="max")[0])


def measure(impl: Impl, coll: str, nbytes: int, count: int, dtype: str, op: str,
            barrier: Callable[[], None], warmup: int = 2, repeats: int = 5) -> Row:
    n = rr.size()
    iters = iterations(nbytes)
    for _ in range(warmup):
        impl.run()
    samples = []
    for _ in range(repeats):
        barrier()
        t = time.perf_counter()
        for _ in range(iters):
            impl.run()
        samples.append(slowest((time.perf_counter() - t) / iters))
    seconds = statistics.median(samples)
    wrong = int(rr.allreduce(np.array([impl.wrong()], dtype=np.int64), op="sum")[0])
    peak = float(rr.allreduce(np.array([peak_mib()]), op="max")[0])
    algbw = nbytes / seconds / 1e9
    return Row(impl.name, coll, nbytes, count, dtype, op, seconds, algbw, algbw * BUSBW_FACTOR[coll](n), wrong, peak)


def table(rows: list[Row]) -> str:
    head = (f"{'impl':>10} {'size(B)':>11} {'count':>10} {'type':>8} {'redop':>6} {'time(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} {'peak(MiB)':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.impl:>10} {r.nbytes:>11} {r.count:>10} {r.dtype:>8} {r.op:>6} {r.seconds * 1e6:>10.1f} "
                     f"{r.algbw:>11.3f} {r.busbw:>11.3f} {r.wrong:>7} {r.peak_mib:>9.0f}")
    return "\n".join(lines)


def progress(total: int, enabled: bool):
    """A tqdm bar on stderr (rank 0 only), or a stand-in without tqdm."""
    class Quiet:
        def update(self, k=1):
            pass

        def set_description(self, text):
            pass

        def close(self):
            pass
    if not enabled:
        return Quiet()
    try:
        from tqdm import tqdm
    except ImportError:
        return Quiet()
    return tqdm(total=total, unit="row", leave=False)


def isolated_median_us(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Median microseconds of one `fn()` started right after a barrier: a lone
    operation, the way a training step meets its peers (not back-to-back)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        rr.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def best_rate(fn: Callable[[], object], amount: float, seconds: float = 0.2) -> float:
    """amount / 1e9 per second of fn() (G units/s), the best of calls timed
    for about `seconds` after one warm-up call: a kernel's or a copy's rate."""
    fn()
    best, spent = 0.0, 0.0
    while spent < seconds:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, amount / dt / 1e9)
    return best

