"""Autotuning against a grid search of fixed settings, in one run.

    ringrun -np 2 python benchmarks/autotune_bench.py
    ringrun -np 4 python benchmarks/autotune_bench.py --rounds 15 --confirm 30 --json n4.json

Every fixed setting of the grid (segment size x small limit, the
candidates of ringreduce/core/autotune.py) and the setting the init calibration
picks (run fresh here, no cache) time one workload: allreduces of float32 at
sizes from 4 KiB to 16 MiB, each a barrier then `iters` back-to-back ops,
the slowest rank's time. The workload's time is the sum over sizes of the
per-op times. Rank 0 prints.

Two phases, because the least of 25 noisy medians is biased low by about
the noise (the winner's curse), so "tuned / best of the grid" measured in
the same rounds that chose the best overstates the gap:

  selection:    every setting, `rounds` rounds in a shuffled order; each
                setting's median round counts. Its "tuned / best fixed" is
                the old single-phase number, kept for comparison.
  confirmation: fresh rounds (`confirm`) of the tuned setting, the default,
                and the `finalists` best fixed settings of the selection,
                interleaved in a shuffled order. Each round gives the ratio
                tuned / selected best (and default / selected best) of times
                taken side by side; the median of those ratios is the
                answer, with its quartiles and a bootstrap 95% interval.

`--calibrations K` runs the calibration K times (each fresh) to show how
often it picks the same setting (`--compare-recheck`: and K times without
the fresh recheck of a change, the calibration before it); every distinct
pick is confirmed too.
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
from ringreduce.core import autotune, collectives as _c  # noqa: E402

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


def run_rounds(ring, settings, rounds: int, arrays, shuffle: random.Random) -> list[list[float]]:
    """times[round][i]: setting i's workload in that round; settings in a
    shuffled order each round (the same on every rank: one seed)."""
    order = list(range(len(settings)))
    times = []
    for _ in range(rounds):
        shuffle.shuffle(order)
        row = [0.0] * len(settings)
        for i in order:
            row[i] = workload(ring, settings[i][1], settings[i][2], arrays)
        times.append(row)
    return times


def spread(ratios) -> dict:
    """Median of per-round ratios, its quartiles, and a bootstrap 95% interval of the median."""
    r = np.asarray(ratios)
    boot = np.median(np.random.default_rng(7).choice(r, (2000, len(r))), axis=1)
    return {"median": float(np.median(r)), "q25": float(np.quantile(r, 0.25)), "q75": float(np.quantile(r, 0.75)),
            "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]}


def kib(seg: int, small: int) -> str:
    return f"{seg >> 10} KiB, {small >> 10} KiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15, help="selection rounds over the whole grid")
    ap.add_argument("--confirm", type=int, default=30, help="fresh confirmation rounds of the finalists")
    ap.add_argument("--finalists", type=int, default=3, help="best fixed settings of the selection confirmed")
    ap.add_argument("--calibrations", type=int, default=1, help="fresh calibrations (their picks' agreement)")
    ap.add_argument("--compare-recheck", action="store_true",
                    help="as many calibrations again without the fresh recheck of a change (the old calibration)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.pop("RINGREDUCE_AUTOTUNE", None)
    rr.init()
    n, ring = rr.size(), _c.communicator().ring
    cfg = _c.communicator().world.config
    default_setting = (cfg.segment_bytes, cfg.small_bytes)

    def calibrate(recheck):
        return autotune.calibrate(ring, n, autotune.SEGMENT_CANDIDATES, autotune.SMALL_CANDIDATES,
                                  cfg.segment_bytes, cfg.small_bytes, recheck=recheck)
    choices = [calibrate(True) for _ in range(args.calibrations)]
    # as many again without the fresh recheck (the calibration before it), right after the others
    plain = [calibrate(False) for _ in range(args.calibrations if args.compare_recheck else 0)]
    picks = [(c.segment_bytes, c.small_bytes) for c in choices]
    plain_picks = [(c.segment_bytes, c.small_bytes) for c in plain]
    tuned_setting = picks[0]
    arrays = [np.ones(b // 4, np.float32) for b in SIZES]
    shuffle = random.Random(1234)

    # selection: the whole grid and the tuned setting (its twin in the grid measures the noise)
    grid = [("fixed", s, m) for s in autotune.SEGMENT_CANDIDATES for m in autotune.SMALL_CANDIDATES]
    settings = grid + [("tuned", *tuned_setting)]
    sel = run_rounds(ring, settings, args.rounds, arrays, shuffle)
    med = [statistics.median(r[i] for r in sel) for i in range(len(settings))]
    fixed = sorted(range(len(grid)), key=med.__getitem__)
    best, tuned = fixed[0], len(settings) - 1
    default = grid.index(("fixed", *default_setting))
    twin = grid.index(("fixed", *tuned_setting))

    # confirmation: fresh rounds of the tuned setting, the default, the finalists and every other pick
    finalists = [grid[i] for i in fixed[:args.finalists]]
    conf = [("tuned", *tuned_setting), ("default", *default_setting)]
    conf += [(f"fixed #{k + 1}", s, m) for k, (_, s, m) in enumerate(finalists)]
    others = [p for p in dict.fromkeys(picks[1:] + plain_picks) if p != tuned_setting]
    conf += [("pick" if p in picks else "old pick", *p) for p in others]
    con = np.array(run_rounds(ring, conf, args.confirm, arrays, shuffle))
    c_tuned, c_default, c_best = 0, 1, 2
    finals = list(range(2, 2 + len(finalists)))
    ratios = {
        "tuned / selected best": spread(con[:, c_tuned] / con[:, c_best]),
        "default / selected best": spread(con[:, c_default] / con[:, c_best]),
        "tuned / default": spread(con[:, c_tuned] / con[:, c_default]),
        # the least of the finalists each round: the winner's curse again, at 1 of `finalists`: a lower bound
        "tuned / best finalist of each round": spread(con[:, c_tuned] / con[:, finals].min(axis=1)),
    }
    if rr.rank() == 0:
        print(f"N = {n}, workload: allreduce float32 of " + ", ".join(f"{b >> 10} KiB" for b in SIZES))
        print(f"calibrations: {', '.join(f'{kib(*p)} in {c.seconds:.2f} s' for p, c in zip(picks, choices))}")
        if plain:
            print(f"without the recheck: {', '.join(f'{kib(*p)} in {c.seconds:.2f} s' for p, c in zip(plain_picks, plain))}")
        print(f"\nselection, {args.rounds} rounds:")
        print(f"{'setting':>8} {'segment':>9} {'small':>8} {'workload(ms)':>12} {'vs best':>8}")
        for i in sorted(range(len(settings)), key=med.__getitem__):
            kind, s, m = settings[i]
            mark = " (default)" if i == default else ""
            print(f"{kind:>8} {s >> 10:>7}Ki {m >> 10:>6}Ki {med[i] * 1e3:>12.2f} {med[i] / med[best]:>8.3f}{mark}")
        print(f"single-phase (biased): tuned / best fixed {med[tuned] / med[best]:.3f}   default / best fixed "
              f"{med[default] / med[best]:.3f}   tuned / its twin in the grid (noise) {med[tuned] / med[twin]:.3f}"
              f"   tuned ranks {fixed.index(twin) + 1} of {len(grid)}")
        print(f"\nconfirmation, {args.confirm} fresh rounds, interleaved:")
        for j, (label, s, m) in enumerate(conf):
            print(f"{label:>10} {kib(s, m):>18} {np.median(con[:, j]) * 1e3:>8.2f} ms  vs selected best "
                  f"{np.median(con[:, j] / con[:, c_best]):.3f}")
        for name, r in ratios.items():
            print(f"{name:>36}: {r['median']:.3f}  quartiles {r['q25']:.3f}-{r['q75']:.3f}  "
                  f"95% interval of the median {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"n": n, "sizes": SIZES, "picks": picks, "calibration_s": [c.seconds for c in choices],
                           "picks_without_recheck": plain_picks, "calibration_s_without": [c.seconds for c in plain],
                           "selection": {"rounds": args.rounds, "rows": [
                               {"setting": settings[i][0], "segment": settings[i][1], "small": settings[i][2],
                                "seconds": med[i], "samples": [r[i] for r in sel]} for i in range(len(settings))]},
                           "confirmation": {"rounds": args.confirm, "ratios": ratios, "rows": [
                               {"setting": c[0], "segment": c[1], "small": c[2], "samples": con[:, j].tolist()}
                               for j, c in enumerate(conf)]}}, f, indent=1)
    rr.shutdown()


if __name__ == "__main__":
    main()
