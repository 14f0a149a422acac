"""Small allreduces on one host: the host arena against the ring and MPICH.

    mpirun -np 4 python benchmarks/small_shm_bench.py [--sizes 4K,16K,64K,256K,1M] [--json out.json]

Under mpirun, ringreduce runs on its socket backend (bootstrapped over MPI,
as benchmarks/allreduce_bench.py's rr-socket), every rank on this host, and
MPI_Allreduce of the same MPICH runs beside it. For each size, in one run
and interleaved round by round so load drifts hit every column alike:

  MPI_Allreduce  mpi4py's comm.Allreduce
  arena          rr.allreduce through the host arena (forced, whatever the size),
                 reduced as the cost model chooses (RINGREDUCE_ARENA_REDUCE=auto)
  arena-copy     the same, reduced the first version's way (copy blob 0 out, fold
                 the others in; RINGREDUCE_ARENA_REDUCE=copy)
  arena-direct   every rank folds all N blobs straight into its output (=direct)
  arena-split    every rank folds its 1/N slice, a second round shares it (=split)
  arena-C        the `arena` pass called straight (Comm.allreduce_small): what Python adds
  old            today's path without the arena: the ring pass of blobs up to
                 the old small limit (RINGREDUCE_SMALL_BYTES / (N-1)), the ring above
  ring           the ring allreduce (header pass, then 2(N-1) steps), forced

Two timings: isolated (as benchmarks/harness.py isolated_median_us: a
barrier before each timed operation, as a training step meets its peers;
the slowest rank's median, and its 25th percentile, which on a loaded
machine shows the operation when both its ranks had a core) and
back-to-back (harness.measure). Rank 0 prints a
table and the ratios to MPI_Allreduce. On a machine loaded by other work,
pin the ranks (`mpirun -np 2 -bind-to core ...`): unpinned, two ranks often
share one core and neither column is what an idle machine shows
(docs/performance.md, "The host arena, one at a time"). The arena's slot is sized for the
largest size measured (RINGREDUCE_ARENA_BYTES), so the arena can be forced there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce.core import collectives as _c, config as _config  # noqa: E402

IMPLS = ["MPI_Allreduce", "arena", "arena-copy", "arena-direct", "arena-split", "arena-C", "old", "ring"]
MODES = {"arena": 1, "arena-copy": 2, "arena-direct": 3, "arena-split": 4}  # Comm.use_arena's (host_arena.h)


def parse_bytes(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def make_runs(count: int, comm_mpi):
    """name -> (setup, run, wrong): setup picks the path (the barriers before
    each timed operation take it too, as they would in a job), run does one
    operation, wrong counts wrong elements of its last result."""
    from mpi4py import MPI
    n, r = rr.size(), rr.rank()
    ring, comm = _c.communicator().ring, _c.communicator().comm
    x = np.full(count, r + 1, dtype=np.float32)
    out = np.empty_like(x)
    want = np.float32(n * (n + 1) // 2)
    results = {}
    old_limit = _config.Config.from_env().small_limit(n)
    head = _c.header(_c.ALLREDUCE, _core_sum(), _c.DTYPES[np.dtype(np.float32)], x.shape, None, True)  # as rr.allreduce

    def path(arena: int, limit: int):
        def setup():
            comm.use_arena(arena)
            ring.small_limit = limit
        return setup

    def rr_run(name):
        def run():
            results[name] = rr.allreduce(x)
        return run

    def arena_c():
        if comm.allreduce_small(head, x, out, _c.DTYPES[np.dtype(np.float32)], _core_sum()) is not None:
            raise RuntimeError("headers differ")
        results["arena-C"] = out

    def mpi():
        comm_mpi.Allreduce(x, out, op=MPI.SUM)
        results["MPI_Allreduce"] = out

    arena = path(MODES["arena"], 1 << 62)
    runs = {"MPI_Allreduce": (arena, mpi), "arena-C": (arena, arena_c),
            "old": (path(0, old_limit), rr_run("old")), "ring": (path(0, -1), rr_run("ring"))}
    runs.update({name: (path(mode, 1 << 62), rr_run(name)) for name, mode in MODES.items()})
    return {name: (setup, fn, (lambda name=name: int(np.count_nonzero(results[name] != want))))
            for name, (setup, fn) in runs.items()}


def isolated_us(fn, iters: int) -> list:
    """Microseconds of each of `iters` calls of fn, each right after a
    barrier (harness.isolated_median_us, every time kept)."""
    times = []
    for _ in range(iters):
        rr.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def _core_sum() -> int:
    return _c.OPS["sum"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size")
    p.add_argument("--iters", type=int, default=30, help="isolated operations per impl per round")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    os.environ.setdefault("RINGREDUCE_ARENA_BYTES", str(max(max(sizes), 256 << 10)))
    from mpi4py import MPI
    rr.init(backend="socket")
    comm_mpi, n, lead = MPI.COMM_WORLD, rr.size(), rr.rank() == 0
    if _c.communicator().comm.arena_slot == 0:
        raise SystemExit("no host arena: run every rank on this host (mpirun -np N on one machine)")
    ring = _c.communicator().ring
    default_limit = ring.small_limit
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        runs = make_runs(count, comm_mpi)
        iso = {name: [] for name in IMPLS}
        every = {name: [] for name in IMPLS}  # every isolated time, for the percentile
        sleeps = {name: 0 for name in IMPLS}  # voluntary context switches: waits that went to sleep
        for setup, fn, _ in runs.values():  # warm up every path
            setup()
            for _ in range(3):
                fn()
        for _ in range(args.rounds):
            for name in IMPLS:
                setup, fn, _ = runs[name]
                setup()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                times = isolated_us(fn, args.iters)
                iso[name].append(statistics.median(times))
                every[name] += times
                sleeps[name] += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
        for name in IMPLS:
            setup, fn, wrong = runs[name]
            setup()
            mine = statistics.median(iso[name])
            isolated, p25 = (float(v) for v in rr.allreduce(np.array([mine, np.percentile(every[name], 25)]),
                                                             op="max"))  # the slowest rank's
            b2b = harness.measure(harness.Impl(name, fn, wrong), "allreduce", nbytes, count, "float32", "sum",
                                  comm_mpi.Barrier if name == "MPI_Allreduce" else rr.barrier)
            per_op = sleeps[name] / (args.rounds * args.iters)
            rows.append({"impl": name, "bytes": nbytes, "isolated_us": isolated, "isolated_p25_us": p25,
                         "b2b_us": b2b.seconds * 1e6,
                         "wrong": b2b.wrong, "sleeps_per_op": float(rr.allreduce(np.array([per_op]), op="avg")[0])})
    _c.communicator().comm.use_arena(MODES["arena"])
    ring.small_limit = default_limit
    if lead:
        report(rows, n, sizes, default_limit)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"n": n, "rows": rows, "default_limit": default_limit}, f, indent=1)
    rr.shutdown()


def report(rows, n, sizes, limit):
    load = os.getloadavg()[0]
    print(f"# small allreduce, float32 sum, N={n}, {platform.node()}, {os.cpu_count()} cores, "
          f"load {load:.1f}, {time.strftime('%Y-%m-%d %H:%M')}; arena limit by default {limit} B")
    print(f"{'size':>7} | " + " | ".join(f"{name:>13}" for name in IMPLS)
          + " | arena/MPI iso | arena/MPI b2b | copy/MPI iso | direct/MPI iso | split/MPI iso")
    by = {(r["impl"], r["bytes"]): r for r in rows}
    for nbytes in sizes:
        cells = [f"{by[(m, nbytes)]['isolated_us']:6.1f}/{by[(m, nbytes)]['b2b_us']:6.1f}" for m in IMPLS]
        mpi = by[("MPI_Allreduce", nbytes)]
        arena = by[("arena", nbytes)]
        iso = {m: by[(m, nbytes)]["isolated_us"] / mpi["isolated_us"] for m in MODES}
        print(f"{nbytes >> 10:>6}K | " + " | ".join(f"{c:>13}" for c in cells) +
              f" | {iso['arena']:13.2f} | {arena['b2b_us'] / mpi['b2b_us']:13.2f} | {iso['arena-copy']:12.2f}"
              f" | {iso['arena-direct']:14.2f} | {iso['arena-split']:13.2f}")
    print("cells: isolated us / back-to-back us (slowest rank's median)")
    print("isolated, 25th percentile (us) and its ratio to MPI_Allreduce's:")
    for nbytes in sizes:
        mpi = by[("MPI_Allreduce", nbytes)]["isolated_p25_us"]
        print(f"{nbytes >> 10:>6}K | " + " | ".join(
            f"{m} {by[(m, nbytes)]['isolated_p25_us']:.1f} ({by[(m, nbytes)]['isolated_p25_us'] / mpi:.2f})"
            for m in IMPLS))
    print("sleeps per isolated op and rank (voluntary context switches, the barrier's included): " + ", ".join(
        f"{m} " + "/".join(f"{by[(m, b)]['sleeps_per_op']:.1f}" for b in sizes) for m in IMPLS))
    bad = [r for r in rows if r["wrong"]]
    if bad:
        print("WRONG RESULTS:", bad)


if __name__ == "__main__":
    main()
