"""One small allreduce at a time: direct (rr.allreduce) against the background
engine (what every TF op and gradient goes through), side by side in one run.

    ringrun -np 2 python benchmarks/engine_latency_bench.py [--bytes 4096] [--iters 200] [--tf]
"""
import argparse
import time

import numpy as np

import ringreduce as rr
from harness import isolated_median_us
from ringreduce.engine import engine

median_us = isolated_median_us


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tf", action="store_true", help="also the TF op (ringreduce.tensorflow.allreduce, eager)")
    args = parser.parse_args()
    rr.init()
    x = np.ones(args.bytes // 4, dtype=np.float32)
    eng = engine()
    rows = [("direct rr.allreduce", median_us(lambda: rr.allreduce(x), args.iters)),
            ("engine enqueue+wait", median_us(lambda: eng.wait(eng.enqueue("x", x, op="sum")), args.iters))]
    if args.tf:
        import tensorflow as tf
        import ringreduce.tensorflow as hvd
        t = tf.constant(x)
        rows.append(("TF eager hvd.allreduce", median_us(lambda: hvd.allreduce(t, op=hvd.Sum), args.iters)))
    if rr.rank() == 0:
        print(f"{rr.size()} ranks, {args.bytes} bytes, median of {args.iters} (a barrier before each)")
        for label, us in rows:
            print(f"  {label:24s} {us:9.1f} us   {us / rows[0][1]:5.1f}x direct")


if __name__ == "__main__":
    main()
