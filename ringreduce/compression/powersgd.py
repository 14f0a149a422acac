"""PowerSGD (Vogels, Karimireddy, Jaggi 2019): a gradient matrix M (n x m)
travels as two thin factors, P = M Q (n x r) and Q = M^T P (m x r), one
power-iteration step per training step with Q warm-started from the last
step. Per step and tensor:

    M = grad + error                  (error feedback: what earlier steps lost)
    P = allreduce(M Q); orthonormalise P (numpy QR)
    Q = allreduce(M^T P)
    approx = P Q^T                    (the same on every rank)
    error = M - P (M^T P)^T           (what this rank's own projection missed,
                                       kept locally, added next step)

All P's of a bucket travel in one allreduce, then all Q's in one. A tensor
is compressed only when r (n + m) is at most half of n m (a 2x saving);
1-D tensors (biases), tensors under min_size elements and every tensor
during the first warmup_steps steps go uncompressed. Q starts from a seed
derived from the tensor's name, so it is the same on every rank; during the
warm-up it follows the exact sums by a power-iteration step each (locally,
no bytes), so compression starts from a warm Q.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..core import collectives as _c
from .base import Compressor, scope


def as_matrix(shape) -> tuple[int, int]:
    """A kernel of any rank as (everything but the last dim) x (the last dim):
    a Dense kernel (in, out) as itself, a conv kernel (h, w, in, out) as
    (h w in, out)."""
    return int(np.prod(shape[:-1])), int(shape[-1])


def _orthonormal(p):
    """P's QR factor with the signs fixed (R's diagonal >= 0): QR is unique
    only up to the sign of each column, and LAPACKs differ in the one they
    return; a rank whose P came back with other signs would project onto -P
    and the Q sum would be garbage (different results on different ranks)."""
    q, r = np.linalg.qr(p)
    signs = np.where(np.diagonal(r) < 0, -1, 1).astype(q.dtype)
    return q * signs


class PowerSGD(Compressor):
    name = "powersgd"

    def __init__(self, rank: int = 4, warmup_steps: int = 0, min_size: int = 4096):
        super().__init__()
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"PowerSGD rank must be a positive int, not {rank!r}")
        self.rank, self.warmup_steps, self.min_size = rank, int(warmup_steps), int(min_size)

    def params(self) -> dict:
        return {"rank": self.rank, "warmup_steps": self.warmup_steps, "min_size": self.min_size}

    def wire_tag(self, process_set, key: str, shape) -> str:
        """Past its warm-up a tensor is negotiated as warmup_steps=0: a joined
        rank's stand-in, fresh every step, then takes the factors path too
        (with the real warmup_steps it takes the plain one, as the others do)."""
        state = self._state.get((scope(process_set), key), {})
        step = (state.get("step", 0) if state.get("shape") == tuple(shape) else 0) + 1
        if self.warmup_steps and step > self.warmup_steps:
            return type(self)(self.rank, 0, self.min_size).tag
        return self.tag

    def compresses(self, shape) -> bool:
        """Whether a tensor of this shape travels as factors (after warm-up)."""
        if len(shape) < 2 or int(np.prod(shape)) < self.min_size:
            return False
        n, m = as_matrix(shape)
        r = min(self.rank, n, m)
        return 2 * r * (n + m) <= n * m

    def _reduce(self, items, n_ranks, group, label):
        out = [None] * len(items)
        low, plain = [], []
        for i, (key, a, state) in enumerate(items):
            state["step"] = state.get("step", 0) + 1
            (low if state["step"] > self.warmup_steps and self.compresses(a.shape) else plain).append(i)
        if plain:
            for i, s in zip(plain, self._plain_sum([items[i][1] for i in plain], group, f"{label}/powersgd.plain")):
                out[i] = s
                key, a, state = items[i]
                if self.compresses(a.shape):  # a warm-up step of a tensor that will travel as factors
                    state["q"] = self._warm_q(key, s.reshape(as_matrix(a.shape)), state.get("q"))
        if not low:
            return out
        mats, qs = [], []
        for i in low:
            key, a, state = items[i]
            rows, cols = as_matrix(a.shape)
            err = state.get("error")  # m our own copy: it becomes the error in place
            m = a.reshape(rows, cols) + err if err is not None else a.reshape(rows, cols).copy()
            q = state.get("q")
            if q is None:
                q = self._first_q(key, rows, cols, a.dtype)
            mats.append(m)
            qs.append(q)
        ps = [m @ q for m, q in zip(mats, qs)]
        ps = self._split(_c.allreduce(np.concatenate([p.reshape(-1) for p in ps]), op="sum",
                                      name=f"{label}/powersgd.P", process_set=group), [p.shape for p in ps])
        ps = [_orthonormal(p) for p in ps]  # the same on every rank (same input, signs made canonical)
        own_qs = [m.T @ p for m, p in zip(mats, ps)]
        qs = self._split(_c.allreduce(np.concatenate([q.reshape(-1) for q in own_qs]), op="sum",
                                      name=f"{label}/powersgd.Q", process_set=group), [q.shape for q in own_qs])
        for i, m, p, q, own_q in zip(low, mats, ps, qs, own_qs):
            total = p @ q.T  # the sum over ranks of each rank's projection
            state = items[i][2]
            state["q"] = q
            # error: what this rank's own projection missed (the paper's local decompression), not
            # m - total / N, which also holds this rank's distance from the mean: a random walk
            # that grows without bound and that a rank leaving (join) would take away from the sum
            m -= p @ own_q.T
            state["error"] = m
            out[i] = total
        return out

    def _first_q(self, key, rows, cols, dtype):
        """A random start, the same on every rank: seeded by the tensor's name."""
        rng = np.random.default_rng(zlib.crc32(key[1].encode()))
        return rng.standard_normal((cols, min(self.rank, rows, cols))).astype(dtype)

    def _warm_q(self, key, total, q):
        """One power-iteration step on a warm-up step's exact sum (the same on
        every rank, so no bytes travel): Q is warm when compression starts,
        its first factors already near the gradient's leading subspace, rather
        than a random projection that loses most of the first steps' gradient
        to the error (the loss jumped at the switch from a random Q)."""
        if q is None:
            q = self._first_q(key, *total.shape, total.dtype)
        return total.T @ _orthonormal(total @ q)

    @staticmethod
    def _split(flat, shapes):
        out, at = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            out.append(flat[at:at + size].reshape(shape))
            at += size
        return out
