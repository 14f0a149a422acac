"""Top-k sparsification: each rank sends only its k = ceil(ratio * size)
largest |grad + error| entries, as (index, value) pairs gathered from every
rank (an allgather: the ranks' supports differ, so there is nothing to sum
in place); every rank adds them up in rank order, so all get the same sum.
What was not sent stays behind as error feedback, and goes out once it has
grown large enough. The bytes each rank sends grow with N (it forwards
every rank's pairs), so top-k pays where ratio is small. Values travel in
the tensor's precision (float32; float64 as float64, else its low bits
would be lost for good, not fed back). Indices travel as int32, or as
int64 in a tensor of more than 2**31 elements, whose last indices int32
cannot hold (every rank has the same shape, so all choose alike).
"""
from __future__ import annotations

import math

import numpy as np

from ..core import collectives as _c
from .base import Compressor


# One more than the largest index an int32 holds: a tensor of more elements
# sends int64 indices (a module constant, so tests can lower it).
INT32_INDEX_LIMIT = 2**31


def index_dtype(size: int) -> np.dtype:
    """The dtype of a top-k index into a flat tensor of `size` elements."""
    return np.dtype(np.int32 if size <= INT32_INDEX_LIMIT else np.int64)


def pack(idx: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """One rank's pairs as int32 words: the indices (int32, or int64 as two
    words each, see index_dtype), then the values' bytes."""
    return np.concatenate([idx.astype(index_dtype(size)).view(np.int32), values.view(np.int32)])


def unpack(words: np.ndarray, k: int, size: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """pack()'s (indices, values) back from its words."""
    n_idx = k * index_dtype(size).itemsize // 4
    return words[:n_idx].view(index_dtype(size)), words[n_idx:].view(dtype)


class TopK(Compressor):
    name = "topk"

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        if not (0 < ratio <= 1):
            raise ValueError(f"top-k ratio must be in (0, 1], not {ratio!r}")
        self.ratio = float(ratio)

    def params(self) -> dict:
        return {"ratio": self.ratio}

    def _reduce(self, items, n_ranks, group, label):
        vals, picks, packs = [], [], []
        for key, a, state in items:  # a: float32, or float64 (its values then travel as float64)
            err = state.get("error")  # v our own copy: it becomes the error in place
            v = np.add(a.reshape(-1), err, dtype=a.dtype) if err is not None else a.reshape(-1).copy()
            k = min(v.size, max(1, math.ceil(self.ratio * v.size)))
            idx = np.sort(np.argpartition(np.abs(v), v.size - k)[v.size - k:])
            vals.append(v)
            picks.append(idx)
            packs.append(pack(idx, v[idx], v.size))  # one int32 buffer: indices, values
        gathered = _c.allgather(np.concatenate(packs), name=f"{label}/topk", process_set=group)
        per_rank = gathered.reshape(n_ranks, -1)
        out = []
        at = 0
        for (key, a, state), v, idx in zip(items, vals, picks):
            k = idx.size
            words = k * (index_dtype(v.size).itemsize + v.itemsize) // 4
            total = np.zeros(v.size, dtype=v.dtype)
            for r in range(n_ranks):  # rank order: the same float additions on every rank
                np.add.at(total, *unpack(per_rank[r, at:at + words], k, v.size, v.dtype))
            v[idx] = 0  # sent: what is left waits for a later step
            state["error"] = v
            out.append(total)
            at += words
        return out
