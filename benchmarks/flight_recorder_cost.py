"""What the flight recorder (ringreduce/core/flight_recorder.py) costs a small allreduce.

    python benchmarks/flight_recorder_cost.py                  # starts 2 ranks under ringrun
    python benchmarks/flight_recorder_cost.py --np 4 --bytes 64,4096 --rounds 40
    python benchmarks/flight_recorder_cost.py --keras          # a Keras training step instead
    ringrun -np 2 python benchmarks/flight_recorder_cost.py    # the same, started by hand

Small allreduces are all latency (the fast path makes one C call of a few
microseconds), so they show the recorder's per-call Python work at its
largest. Within one run the recorder is switched on (K = 2000, the default)
and off (K = 0) in alternating rounds of `--iters` back-to-back allreduces,
every rank alike, so load on the machine hits both the same; each round is
fenced by a barrier. Rank 0 prints, per size, the median microseconds per
allreduce over the rounds with the recorder on and off, and on / off (1.00:
free). Run it on a quiet machine: it measures a few hundred nanoseconds.

--keras measures what the issue's target is about, a training step: a Keras
MLP (64-256-256-10, batch 32) compiled with ringreduce.tensorflow's
DistributedOptimizer (its gradients through the engine: an enqueued entry per
tensor and one fused allreduce per step), `--iters` train_on_batch steps per
round, the recorder on and off alternating as above; rank 0 prints the median
milliseconds per step and on / off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks (when this script starts ringrun itself)")
    p.add_argument("--bytes", default="64,4096", help="allreduce sizes in bytes, comma-separated")
    p.add_argument("--iters", type=int, default=2000, help="allreduces per round")
    p.add_argument("--rounds", type=int, default=20, help="rounds per setting (on and off alternate)")
    p.add_argument("--keras", action="store_true", help="time Keras training steps (--iters steps per round)")
    return p.parse_args()


def main() -> int:
    args = parse()
    if "RINGREDUCE_RANK" not in os.environ:  # not under ringrun yet: start the ranks
        return subprocess.call([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", str(args.np),
                                sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    import ringreduce as rr
    from ringreduce.core import flight_recorder
    if args.keras:
        return keras_steps(args)
    rr.init()
    from ringreduce import engine as E
    rows = []
    for nbytes in (int(b) for b in args.bytes.split(",")):
        x = np.ones(max(1, nbytes // 4), np.float32)
        out = np.empty_like(x)

        def direct():
            rr.allreduce(x, out=out, name="bench")

        rows.append(("direct", x.nbytes, *on_off(rr, flight_recorder, direct, args)))
    # The engine's path, as DistributedOptimizer takes it: a step's gradients (here 6, as the
    # Keras MLP of --keras has) enqueued one by one, fused into one allreduce, waited on.
    eng = E.engine()
    grads = [np.ones(256, np.float32) for _ in range(6)]

    def step():
        for h in [eng.enqueue(f"grad/{i}", g, op="sum") for i, g in enumerate(grads)]:
            eng.wait(h)

    rows.append(("engine step of 6", sum(g.nbytes for g in grads), *on_off(rr, flight_recorder, step, args)))
    flight_recorder.configure(flight_recorder.DEFAULT_CAPACITY)
    if rr.rank() == 0:
        print(f"flight recorder cost: {rr.size()} ranks, {args.iters} calls x {args.rounds} rounds per setting "
              "(median us per call, slowest rank)")
        print(f"{'path':<17} {'bytes':>8} {'on us':>9} {'off us':>9} {'on-off us':>9} {'on/off':>7}")
        for path, nbytes, on_us, off_us in rows:
            print(f"{path:<17} {nbytes:>8} {on_us:>9.2f} {off_us:>9.2f} {on_us - off_us:>9.2f} {on_us / off_us:>7.3f}")
    rr.shutdown()
    return 0


def on_off(rr, flight_recorder, call, args) -> tuple[float, float]:
    """(us per call with the recorder on, off): medians over alternating rounds, the slowest rank's."""
    for _ in range(200):  # warm: plans made, the fast path taken (a Keras step traced)
        call()
    times = {True: [], False: []}
    for r in range(2 * args.rounds):
        on = r % 4 in (0, 3)  # on, off, off, on: neither setting always goes first
        flight_recorder.configure(flight_recorder.DEFAULT_CAPACITY if on else 0)
        rr.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            call()
        times[on].append((time.perf_counter() - t0) / args.iters * 1e6)
    slowest = rr.allgather(np.array([[statistics.median(times[True]), statistics.median(times[False])]]))
    on_us, off_us = slowest.max(axis=0)
    return float(on_us), float(off_us)


def keras_steps(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import ringreduce as rr
    import ringreduce.tensorflow as rrtf
    from ringreduce.core import flight_recorder
    rrtf.init()
    rng = np.random.default_rng(rr.rank())
    x = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    on_us, off_us = on_off(rr, flight_recorder, lambda: model.train_on_batch(x, y), args)
    on_ms, off_ms, iters = on_us / 1e3, off_us / 1e3, args.iters
    flight_recorder.configure(flight_recorder.DEFAULT_CAPACITY)
    if rr.rank() == 0:
        print(f"flight recorder cost: {rr.size()} ranks, Keras MLP 64-256-256-10 batch 32, DistributedOptimizer, "
              f"{iters} steps x {args.rounds} rounds per setting (median ms per step, slowest rank)")
        print(f"{'on ms':>9} {'off ms':>9} {'on/off':>7}")
        print(f"{on_ms:>9.3f} {off_ms:>9.3f} {on_ms / off_ms:>7.3f}")
    rr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
