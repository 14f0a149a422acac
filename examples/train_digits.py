"""Data-parallel softmax regression on scikit-learn's digits, over ringreduce.

    ringrun -np 4 python examples/train_digits.py

Every rank trains on its own shard of the training set; gradients are averaged
with rr.allreduce(op="avg") each step, so all ranks keep identical weights.
Rank 0 prints the test accuracy and the ring's measured bandwidth.
"""
import sys
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringreduce as rr

EPOCHS, BATCH, LR = 30, 32, 0.5


def softmax_grad(w, x, y_onehot):
    logits = x @ w
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return x.T @ (p - y_onehot) / len(x)


def measure_bandwidth(nbytes, iters=5):
    """busbw in GB/s (nccl-tests convention) of an allreduce of nbytes."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    out = np.empty_like(x)
    rr.allreduce(x, out=out)
    times = []
    for _ in range(iters):
        rr.barrier()
        t = time.perf_counter()
        rr.allreduce(x, out=out)
        times.append(time.perf_counter() - t)
    seconds = float(rr.allreduce(np.array([np.median(times)]), op="max")[0])
    algbw = nbytes / seconds / 1e9
    return algbw * 2 * (rr.size() - 1) / rr.size(), seconds


def main():
    rr.init()
    rank, size = rr.rank(), rr.size()
    digits = load_digits()
    x = digits.data / 16.0
    x = np.hstack([x, np.ones((len(x), 1))])  # bias column
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0)
    shard = slice(rank, None, size)  # disjoint shards
    xs, ys = x_train[shard], np.eye(10)[y_train[shard]]

    w = rr.broadcast(np.random.default_rng(rank).normal(0, 0.01, (x.shape[1], 10)), root=0)
    steps = len(xs) // BATCH
    comm_seconds, t0 = 0.0, time.perf_counter()
    for epoch in range(EPOCHS):
        order = np.random.default_rng(epoch * size + rank).permutation(len(xs))
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            g = softmax_grad(w, xs[idx], ys[idx])
            t = time.perf_counter()
            g = rr.allreduce(g, op="avg")
            comm_seconds += time.perf_counter() - t
            w -= LR * g
    train_seconds = time.perf_counter() - t0

    accuracy = float((np.argmax(x_test @ w, axis=1) == y_test).mean())
    drift = float(rr.allreduce(np.array([np.abs(w - rr.broadcast(w, root=0)).max()]), op="max")[0])
    bw = {mib: measure_bandwidth(mib << 20) for mib in (16, 64)}
    if rank == 0:
        print(f"{size} ranks, {EPOCHS} epochs of {steps} steps: test accuracy {accuracy:.3f}")
        print(f"training took {train_seconds:.2f} s, {comm_seconds:.2f} s of it in allreduce "
              f"({EPOCHS * steps} allreduces of {w.nbytes} bytes)")
        print(f"throughput: {EPOCHS * steps * BATCH * size / train_seconds:.0f} samples/s")
        for mib, (busbw, seconds) in bw.items():
            print(f"ring allreduce of {mib} MiB float32: {seconds * 1e3:.1f} ms, busbw {busbw:.2f} GB/s")
        print(f"weights identical on every rank: {drift == 0.0}")
    ok = drift == 0.0 and accuracy > 0.9
    rr.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
