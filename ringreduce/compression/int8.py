"""8-bit quantisation with a scale agreed across ranks, so the ring still
sums the int8 values in place (a quarter of float32's bytes).

Per bucket: one small max allreduce agrees each tensor's scale, the largest
|grad + error| on any rank; each rank rounds its values to L = 127 // N
levels of that scale, so the sum of N ranks' values lies in [-127, 127] and
int8 cannot overflow on the ring; the int8 sum is exact, and the same on
every rank. What rounding lost stays behind as error feedback for the next
step. The price of no overflow is resolution: 63 levels at N = 2, 15 at
N = 8; error feedback carries what rounding drops into later steps. Past
127 ranks (L would be 0) the values travel as int16 with 32767 // N levels.
"""
from __future__ import annotations

import numpy as np

from .. import collectives as _c
from .base import Compressor


class Int8(Compressor):
    name = "int8"

    def _reduce(self, items, n_ranks, group, label):
        wire, limit = (np.int8, 127) if n_ranks <= 127 else (np.int16, 32767)
        levels = limit // n_ranks
        vals = []
        for key, a, state in items:  # each v our own copy: rounded and turned into the error in place
            err = state.get("error")
            vals.append(a.reshape(-1) + err if err is not None else a.reshape(-1).copy())
        peaks = np.array([max(v.max(), -v.min()) if v.size else 0.0 for v in vals], dtype=np.float64)
        peaks[~np.isfinite(peaks)] = np.inf  # a NaN or inf anywhere: agreed by the max, never quantised
        scales = _c.allreduce(peaks, op="max", name=f"{label}/int8.scale", process_set=group)
        scales = np.where(scales > 0, scales, 1.0)
        qs = []
        for v, s in zip(vals, scales):
            if not np.isfinite(s):  # no scale: send zeros, the result is NaN (as an exact sum would not be finite)
                qs.append(np.zeros(v.size, wire))
                continue
            t = v * v.dtype.type(levels / s)
            qs.append(np.rint(t, out=t).astype(wire))
        total = _c.allreduce(np.concatenate(qs), op="sum", name=f"{label}/int8", process_set=group)
        out, at = [], 0
        for (key, a, state), v, q, s in zip(items, vals, qs, scales):
            if not np.isfinite(s):
                out.append(np.full(q.size, np.nan, a.dtype))  # its state is rolled back (Compressor.reduce_bucket)
                at += q.size
                continue
            step = a.dtype.type(s / levels)
            sent = q.astype(a.dtype)
            sent *= step
            v -= sent  # what rounding lost: sent next step
            state["error"] = v
            part = total[at:at + q.size].astype(a.dtype)
            part *= step
            out.append(part)
            at += q.size
        return out
