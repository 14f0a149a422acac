"""Autotuning against a grid search of fixed settings, in one run.

    ringrun -np 2 python benchmarks/autotune_bench.py
    ringrun -np 4 python benchmarks/autotune_bench.py --rounds 15 --json n4.json

Every fixed setting of the grid (segment size x small limit, the
candidates of ringreduce/autotune.py) and the setting the init calibration
picks (run fresh here, no cache) time one workload: allreduces of float32 at
sizes from 4 KiB to 16 MiB, each a barrier then `iters` back-to-back ops,
the slowest rank's time. The workload's time is the sum over sizes of the
per-op times. Settings run in a shuffled order (the same on every rank) for
several rounds; each setting's median round counts. The table ranks them;
the line that matters is the tuned setting's time over the best fixed one's.
Rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce import autotune, collectives as _c  # noqa: E402

SIZES = (4 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 16 << 20)


def iters_for(nbytes: int) -> int:
    return int(min(100, max(4, (64 << 20) // nbytes)))


def workload(ring, segment: int, small_bytes: int, arrays) -> float:
    """Seconds of one pass over SIZES with this setting (sum of per-op times)."""
    ring.comm.set_segment(segment)
    ring.small_limit = small_bytes // max(rr.size() - 1, 1)
    total = 0.0
    for x in arrays:
        rr.allreduce(x)  # warm-up with this setting
        rr.barrier()
        t = time.perf_counter()
        k = iters_for(x.nbytes)
        for _ in range(k):
            rr.allreduce(x)
        total += harness.slowest((time.perf_counter() - t) / k)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.pop("RINGREDUCE_AUTOTUNE", None)
    rr.init()
    n, ring = rr.size(), _c._state.ring
    default_seg = _c._state.world.config.segment_bytes

    choice = autotune.calibrate(ring, n, autotune.SEGMENT_CANDIDATES, autotune.SMALL_CANDIDATES, default_seg,
                                _c._state.world.config.small_bytes)
    settings = [("fixed", s, m) for s in autotune.SEGMENT_CANDIDATES for m in autotune.SMALL_CANDIDATES]
    settings.append(("tuned", choice.segment_bytes, choice.small_bytes))
    arrays = [np.ones(b // 4, np.float32) for b in SIZES]
    times: dict[int, list[float]] = {i: [] for i in range(len(settings))}
    order = list(range(len(settings)))
    shuffle = random.Random(1234)
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for i in order:
            times[i].append(workload(ring, settings[i][1], settings[i][2], arrays))
    med = {i: statistics.median(t) for i, t in times.items()}
    fixed = [i for i in med if settings[i][0] == "fixed"]
    best = min(fixed, key=med.get)
    default = next(i for i in fixed if settings[i][1:] == (default_seg, _c._state.world.config.small_bytes))
    tuned = len(settings) - 1
    if rr.rank() == 0:
        print(f"N = {n}, {args.rounds} rounds, workload: allreduce float32 of "
              + ", ".join(f"{b >> 10} KiB" for b in SIZES) + f"; calibration {choice.seconds:.2f} s")
        print(f"{'setting':>8} {'segment':>9} {'small':>8} {'workload(ms)':>12} {'vs best':>8}")
        for i in sorted(med, key=med.get):
            kind, s, m = settings[i]
            mark = " (default)" if i == default else ""
            print(f"{kind:>8} {s >> 10:>7}Ki {m >> 10:>6}Ki {med[i] * 1e3:>12.2f} {med[i] / med[best]:>8.3f}{mark}")
        twin = next(i for i in fixed if settings[i][1:] == settings[tuned][1:])
        print(f"tuned / best fixed: {med[tuned] / med[best]:.3f}   default / best fixed: "
              f"{med[default] / med[best]:.3f}   tuned / default: {med[tuned] / med[default]:.3f}   "
              f"tuned / the same setting in the grid (noise): {med[tuned] / med[twin]:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"n": n, "rounds": args.rounds, "sizes": SIZES, "calibration_s": choice.seconds,
                           "rows": [{"setting": settings[i][0], "segment": settings[i][1], "small": settings[i][2],
                                     "seconds": med[i], "samples": times[i]} for i in med]}, f, indent=1)
    rr.shutdown()


if __name__ == "__main__":
    main()
