"""Small allreduces one at a time: ringreduce over MPI against MPI_Allreduce.

    mpirun -np 4 python benchmarks/small_bench.py
    mpirun -np 2 python benchmarks/small_bench.py --sizes 4K,64K --iters 300

A training step meets its peers once per step, so the time that matters for a
small tensor is one operation started right after a barrier ("isolated"), not
the mean of many back-to-back ones, which hides wake-up and skew. For every
size this times, interleaved in one run so load on the machine hits all
alike, float32 sums with:

  MPI_Allreduce   mpi4py's comm.Allreduce (MPICH)
  rr-<algorithm>  ringreduce over MPI with its small-message algorithm forced:
                  "arena" the host arena (what init() chooses when every rank
                  is on this host; its size limit), "doubling" recursive
                  doubling with the arena off (Comm.use_arena(0); what init()
                  chose before, with its limit), "ring" the ring's passes
                  (Comm.set_small_algorithm) and their limit
  checked-<alg>   the first algorithm through rr.allreduce's checked path
                  (collectives.allreduce_checked: every check, the lock, the
                  header looked up), what every call took before the fast path
  C-<algorithm>   with --c-call: Comm.allreduce_small called directly with a
                  ready header, the first algorithm: the C core without the
                  Python layer of rr.allreduce

isolated: median microseconds of one op after an MPI barrier (the same
barrier for every implementation); b2b: mean of `--b2b` back-to-back ops.
Each column is the slowest rank's. Rank 0 prints a table and the ratios to
MPI_Allreduce (below 1: faster than MPICH).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_bench import parse_bytes  # noqa: E402

import ringreduce as rr  # noqa: E402


def isolated_us(fn, comm, iters: int) -> float:
    """Median of one op after a barrier: harness.isolated_median_us with an
    MPI barrier, so every implementation is started the same way."""
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(np.median(times) * 1e6)


def b2b_us(fn, comm, iters: int) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4K,16K,64K,256K", help="comma-separated tensor sizes (K, M suffixes)")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated small algorithms of ringreduce to force (default: every one the build has)")
    p.add_argument("--iters", type=int, default=200, help="isolated ops per implementation and size")
    p.add_argument("--b2b", type=int, default=200, help="back-to-back ops per implementation and size")
    p.add_argument("--rounds", type=int, default=4, help="the iterations are split into this many interleaved rounds")
    p.add_argument("--c-call", action="store_true",
                   help="also time the C core's small allreduce called directly (no Python layer), sizes up to "
                        "the small limit")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rr.init(backend="mpi")
    n, rank = rr.size(), rr.rank()
    state = rr.core.communicator()
    ring = state.ring.comm
    config = state.world.config
    has_arena = ring.arena_slot > 0
    algorithms = args.algorithms.split(",") if args.algorithms else \
        (["arena"] * has_arena + (["doubling", "ring"] if ring.small_algorithm == "doubling" else ["ring"]))
    if "arena" in algorithms and not has_arena:
        raise SystemExit("no host arena: run every rank on this host, RINGREDUCE_ARENA_BYTES > 0")
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]

    def choose(algo):
        """The small path and its size limit, as init() would set them."""
        from ringreduce.core import shm
        if algo == "arena":
            ring.use_arena(shm.ARENA_MODES[config.arena_reduce])
            ring.set_small_algorithm("auto")
        else:
            ring.use_arena(0)
            ring.set_small_algorithm(algo)
        state.ring.small_limit = config.small_limit(n, algo == "arena")

    def impls(nbytes):
        x = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        want = np.float32(n * (n + 1) // 2)
        yield "MPI_Allreduce", (lambda: comm.Allreduce(x, out, op=MPI.SUM)), lambda: out
        for algo in algorithms:
            def run(algo=algo):
                rr.allreduce(x, out=out)
            yield f"rr-{algo}", run, lambda: out, algo
        from ringreduce.core import collectives
        yield f"checked-{algorithms[0]}", lambda: collectives.allreduce_checked(x, "sum", out, None, None), \
            lambda: out, algorithms[0]
        if args.c_call:  # the C core alone: what the Python layer adds is the difference
            from ringreduce import _core
            from ringreduce.core import collectives
            head = collectives.header(collectives.ALLREDUCE, _core.SUM, _core.FLOAT32, x.shape, None, True)
            yield f"C-{algorithms[0]}", lambda: ring.allreduce_small(head, x, out, _core.FLOAT32, _core.SUM), \
                lambda: out, algorithms[0]
        del want

    rows = {}
    for nbytes in sizes:
        entries = list(impls(nbytes))
        iso = {e[0]: [] for e in entries}
        b2b = {e[0]: [] for e in entries}
        for _ in range(args.rounds):
            for e in entries:
                name, fn = e[0], e[1]
                if len(e) > 3:
                    choose(e[3])
                for _ in range(3):
                    fn()
                if not np.all(e[2]() == np.float32(n * (n + 1) // 2)):
                    raise SystemExit(f"rank {rank}: {name} gave a wrong result at {nbytes} bytes")
                iso[name].append(isolated_us(fn, comm, max(args.iters // args.rounds, 1)))
                b2b[name].append(b2b_us(fn, comm, max(args.b2b // args.rounds, 1)))
        choose(algorithms[0])
        for e in entries:
            name = e[0]
            mine = np.array([np.median(iso[name]), np.median(b2b[name])])
            worst = np.empty_like(mine)
            comm.Allreduce(mine, worst, op=MPI.MAX)
            rows[(nbytes, name)] = worst
    if rank == 0:
        names = [e[0] for e in impls(sizes[0])]
        print(f"# small allreduce, float32 sum, N={n}, {platform.node()}, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
        print(f"# isolated: median us of one op after MPI_Barrier; b2b: mean us back to back; slowest rank")
        print(f"{'size':>8} {'impl':>17} {'isolated(us)':>13} {'b2b(us)':>9} {'iso/MPI':>8} {'b2b/MPI':>8}")
        for nbytes in sizes:
            ref = rows[(nbytes, "MPI_Allreduce")]
            for name in names:
                iso, bb = rows[(nbytes, name)]
                print(f"{nbytes:>8} {name:>17} {iso:>13.1f} {bb:>9.1f} {iso / ref[0]:>8.2f} {bb / ref[1]:>8.2f}")
    rr.shutdown()


if __name__ == "__main__":
    main()
