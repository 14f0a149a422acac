"""16-bit allreduce against float32 of the same element count, and the
kernels alone.

    ringrun -np 2 python benchmarks/dtype16_bench.py
    ringrun -np 4 python benchmarks/dtype16_bench.py --ops sum,avg
    ringrun -np 4 python benchmarks/dtype16_bench.py --ops avg --no-portable   # two builds, PYTHONPATH=...
    ringrun -np 4 python benchmarks/dtype16_bench.py --ops avg,sum --data random
    python benchmarks/dtype16_bench.py --kernels        # one process: G elements/s
    python benchmarks/dtype16_bench.py --kernels --level avx2

Sizes are float32 bytes (1-64 MiB); float16 and bfloat16 move half as many
bytes for the same count. The variants of one size run interleaved, repeat by
repeat, so load on the machine falls on all of them alike; time is the median
over repeats of the slowest rank's mean over back-to-back operations. Ratios
are to float32. "portable" rows force reduce.c's scalar 16-bit loops
(`_core.kernels16("portable")`) on every rank: the path before the vector
kernels, and the one a CPU without AVX2/F16C runs.

--data: "ranks" (the default) has rank r send r + 1 everywhere, so every
mean is 1, 1.5, 2, ... and #wrong counts elements off that exact value;
"random" sends normally distributed values (seeded by rank), as gradients
are, where 16-bit means often land exactly on rounding midpoints (the mean
folds' careful cases). #wrong then counts elements whose bits differ between
ranks plus those further from the float64 reduction of the 16-bit inputs
than N roundings of the type could put them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce import _core  # noqa: E402

MIB = 1 << 20
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CODES = {"float32": _core.FLOAT32, "float16": _core.FLOAT16, "bfloat16": _core.BFLOAT16}


def variants(best: str, portable: bool = True) -> list[tuple[str, str, str]]:
    """(label, dtype, 16-bit kernels) in the order they run."""
    out = [("float32", "float32", best), ("float16", "float16", best), ("bfloat16", "bfloat16", best)]
    if best != "portable" and portable:
        out += [("float16 portable", "float16", "portable"), ("bfloat16 portable", "bfloat16", "portable")]
    return out


HALF_ULP = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
BITS = {"float32": np.int32, "float16": np.int16, "bfloat16": np.int16}


def random_inputs(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)


def random_wrong(out: np.ndarray, name: str, op: str, n: int) -> int:
    """Elements whose bits differ between ranks, or off the float64 result by
    more than n roundings of the type (each at most half an ulp of a partial
    result, which is at most the sum of magnitudes)."""
    bits = out.view(BITS[name])
    differ = rr.allreduce(bits, op="max") != rr.allreduce(bits, op="min")
    ref, mag = np.zeros(out.size), np.zeros(out.size)
    for q in range(n):
        x = random_inputs(q, out.size).astype(DTYPES[name]).astype(np.float64)
        ref += x
        mag += np.abs(x)
    if op == "avg":
        ref /= n  # a partial mean is at most the sum of magnitudes too
    off = np.abs(out.astype(np.float64) - ref) > n * HALF_ULP[name] * 2 * mag
    return int(np.count_nonzero(differ | off))


def allreduce_table(mibs: list[int], ops: list[str], repeats: int, portable: bool = True,
                    data: str = "ranks") -> str:
    n, r = rr.size(), rr.rank()
    best = _core.kernels16()
    lines = [f"N = {n}, 16-bit kernels: {best}; data: {data}; sizes in MiB of float32; time in ms; ratio to float32",
             f"{'op':>4} {'MiB':>4} {'variant':>18} {'time(ms)':>9} {'x float32':>9} {'#wrong':>6}"]
    for op in ops:
        for mib in mibs:
            count = mib * MIB // 4
            iters = max(2, min(20, 256 // mib))
            runs, checks = {}, {}
            for label, name, kernels in variants(best, portable):
                dtype = DTYPES[name]
                out = np.empty(count, dtype=dtype)
                if data == "random":
                    x = random_inputs(r, count).astype(dtype)
                    checks[label] = lambda out=out, name=name: random_wrong(out, name, op, n)
                else:
                    x = np.full(count, r + 1, dtype=dtype)
                    want = dtype({"sum": n * (n + 1) // 2, "avg": (n + 1) / 2, "max": n, "min": 1}[op])
                    checks[label] = lambda out=out, want=want: int(np.count_nonzero(out != want))
                runs[label] = (kernels, lambda x=x, out=out: rr.allreduce(x, op=op, out=out))
            samples = {label: [] for label in runs}
            for rep in range(repeats + 1):  # the first round warms up
                for label, (kernels, run) in runs.items():
                    _core.kernels16(kernels)
                    rr.barrier()
                    t = time.perf_counter()
                    for _ in range(iters):
                        run()
                    if rep:
                        samples[label].append(harness.slowest((time.perf_counter() - t) / iters))
            _core.kernels16(best)
            base = statistics.median(samples["float32"])
            for label in runs:
                sec = statistics.median(samples[label])
                wrong = int(rr.allreduce(np.array([checks[label]()], np.int64), op="sum")[0])
                lines.append(f"{op:>4} {mib:>4} {label:>18} {sec * 1e3:>9.2f} {sec / base:>9.2f} {wrong:>6}")
    return "\n".join(lines)


def kernel_rate(fn, count: int, seconds: float = 0.3) -> float:
    """G elements/s of fn(), best of a few timed batches."""
    return harness.best_rate(fn, count, seconds)


def kernels_table(counts: list[int]) -> str:
    best = _core.kernels16()
    rng = np.random.default_rng(0)
    lines = [f"kernels alone, one process: G elements/s (dst = dst OP src), best of batches; vector level: {best}",
             f"{'elements':>9} {'kernel':>22} {'portable':>9} {best:>9} {'x portable':>10}"]
    for count in counts:
        base = rng.standard_normal(count).astype(np.float32)
        src32 = rng.standard_normal(count).astype(np.float32)
        dst32 = base.copy()
        f32 = kernel_rate(lambda: _core.reduce(dst32, src32, _core.FLOAT32, _core.SUM), count)
        lines.append(f"{count:>9} {'float32 sum':>22} {f32:>9.2f} {f32:>9.2f} {1.0:>10.2f}")
        numpy_add = kernel_rate(lambda: np.add(dst32, src32, out=dst32), count)
        lines.append(f"{count:>9} {'numpy float32 add':>22} {numpy_add:>9.2f} {numpy_add:>9.2f} {1.0:>10.2f}")
        for name in ("float16", "bfloat16"):
            dst, src = base.astype(DTYPES[name]), src32.astype(DTYPES[name])
            dst_u8 = dst.view(np.uint8)
            for kind, fn in (("sum", lambda: _core.reduce(dst_u8, src, CODES[name], _core.SUM)),
                             ("max", lambda: _core.reduce(dst_u8, src, CODES[name], _core.MAX)),
                             ("mean fold k=2", lambda: _core.mean_fold(dst_u8, src, CODES[name], 2)),
                             ("mean fold k=3", lambda: _core.mean_fold(dst_u8, src, CODES[name], 3)),
                             ("mean fold k=4", lambda: _core.mean_fold(dst_u8, src, CODES[name], 4))):
                rates = []
                for kernels in ("portable", best):
                    _core.kernels16(kernels)
                    rates.append(kernel_rate(fn, count))
                _core.kernels16(best)
                lines.append(f"{count:>9} {name + ' ' + kind:>22} {rates[0]:>9.2f} {rates[1]:>9.2f} "
                             f"{rates[1] / rates[0]:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="1,4,16,64", help="float32 MiB per allreduce, comma-separated")
    ap.add_argument("--ops", default="sum,avg")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernels", action="store_true", help="time the kernels alone, in this one process")
    ap.add_argument("--counts", default="65536,4194304", help="elements per kernel call, with --kernels")
    ap.add_argument("--level", help="16-bit vector kernels to compare with the portable ones (default: the best)")
    ap.add_argument("--no-portable", action="store_true",
                    help="leave out the portable rows (half the run; for comparing two builds' vector kernels)")
    ap.add_argument("--data", choices=("ranks", "random"), default="ranks",
                    help="ranks: rank r sends r + 1; random: normally distributed, as gradients (see above)")
    args = ap.parse_args()
    if args.level and _core.kernels16(args.level) != args.level:
        sys.exit(f"this CPU runs no {args.level} kernels")
    if args.kernels:
        print(kernels_table([int(c) for c in args.counts.split(",")]))
        return
    rr.init()
    table = allreduce_table([int(m) for m in args.mib.split(",")], args.ops.split(","), args.repeats,
                            not args.no_portable, args.data)
    if rr.rank() == 0:
        print(table, flush=True)
    rr.shutdown()


if __name__ == "__main__":
    main()
