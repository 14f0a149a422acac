"""A custom training loop with balanced batches: softmax regression on
synthetic data, one rank slower than the others (an added sleep per sample,
standing in for a slower machine), with equal shares of the global batch or
shares moved toward each rank's measured speed (ringreduce.balance).

    ringrun -np 3 python examples/balanced_batches.py --mode balanced

Every step is one global batch of GLOBAL rows: rank r computes the mean
gradient of its share's rows, and rr.allreduce(op="avg", weight=share)
makes it the gradient of the whole global batch, so equal and balanced
shares train the same model (up to float rounding); only the wall time
differs. Prints, on rank 0, one JSON line: the time and steps to the target
accuracy, and the final accuracy.
"""
import argparse
import json
import time

import numpy as np

import ringreduce as rr
from ringreduce.balance import BatchBalancer

FEATURES, CLASSES = 32, 8


def synthetic(rows: int, seed: int):
    """A learnable task: classes from a fixed random linear map, with label noise (every rank makes the same)."""
    rng = np.random.default_rng(seed)
    truth = np.random.default_rng(1234).standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    logits = x @ truth + rng.gumbel(size=(rows, CLASSES)) * 1.0
    return x, logits.argmax(axis=1)


def gradient(w, x, y):
    """Mean cross-entropy gradient of a softmax regression over the rows given."""
    z = x @ w
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(x)


def accuracy(w, x, y) -> float:
    return float(np.mean((x @ w).argmax(axis=1) == y))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["equal", "balanced"], default="balanced")
    ap.add_argument("--global-batch", type=int, default=240)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--target", type=float, default=0.82, help="test accuracy to reach")
    ap.add_argument("--ms-per-sample", type=float, default=1.0, help="compute stand-in: sleep per row, every rank")
    ap.add_argument("--slowdown", type=float, default=2.0, help="the last rank's compute is this many times slower")
    ap.add_argument("--every", type=int, default=10, help="steps between rebalances")
    ap.add_argument("--lr", type=float, default=0.5)
    args = ap.parse_args()

    rr.init()
    n, r = rr.size(), rr.rank()
    x, y = synthetic(60000, seed=0)
    x_test, y_test = synthetic(4000, seed=1)
    w = np.zeros((FEATURES, CLASSES), np.float32)
    every = args.every if args.mode == "balanced" else 10 ** 9  # equal: the shares never move
    bal = BatchBalancer(args.global_batch, every=every, smoothing=0.5)
    slow = args.slowdown if r == n - 1 else 1.0
    steps_per_epoch = len(x) // args.global_batch
    order = np.random.default_rng(7).permutation(len(x))
    reached = None
    rr.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        k = step % steps_per_epoch
        lo, hi = bal.rows(k)
        rows = order[lo:hi]
        with bal.measure():  # compute only: the allreduce's wait for slower ranks is not counted
            g = gradient(w, x[rows], y[rows])
            time.sleep(args.ms_per_sample * 1e-3 * slow * len(rows))
        g = rr.allreduce(g, op="avg", weight=len(rows))  # the global batch's mean gradient
        w -= args.lr * g
        bal.step()
        if reached is None and step % 5 == 4 and accuracy(w, x_test, y_test) >= args.target:
            reached = (step + 1, time.perf_counter() - start)  # the same weights, so the same step, on every rank
    total = time.perf_counter() - start
    if r == 0:
        print(json.dumps({"mode": args.mode, "ranks": n, "steps": args.steps, "seconds": total,
                          "target": args.target, "steps_to_target": reached and reached[0],
                          "seconds_to_target": reached and reached[1], "final_accuracy": accuracy(w, x_test, y_test),
                          "final_shares": list(bal.shares), "changes": len(bal.history) - 1}), flush=True)


if __name__ == "__main__":
    main()
