"""One small allreduce at a time through each TensorFlow path, side by side in
one run: eager, tf.function (the blocking numpy_function hand-over), the
asynchronous op inside tf.function, and a TF1 Session (the asynchronous op).
Also 12 independent allreduces per step in a TF1 Session, started in opposite
orders on alternate ranks (the case the asynchronous op exists for).

    ringrun -np 2 python benchmarks/tf_op_paths_bench.py [--bytes 4096] [--iters 200]
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringreduce as rr  # noqa: E402
from harness import isolated_median_us  # noqa: E402
import ringreduce.tensorflow as hvd  # noqa: E402
from ringreduce.tensorflow.async_op import async_call  # noqa: E402
from ringreduce.tensorflow.ops import run_collective  # noqa: E402


def median_us(fn, iters: int) -> float:
    return isolated_median_us(fn, iters, warmup=5)  # warm-up: tracing, the engine's cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    hvd.init()
    r = rr.rank()
    x = tf.constant(np.ones(args.bytes // 4, dtype=np.float32))
    rows = [("eager", median_us(lambda: hvd.allreduce(x, op=hvd.Sum), args.iters))]

    blocking = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    rows.append(("tf.function, numpy_function", median_us(lambda: blocking(x), args.iters)))

    @tf.function
    def asynchronous(t):
        (out,) = async_call(lambda a: run_collective("async", a, "allreduce", None, op="sum"), [t], [t.dtype])
        return out
    rows.append(("tf.function, async op", median_us(lambda: asynchronous(x), args.iters)))

    with tf.Graph().as_default():
        one = hvd.allreduce(tf.constant(x.numpy()), op=hvd.Sum, name="one")
        order = range(12) if r % 2 == 0 else reversed(range(12))
        twelve = [hvd.allreduce(tf.constant(x.numpy()), op=hvd.Sum, name=f"many{i}") for i in order]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2)
        with tf.compat.v1.Session(config=config) as sess:
            rows.append(("TF1 Session, async op", median_us(lambda: sess.run(one), args.iters)))
            rows.append(("TF1 Session, 12 at once", median_us(lambda: sess.run(twelve), args.iters)))
    if r == 0:
        print(f"{rr.size()} ranks, {args.bytes} bytes, median of {args.iters} (a barrier before each)")
        for label, us in rows:
            print(f"  {label:28s} {us:9.1f} us   {us / rows[0][1]:5.2f}x eager")


if __name__ == "__main__":
    main()
