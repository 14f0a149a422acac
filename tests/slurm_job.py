"""A data-parallel job for the Slurm tests: softmax regression on scikit-learn's
digits (examples/train_digits.py's model), a few epochs. Each rank writes
its final weights and where it ran to OUT/rank<N>.npz.

    srun -n 4 python tests/slurm_job.py OUT      # or ringrun -np 4 ...
"""
import os
import sys

import numpy as np
from sklearn.datasets import load_digits

import ringreduce as rr
from ringreduce.core.world import discover

SOURCE = ""

EPOCHS, BATCH, LR = 3, 32, 0.5


def main(out):
    global SOURCE
    SOURCE = discover().source  # what formed the world: "srun", "RINGREDUCE_* environment", ...
    rr.init()
    rank, size = rr.rank(), rr.size()
    digits = load_digits()
    x = np.hstack([digits.data / 16.0, np.ones((len(digits.data), 1))])
    xs, ys = x[rank::size], np.eye(10)[digits.target[rank::size]]
    w = rr.broadcast(np.random.default_rng(rank).normal(0, 0.01, (x.shape[1], 10)), root=0)
    for epoch in range(EPOCHS):
        order = np.random.default_rng(epoch * size + rank).permutation(len(xs))
        for s in range(len(xs) // BATCH):
            idx = order[s * BATCH:(s + 1) * BATCH]
            logits = xs[idx] @ w
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            w -= LR * rr.allreduce(xs[idx].T @ (p - ys[idx]) / len(idx), op="avg")
    np.savez(os.path.join(out, f"rank{rank}.npz"), w=w, size=size, local_rank=rr.local_rank(),
             local_size=rr.local_size(), node=os.environ.get("SLURMD_NODENAME", ""),
             source=SOURCE)
    rr.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
