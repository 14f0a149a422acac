"""Inputs and numpy references for the correctness tests, shared by the test
process and the ranks (each rank builds every rank's input from the seed, so
it can check its own result against numpy)."""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]

# Ops that only move bytes (allgather, broadcast, alltoall) take these too; a
# reduction refuses them with a TypeError naming the dtype.
MOVABLE_ONLY = ["bool", "uint32", "uint64", "complex64", "complex128", "S4", "U3", "datetime64[ms]",
                "V7", "[('a', '<i4'), ('b', '<f8')]", "{'names': ['x'], 'formats': ['<u2'], 'itemsize': 6}"]
MOVABLE = DTYPES + MOVABLE_ONLY


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if name.startswith(("[", "{")):
        return np.dtype(eval(name))  # a structured dtype's spec, from the list above
    return np.dtype(name)


def dtypes_every_rank_holds(rr, holds, dtypes=DTYPES) -> list:
    """The dtypes of `dtypes` that holds(name) is true for on every rank
    (collective: every rank calls it at the same point, over the host ring),
    in order: a case one rank leaves out and another runs would put the
    ranks' collectives out of step, so every rank leaves out what any
    rank's array library cannot hold (cupy without bfloat16, say)."""
    mine = np.array([1 if holds(name) else 0 for name in dtypes], dtype=np.int32)
    every = rr.allreduce(mine, op="min")
    return [name for name, held in zip(dtypes, every) if held]


def any_bytes(shape, dtype: str, seed) -> np.ndarray:
    """Arbitrary bytes of dtype (bools kept 0/1): byte-moving ops must carry
    every bit, NaN payloads and padding included."""
    dt = np_dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, count * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw &= 1
    return raw.view(dt).reshape(shape)


def alltoall_input(rank: int, splits, trailing, dtype: str, case: int) -> np.ndarray:
    """Rank `rank`'s input for an alltoall with these splits."""
    return any_bytes((int(sum(splits)),) + tuple(trailing), dtype, [rank, case, MOVABLE.index(dtype)])


def alltoall_reference(inputs: list, splits: list, rank: int) -> np.ndarray:
    """What `rank` receives: from every origin o, its rows addressed to rank,
    concatenated in origin order. Done on the bytes: numpy copies a padded
    structured dtype field by field, leaving its padding behind."""
    pieces = []
    for o, x in enumerate(inputs):
        start = int(sum(splits[o][:rank]))
        row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        rows = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8).reshape(x.shape[0], row_bytes)
        pieces.append(rows[start:start + splits[o][rank]])
    return np.concatenate(pieces).reshape(-1).view(inputs[0].dtype).reshape((-1,) + inputs[0].shape[1:])


def sizes(n: int) -> list:
    """0, 1, fewer than ranks, not divisible by N, above the small-message
    threshold (so the ring runs), and a 3-d shape."""
    return [0, 1, max(n - 1, 0), 2 * n + 1, 70_001, (3, 5, 7)]


def make_input(rank: int, shape, dtype: str, op: str) -> np.ndarray:
    """Small integers, exact in every dtype, so sums, products, min and max are
    exact whatever order the ring reduces in; integer overflow wraps the same
    way in numpy and in ringreduce."""
    count = int(np.prod(shape))
    rng = np.random.default_rng([rank, count, DTYPES.index(dtype), OPS.index(op)])
    if op == "prod":
        values = rng.choice([-1, 1, 2], size=count) if np_dtype(dtype).kind != "u" else rng.choice([1, 2, 3], size=count)
    elif np_dtype(dtype).kind == "u":
        values = rng.integers(0, 30, size=count)
    else:
        values = rng.integers(-20, 21, size=count)
    return values.reshape(shape).astype(np_dtype(dtype))


def reference(inputs: list, dtype: str, op: str) -> np.ndarray:
    dt = np_dtype(dtype)
    n = len(inputs)
    if dt.kind in "iu":
        stack = np.stack(inputs)
        with np.errstate(over="ignore"):
            if op in ("sum", "avg"):
                total = stack.sum(axis=0, dtype=dt)
                return total // dt.type(n) if op == "avg" else total
            if op == "prod":
                return stack.prod(axis=0, dtype=dt)
        return stack.min(axis=0) if op == "min" else stack.max(axis=0)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    out = {"sum": lambda: stack.sum(0), "avg": lambda: stack.sum(0) / n, "prod": lambda: stack.prod(0),
           "min": lambda: stack.min(0), "max": lambda: stack.max(0)}[op]()
    return out.astype(dt)


def ulp16(v, dtype: str) -> np.ndarray:
    """The spacing of 16-bit floats (float16, bfloat16) at |v|, as float64."""
    mbits, emin = (10, -14) if dtype == "float16" else (7, -126)
    exp = np.frexp(np.abs(np.asarray(v, dtype=np.float64)))[1] - 1
    return np.ldexp(1.0, np.maximum(exp, emin) - mbits)


def mean_error_bound(inputs: list, dtype: str) -> np.ndarray:
    """How far a 16-bit average may be from the exact mean: the final rounding
    (half an ulp of the result, one here for the reference's own rounding),
    plus each earlier fold's rounding of a running mean no larger than the
    largest input M, carried forward with weight k/N: at most (N-1)/4 ulp(M)
    (docs/architecture.md). N = 2 has no earlier fold: correctly rounded."""
    n = len(inputs)
    big = np.max(np.abs(np.stack([x.astype(np.float64) for x in inputs])), axis=0)
    mean = np.mean(np.stack([x.astype(np.float64) for x in inputs]), axis=0)
    return ulp16(mean, dtype) + (n - 1) / 4 * ulp16(big, dtype)


def close_enough(got: np.ndarray, want: np.ndarray, dtype: str, op: str, inputs: list | None = None) -> bool:
    """Exact, except avg of floats: float32/64 divide once, so they may differ
    from numpy's float64 division by one unit in the last place; 16-bit floats
    average as running means, within mean_error_bound of the exact mean."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if op == "avg" and dtype in ("float16", "bfloat16") and inputs is not None:
        exact = np.mean(np.stack([x.astype(np.float64) for x in inputs]), axis=0)
        return bool(np.all(np.abs(got.astype(np.float64) - exact) <= mean_error_bound(inputs, dtype)))
    if op == "avg" and np_dtype(dtype).kind == "f":
        eps = float(np.finfo(np.float16).eps) if dtype == "float16" else (
            2.0 ** -7 if dtype == "bfloat16" else float(np.finfo(np_dtype(dtype)).eps))
        g, w = got.astype(np.float64), want.astype(np.float64)
        return bool(np.all(np.abs(g - w) <= eps * np.maximum(np.abs(w), 1e-3)))
    return got.tobytes() == want.tobytes()


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def check_all_allreduce(rr) -> dict:
    """Runs every (dtype, op, size) allreduce on this rank; returns, per case,
    whether it matched numpy and a digest of the result bytes."""
    n, r = rr.size(), rr.rank()
    out = {}
    for dtype in DTYPES:
        for op in OPS:
            for shape in sizes(n):
                shape = shape if isinstance(shape, tuple) else (shape,)
                inputs = [make_input(i, shape, dtype, op) for i in range(n)]
                got = rr.allreduce(inputs[r], op=op)
                ok = close_enough(got, reference(inputs, dtype, op), dtype, op, inputs)
                out[(dtype, op, shape)] = (ok, digest(got), got.dtype.name, got.shape)
    return out
