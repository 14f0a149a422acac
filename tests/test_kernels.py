"""The reduction kernels (csrc/reduce_math.h, reduce.c) against numpy, in
process: the same arithmetic the ring and the CUDA kernels use."""
import ml_dtypes
import numpy as np
import pytest

from ringreduce import _core

CODES = {"float16": _core.FLOAT16, "bfloat16": _core.BFLOAT16, "float32": _core.FLOAT32,
         "float64": _core.FLOAT64, "int8": _core.INT8, "uint8": _core.UINT8, "int32": _core.INT32,
         "int64": _core.INT64}
OPS = {"sum": _core.SUM, "prod": _core.PROD, "min": _core.MIN, "max": _core.MAX}
# Overflow to inf and NaN from inf * 0 are cases under test, not accidents.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NUMPY = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def dt(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def reduce(a, b, name, op):
    out = a.copy()
    _core.reduce(out.view(np.uint8), b.view(np.uint8).tobytes(), CODES[name], OPS[op])
    return out


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_floats_widen_exactly_for_every_bit_pattern(name):
    every = np.arange(1 << 16, dtype=np.uint16).view(dt(name))
    # max(x, x) widens to float32 and rounds back: must give x's bits back (NaNs stay NaN).
    got = reduce(every, every, name, "max")
    nan = np.isnan(every.astype(np.float32))
    assert got.view(np.uint16)[~nan].tobytes() == every.view(np.uint16)[~nan].tobytes()
    assert np.isnan(got[nan].astype(np.float32)).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_16_bit_floats_round_once_to_nearest_even(name, op):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=200_000, dtype=np.uint16)
    a, b = bits.view(dt(name)), rng.permutation(bits).view(dt(name))
    want = NUMPY[op](a.astype(np.float32), b.astype(np.float32)).astype(dt(name))  # numpy rounds to nearest even
    got = reduce(a, b, name, op)
    finite = np.isfinite(want.astype(np.float32))
    assert got.view(np.uint16)[finite].tobytes() == want.view(np.uint16)[finite].tobytes()
    assert (np.isnan(got.astype(np.float32)) == np.isnan(want.astype(np.float32))).all()


@pytest.mark.parametrize("name", list(CODES))
@pytest.mark.parametrize("op", list(OPS))
def test_kernels_match_numpy(name, op):
    rng = np.random.default_rng([list(CODES).index(name), list(OPS).index(op)])
    if dt(name).kind in "iu":
        info = np.iinfo(dt(name))
        a = rng.integers(info.min, info.max, size=10_001, endpoint=True, dtype=dt(name))
        b = rng.integers(info.min, info.max, size=10_001, endpoint=True, dtype=dt(name))
        with np.errstate(over="ignore"):
            want = NUMPY[op](a, b)  # wraps, like ours
    else:
        a = (rng.standard_normal(10_001) * 100).astype(dt(name))
        b = (rng.standard_normal(10_001) * 100).astype(dt(name))
        want = NUMPY[op](a.astype(np.float32) if name in ("float16", "bfloat16") else a,
                         b.astype(np.float32) if name in ("float16", "bfloat16") else b).astype(dt(name))
    assert reduce(a, b, name, op).tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_min_max_propagate_nan_like_numpy(name):
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 0.0], dtype=dt(name))
    b = np.array([1.0, np.nan, np.nan, np.inf, -0.0], dtype=dt(name))
    for op in ("min", "max"):
        got = reduce(a, b, name, op).astype(np.float64)
        want = NUMPY[op](a.astype(np.float64), b.astype(np.float64))
        assert np.array_equal(np.isnan(got), np.isnan(want)), op
        assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)]), op


@pytest.mark.parametrize("name", ["int8", "uint8", "int32", "int64"])
@pytest.mark.parametrize("n", [1, 3, 7, 200])
def test_integer_average_floors_like_numpy(name, n):
    info = np.iinfo(dt(name))
    x = np.arange(info.min, info.max, max(1, (int(info.max) - int(info.min)) // 5000), dtype=np.int64)
    x = x.astype(dt(name))
    got = x.copy()
    _core.divide(got.view(np.uint8), CODES[name], n)
    assert got.tobytes() == (x // dt(name).type(n) if n <= info.max else (x.astype(np.int64) // n).astype(dt(name))).tobytes()


def test_float_average_divides_once():
    x = np.array([1, 2, 3, 1e30], dtype=np.float32)
    got = x.copy()
    _core.divide(got.view(np.uint8), _core.FLOAT32, 3)
    assert got.tobytes() == (x / np.float32(3)).tobytes()
