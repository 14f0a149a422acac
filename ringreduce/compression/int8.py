"""8-bit quantisation with scales agreed across ranks, so the ring still
sums the int8 values in place (a quarter of float32's bytes).

Scales are per block of `block` consecutive elements of each tensor (the
last block of a tensor may be shorter), not per tensor: one outlier then
coarsens only its own block, not the millions of values around it (as in
blockwise 8-bit optimizers and quantised collectives). Per bucket:

    peaks  = the largest |grad + error| of each block on this rank
    scales = allreduce_max(peaks)                (float32, 4 bytes per block)
    q      = rint(v * L / scale of its block)    L = 127 // N levels
    sum    = allreduce_sum(q)                     int8 on the ring, in place

The sum of N ranks' values lies in [-127, 127], so int8 cannot overflow on
the ring; the int8 sum is exact, and the same on every rank. What rounding
lost stays behind as error feedback for the next step. The price of no
overflow is resolution: 63 levels at N = 2, 15 at N = 8. Past 127 ranks
(L would be 0) the values travel as int16 with 32767 // N levels. Bytes on
the ring per element: 1 + 4 / block (0.4% more at block = 1024).

Rounding is to nearest, not stochastic: error feedback already carries
each rounding error into the next step, so nothing is biased over steps,
and stochastic rounding would only add variance to each step.
"""
from __future__ import annotations

import numpy as np

from ..core import collectives as _c
from .base import Compressor


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _block_peaks(v: np.ndarray, block: int) -> np.ndarray:
    """The largest |x| of each block of v (1-D); inf where a block holds a NaN or inf."""
    full = v.size // block
    head = v[:full * block].reshape(full, block)
    peaks = np.maximum(head.max(axis=1), -head.min(axis=1)) if full else np.zeros(0, v.dtype)
    if v.size > full * block:
        tail = v[full * block:]
        peaks = np.append(peaks, max(tail.max(), -tail.min()))
    peaks = peaks.astype(np.float32)  # a float64 peak past float32's range becomes inf: not quantised, as NaN
    peaks[~np.isfinite(peaks)] = np.inf  # a NaN or inf anywhere: agreed by the max, never quantised
    return peaks


def _scale_blocks(v: np.ndarray, block: int, factors: np.ndarray) -> None:
    """v (1-D) *= each block's factor, in place."""
    full = v.size // block
    v[:full * block].reshape(full, block)[...] *= factors[:full, None]
    if v.size > full * block:
        v[full * block:] *= factors[full]


class Int8(Compressor):
    name = "int8"

    def __init__(self, block: int = 1024):
        super().__init__()
        if not (isinstance(block, int) and block >= 1):
            raise ValueError(f"int8 block must be a positive int (elements per scale), not {block!r}")
        self.block = block

    def params(self) -> dict:
        return {"block": self.block}

    def _reduce(self, items, n_ranks, group, label):
        wire, limit = (np.int8, 127) if n_ranks <= 127 else (np.int16, 32767)
        levels = limit // n_ranks
        vals = []
        for key, a, state in items:  # each v our own copy: rounded and turned into the error in place
            err = state.get("error")
            vals.append(a.reshape(-1) + err if err is not None else a.reshape(-1).copy())
        counts = [_blocks(v.size, self.block) for v in vals]
        peaks = np.concatenate([_block_peaks(v, self.block) for v in vals])
        scales = _c.allreduce(peaks, op="max", name=f"{label}/int8.scale", process_set=group)
        scales[scales == 0] = 1.0  # a block of zeros on every rank: any step sends zeros
        per_tensor = np.split(scales, np.cumsum(counts)[:-1])
        qs = []
        for v, s in zip(vals, per_tensor):
            if not np.isfinite(s).all():  # no scale: send zeros; the result is NaN, as an exact sum is not finite
                qs.append(np.zeros(v.size, wire))
                continue
            t = v.copy()
            _scale_blocks(t, self.block, (levels / s.astype(np.float64)).astype(v.dtype))
            np.rint(t, out=t)
            np.clip(t, -levels, levels, out=t)  # a peak rounded down to float32 must not step past L
            qs.append(t.astype(wire))
        total = _c.allreduce(np.concatenate(qs), op="sum", name=f"{label}/int8", process_set=group)
        out, at = [], 0
        for (key, a, state), v, q, s in zip(items, vals, qs, per_tensor):
            if not np.isfinite(s).all():
                out.append(np.full(q.size, np.nan, a.dtype))  # its state is rolled back (Compressor.reduce_bucket)
                at += q.size
                continue
            steps = (s.astype(np.float64) / levels).astype(a.dtype)
            sent = q.astype(a.dtype)
            _scale_blocks(sent, self.block, steps)
            v -= sent  # what rounding lost: sent next step
            state["error"] = v
            part = total[at:at + q.size].astype(a.dtype)
            _scale_blocks(part, self.block, steps)
            out.append(part)
            at += q.size
        return out
