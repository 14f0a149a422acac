"""What rr.allreduce's Python layer costs per call, the C call stubbed out.

    python benchmarks/python_layer_cost.py [--calls 200000] [--repeats 7]

One process, no peers: the world's ring is swapped for one of two ranks
whose Comm is a stub (its allreduce_small and try_allreduce_small return at
once), so what is timed is Python alone: the fast path (rr.allreduce of a
planned 4 KiB float32 sum), the checked path (collectives.allreduce_checked,
what every call took before the fast path), and the pieces of the checked
path one by one. Nanoseconds per call, the best of --repeats loops, the
empty loop's cost taken off; the stub's own call is in the two paths'
figures (a C call replaces it in a real run). The paths are timed in turn,
loop by loop, so load on the machine hits both alike.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringreduce as rr
from ringreduce import _core
from ringreduce.core import collectives as C


class _StubComm:
    small_rounds = 1

    @staticmethod
    def allreduce_small(head, src, dst, code, opc):
        return None

    try_allreduce_small = allreduce_small


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=7, help="timed loops per item (best kept)")
    args = p.parse_args()
    rr.init()  # a world of one: its ring is replaced below
    real = C.communicator().ring
    ring = C.communicator().ring = C.Ring(_StubComm(), 0, 2, real.small_limit, [0, 1])
    x = np.ones(1024, np.float32)
    out = np.empty_like(x)
    lock = C.communicator().lock

    def locked():
        with lock:
            pass

    items = {
        "fast path, out=": lambda: rr.allreduce(x, out=out),
        "fast path, new output": lambda: rr.allreduce(x),
        "checked path, out=": lambda: C.allreduce_checked(x, "sum", out, None, None),
        "checked path, new output": lambda: C.allreduce_checked(x, "sum", None, None, None),
        "  dtype and op codes": lambda: (C.DTYPES.get(x.dtype), C.OPS.get("sum")),
        "  out= checks (shape, byte order, writeable)": lambda: (
            type(out) is not np.ndarray or out.shape != x.shape or out.dtype.newbyteorder("=") != x.dtype
            or not out.flags.writeable),
        "  the lock (RLock)": locked,
        "  _ring(None)": lambda: C.ring_of(None),
        "  small? (allreduce_limit: property + C getter)": lambda: x.nbytes <= ring.allreduce_limit,
        "  header (lru_cache of 10 arguments)": lambda: C.header(C.ALLREDUCE, _core.SUM, _core.FLOAT32, x.shape,
                                                                 None, True),
        "  in-place and contiguity flags": lambda: (out.flags.c_contiguous and out.flags.writeable
                                                    and out.dtype == x.dtype, x.flags.c_contiguous),
        "  output: np.empty(shape, dtype)": lambda: np.empty(x.shape, dtype=x.dtype),
        "  fast: plan lookup (shape, dtype, op, name)": lambda: ring.plans.get((x.shape, x.dtype, "sum", None)),
        "stub call alone": lambda: ring.comm.try_allreduce_small(b"", x, out, 2, 0),
    }
    rr.allreduce(x, out=out)  # plans it
    best = {name: float("inf") for name in ["empty loop", *items]}
    fns = {"empty loop": lambda: None, **items}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.calls * 1e9)
    C.communicator().ring = real
    print(f"# rr.allreduce's Python layer, 4 KiB float32 sum, C call stubbed; ns per call (best of {args.repeats} "
          f"x {args.calls}), empty loop ({best['empty loop']:.0f} ns) taken off; load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for name in items:
        print(f"{name:50s} {best[name] - best['empty loop']:7.0f}")
    rr.shutdown()


if __name__ == "__main__":
    main()
