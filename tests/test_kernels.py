"""The reduction kernels (csrc/kernels/reduce_math.h, reduce.c) against numpy, in
process: the same arithmetic the ring and the CUDA kernels use."""
import shutil
import subprocess
from pathlib import Path

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
def test_16_bit_floats_widen_exactly_for_every_bit_pattern(name, kernels16):
    every = np.arange(1 << 16, dtype=np.uint16).view(dt(name))
    # max(x, x) widens to float32 and rounds back: must give x's bits back (NaNs stay NaN).
    got = reduce(every, every, name, "max")
    nan = np.isnan(every.astype(np.float32))
    assert got.view(np.uint16)[~nan].tobytes() == every.view(np.uint16)[~nan].tobytes()
    assert np.isnan(got[nan].astype(np.float32)).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_16_bit_floats_round_once_to_nearest_even(name, op, kernels16):
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
def test_min_max_propagate_nan_like_numpy(name, kernels16):
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


# ----------------------------------------------------------------- 16-bit averages: running means

def nearest16(y: np.ndarray, name: str) -> np.ndarray:
    """float64 -> float16/bfloat16 rounded once, to nearest even: the closest of
    the float32 route's answer and its two neighbours (that route can round
    twice, and ml_dtypes' float64 -> bfloat16 takes it), ties to the even one.
    Finite values only."""
    c = y.astype(np.float32).astype(dt(name)).view(np.uint16).astype(np.int32)
    cand = np.stack([c - 1, c, c + 1]) & 0xFFFF
    vals = cand.astype(np.uint16).view(dt(name)).astype(np.float64)
    dist = np.where(np.isfinite(vals), np.abs(vals - y), np.inf)
    best = dist.min(axis=0)
    pick = np.where(dist == best, 2 - (cand & 1), 0).argmax(axis=0)  # nearest; of two, the even one
    return cand[pick, np.arange(y.size)].astype(np.uint16).view(dt(name))


def mean_fold(x, mean, name, k):
    out = mean.copy()
    _core.mean_fold(out.view(np.uint8), x.view(np.uint8).tobytes(), CODES[name], k)
    return out


def finite16(name, count, seed):
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=count, dtype=np.uint16)
    x = bits.view(dt(name))
    return x[np.isfinite(x.astype(np.float32))]


def test_the_reference_rounds_like_numpys_float64_to_float16():
    y = np.random.default_rng(1).standard_normal(100_000) * 3e4 * np.random.default_rng(2).random(100_000) ** 8
    y = np.clip(y, -65504, 65504)
    assert nearest16(y, "float16").tobytes() == y.astype(np.float16).tobytes()  # numpy rounds once, from double


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [2, 3, 7, 1000])
def test_mean_fold_is_the_double_mean_rounded_once(name, k, kernels16):
    """(mean * (k-1) + x) / k in double, rounded straight to 16 bits: k = 7
    hits doubles just above a float16 tie, which float32 would round onto."""
    x, m = finite16(name, 1_000_000, k), finite16(name, 1_000_000, k + 1)
    n = min(x.size, m.size)
    x, m = x[:n], m[:n]
    y = (m.astype(np.float64) * (k - 1) + x.astype(np.float64)) / k
    want = nearest16(y, name)
    assert mean_fold(x, m, name, k).tobytes() == want.tobytes()
    if name == "float16" and k == 7:  # the sample holds cases the float32 route gets wrong
        assert (y.astype(np.float32).astype(np.float16).tobytes() != want.tobytes())
    if k == 2:  # the mean of two, correctly rounded (float16: the double sum is exact)
        exact = nearest16((m.astype(np.float64) + x.astype(np.float64)) / 2, name)
        assert mean_fold(x, m, name, 2).tobytes() == exact.tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_mean_fold_never_leaves_the_range(name, kernels16):
    info = ml_dtypes.finfo(dt(name))
    big, tiny = float(info.max), float(info.smallest_subnormal)
    cases = [  # (mean of k-1, x, k, want)
        (big, big, 2, big), (big, big, 3, big), (big, big, 1000, big), (-big, -big, 4, -big),
        (big, -big, 2, 0.0), (-big, big, 3, -big / 3), (tiny, tiny, 2, tiny), (tiny, tiny, 5, tiny),
        (tiny, 0.0, 2, 0.0), (3 * tiny, tiny, 2, 2 * tiny), (-tiny, -tiny, 3, -tiny)]
    if name == "float16":
        cases.append((40000.0, 40000.0, 2, 40000.0))
    m = np.array([c[0] for c in cases], dt(name))
    x = np.array([c[1] for c in cases], dt(name))
    got = np.concatenate([mean_fold(x[i:i + 1], m[i:i + 1], name, c[2]) for i, c in enumerate(cases)])
    want = np.array([c[3] for c in cases], dtype=np.float64)
    assert got.tobytes() == nearest16(want, name).tobytes(), got


def test_mean_fold_rejects_what_it_cannot_fold():
    a = np.zeros(4, np.float16)
    with pytest.raises(ValueError):
        _core.mean_fold(a, a.tobytes(), _core.FLOAT32, 2)
    with pytest.raises(ValueError):
        _core.mean_fold(a, a.tobytes(), _core.FLOAT16, 1)
    with pytest.raises(ValueError):
        _core.mean_fold(a, a[:2].tobytes(), _core.FLOAT16, 2)


# ----------------------------------------------------------------- 16-bit kernel paths: vector vs portable

LEVELS16 = ["portable", "avx2", "avx512"]


@pytest.fixture(params=LEVELS16)
def kernels16(request):
    """Runs a test on each 16-bit kernel path this CPU has (the vector kernels
    of csrc/kernels/reduce16_x86.c where it has AVX2 and F16C, and AVX-512), then puts
    the best back."""
    best = _core.kernels16("avx512")
    if _core.kernels16(request.param) != request.param:
        _core.kernels16(best)
        pytest.skip(f"this CPU runs no {request.param} kernels")
    yield request.param
    _core.kernels16(best)


def test_kernels16_names_and_rejects_unknown():
    best = _core.kernels16()
    try:
        assert _core.kernels16("portable") == "portable" and _core.kernels16() == "portable"
        with pytest.raises(ValueError, match="unknown kernels"):
            _core.kernels16("avx9")
    finally:
        _core.kernels16(best)
    assert _core.kernels16() == best


def specials(name):
    """Every 16-bit pattern, and the values that matter paired against each
    other: zeros of both signs, subnormals, the largest finite, inf, NaNs of
    both kinds (quiet and signalling payloads)."""
    if name == "float16":
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0xbc00, 0x7bff, 0xfbff, 0x7c00, 0xfc00,
                   0x7e00, 0xfe00, 0x7c01, 0x7d55, 0xffff, 0x3555, 0x3800]
    else:
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x3f80, 0xbf80, 0x7f7f, 0xff7f, 0x7f80, 0xff80,
                   0x7fc0, 0xffc0, 0x7f81, 0x7fa5, 0xffff, 0x3eab, 0x3f00]
    s = np.array(special, np.uint16)
    every = np.arange(1 << 16, dtype=np.uint16)
    a = np.concatenate([np.repeat(s, s.size), every, every, np.random.default_rng(3).permutation(every)])
    b = np.concatenate([np.tile(s, s.size), every[::-1], np.random.default_rng(4).permutation(every), every])
    return a.view(dt(name)), b.view(dt(name))


def both_paths(fn):
    """fn() with the portable kernels, and with each vector level this CPU has
    (checked alike); returns the portable and the best level's results."""
    best = _core.kernels16()
    try:
        _core.kernels16("portable")
        portable = fn()
        vector = portable
        for level in LEVELS16[1:]:
            if _core.kernels16(level) == level:
                got = fn()
                assert same_bits_or_both_nan(got, vector), level
                vector = got
    finally:
        _core.kernels16(best)
    return portable, vector


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", list(OPS))
def test_vector_and_portable_16_bit_kernels_give_the_same_bits(name, op):
    """NaN, inf, subnormal and signed-zero operands included, and every odd
    length up to 40 (the vector tail); both paths also match numpy."""
    a, b = specials(name)
    got = reduce(a, b, name, op)
    want = NUMPY[op](a.astype(np.float32), b.astype(np.float32)).astype(dt(name))
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(got.astype(np.float32)) == nan).all()
    if op in ("min", "max"):  # numpy keeps zeros' signs by operand order as RR_FMIN does only for a != b
        same = ~nan & (want.astype(np.float32) != 0)
    else:
        same = ~nan
    assert got.view(np.uint16)[same].tobytes() == want.view(np.uint16)[same].tobytes()
    portable, vector = both_paths(lambda: reduce(a, b, name, op))
    assert same_bits_or_both_nan(portable, vector)  # zero signs too
    for n in range(1, 41):
        p, v = both_paths(lambda: reduce(a[-n:], b[-n:], name, op))
        assert same_bits_or_both_nan(p, v) and same_bits_or_both_nan(v, vector[-n:]), n


def same_bits_or_both_nan(x, y):
    """Equal bits, but a NaN's payload may differ: when both operands are
    NaNs, x86 returns the first operand's and a compiler may swap the operands
    of a commutative add or multiply, in either path."""
    nan = np.isnan(x.astype(np.float32))
    return (nan == np.isnan(y.astype(np.float32))).all() and x[~nan].tobytes() == y[~nan].tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8, 1000])
def test_vector_and_portable_mean_folds_give_the_same_bits(name, k):
    a, b = specials(name)
    portable, vector = both_paths(lambda: mean_fold(a, b, name, k))
    assert same_bits_or_both_nan(portable, vector)
    finite = np.isfinite(a.astype(np.float32)) & np.isfinite(b.astype(np.float32))
    y = (b[finite].astype(np.float64) * (k - 1) + a[finite].astype(np.float64)) / k
    assert vector[finite].tobytes() == nearest16(y, name).tobytes()
    for n in range(1, 20):
        p, v = both_paths(lambda: mean_fold(a[:n], b[:n], name, k))
        assert same_bits_or_both_nan(p, v) and same_bits_or_both_nan(v, vector[:n]), n


def test_bfloat16_means_below_float32s_normal_range_round_once(kernels16):
    """A mean just under a bfloat16 subnormal tie: (2^-133 * (k-1) + 2^-116)
    / k, k = 2^18 + 1, is 1.4999943 * 2^-133, which rounds to 2^-133. Through
    float32 (subnormal there, 2^-149 apart) it would land on the tie 1.5 *
    2^-133 and go to even, 2 * 2^-133: the vector kernel refolds such
    blocks with the scalar arithmetic."""
    k = (1 << 18) + 1
    m = np.array([0x0001] * 17, np.uint16).view(ml_dtypes.bfloat16)  # 2^-133: full blocks and a tail
    x = np.array([0x0580] * 17, np.uint16).view(ml_dtypes.bfloat16)  # 2^-116
    got = mean_fold(x, m, "bfloat16", k)
    y = (m.astype(np.float64) * (k - 1) + x.astype(np.float64)) / k
    assert got.view(np.uint16).tolist() == [0x0001] * 17
    assert got.tobytes() == nearest16(y, "bfloat16").tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_16_bit_sums_of_two_nans_keep_the_first_payload_on_every_path(name, op):
    """The small allreduce (ring.c rr_allreduce_small) has every rank reduce
    all the data itself, so ranks on different CPUs (one AVX2, one portable)
    agree only if both paths pick the same NaN: a's, then b's, as RR_FMIN.
    x86 returns an add's first operand's NaN, and a compiler may swap them."""
    rng = np.random.default_rng(7)
    if name == "float16":
        nans = np.concatenate([np.arange(0x7c01, 0x7c00 + 0x400), np.arange(0xfc01, 0xfc00 + 0x400)])
        quiet = 0x0200
    else:
        nans = np.concatenate([np.arange(0x7f81, 0x7f80 + 0x80), np.arange(0xff81, 0xff80 + 0x80)])
        quiet = 0x0040
    a = rng.permutation(nans).astype(np.uint16)
    b = rng.permutation(nans).astype(np.uint16)
    finite = np.full(a.size, 0x3c00 if name == "float16" else 0x3f80, np.uint16)  # 1.0
    for x, y, want in [(a, b, a), (a, finite, a), (finite, b, b)]:
        for level in LEVELS16:
            best = _core.kernels16()
            try:
                if _core.kernels16(level) != level:
                    continue
                got = reduce(x.view(dt(name)), y.view(dt(name)), name, op).view(np.uint16)
            finally:
                _core.kernels16(best)
            assert got.tolist() == (want | quiet).tolist(), level


# ----------------------------------------------------------------- the bfloat16 fold in float32 (reduce16_x86.c)

def bf16_hard_pairs(seed):
    """(x, mean) bit patterns where a float32 fold of bfloat16 means goes
    wrong unless it takes care (csrc/kernels/reduce16_x86.c, "bfloat16 mean fold"):
    means on or next to a bfloat16 midpoint (x a few ulps from the mean, or
    mean and x equal), a tiny x against a huge mean and the reverse (the
    double fold's sum drops x: a tie where the exact mean has none), sums
    past float32's range, means around the refold threshold 2^-124 / k,
    subnormals, zeros, infinities and NaNs against random values."""
    rng = np.random.default_rng(seed)
    n = 40_000
    m = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    near = (m.astype(np.int32) + rng.integers(-4, 5, size=n)).astype(np.uint16)
    sign = (rng.integers(0, 2, size=n) << 15).astype(np.uint16)
    huge = (rng.integers(0x7000, 0x7f80, size=n) | sign).astype(np.uint16)
    tiny = rng.integers(0, 0x1000, size=n).astype(np.uint16) ^ (rng.integers(0, 2, size=n) << 15).astype(np.uint16)
    around = rng.integers(0x0000, 0x0400, size=n).astype(np.uint16) | sign  # 2^-133 .. 2^-119
    edge = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0,
                     0xffc0, 0x7f81, 0xffff], np.uint16)
    special = rng.choice(edge, size=n)
    xs = [near, tiny, huge, huge, around, special, m, rng.integers(0, 1 << 16, size=n, dtype=np.uint16)]
    ms = [m, huge, tiny, huge[::-1], around[::-1], m, special, rng.integers(0, 1 << 16, size=n, dtype=np.uint16)]
    x, mean = np.concatenate(xs), np.concatenate(ms)
    return x.view(ml_dtypes.bfloat16), mean.view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8, 9, 16, 255, 1000, (1 << 15) - 1, 1 << 15, (1 << 18) + 1])
def test_bfloat16_float32_fold_gives_the_double_folds_bits(k):
    """Every k a world of up to 8 ranks uses, and larger ones (from 2^15 the
    vector level hands the fold to the scalar loop): each vector level against
    the portable double fold, on the pairs that are hard for float32, and
    against the double mean rounded once where it is finite."""
    x, m = bf16_hard_pairs(k)
    # Shuffled, so one vector block mixes fast lanes with each kind of hard one.
    mixed = np.random.default_rng(k).permutation(x.size)
    x, m = np.concatenate([x, x[mixed]]), np.concatenate([m, m[mixed]])
    portable, vector = both_paths(lambda: mean_fold(x, m, "bfloat16", k))
    assert same_bits_or_both_nan(portable, vector)
    finite = np.isfinite(x.astype(np.float32)) & np.isfinite(m.astype(np.float32))
    y = (m[finite].astype(np.float64) * (k - 1) + x[finite].astype(np.float64)) / k
    assert portable[finite].tobytes() == nearest16(y, "bfloat16").tobytes()
    # In place as the ring calls it (dst is the mean), and unaligned odd lengths.
    for start, stop in ((0, 1), (3, 20), (5, 38), (1, 1001)):
        p, v = both_paths(lambda: mean_fold(x[start:stop], m[start:stop], "bfloat16", k))
        assert same_bits_or_both_nan(p, v) and same_bits_or_both_nan(v, vector[start:stop])


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8])
def test_bfloat16_float32_fold_on_gradient_like_data(k):
    """Normally distributed values, as gradients are: many means land exactly
    on bfloat16 midpoints (ties; the fast path's r = 0 with an exact sum),
    and +-0 means (zero gradients) go through the fast path's floor for M.
    Each vector level against the portable double fold, bit for bit."""
    rng = np.random.default_rng(100 + k)
    x = rng.standard_normal(50_000).astype(ml_dtypes.bfloat16)
    m = rng.standard_normal(50_000).astype(ml_dtypes.bfloat16)
    zeros = rng.random(50_000) < 0.05
    x[zeros], m[zeros] = ml_dtypes.bfloat16(0), ml_dtypes.bfloat16(-0.0)
    m[rng.random(50_000) < 0.05] = ml_dtypes.bfloat16(-0.0)
    portable, vector = both_paths(lambda: mean_fold(x, m, "bfloat16", k))
    assert portable.tobytes() == vector.tobytes()
    y = (m.astype(np.float64) * (k - 1) + x.astype(np.float64)) / k
    assert portable.tobytes() == nearest16(y, "bfloat16").tobytes()


def test_bfloat16_float32_fold_every_pair_sampled(tmp_path):
    """tests/bf16_mean_exhaustive.c: every 127th mean bit pattern against all
    2^16 x patterns, k = 2..8 and three larger k, each vector level against
    rr_mean16_bf16 (stride 1, every pair: docs/performance.md)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    exe = tmp_path / "bf16_mean_exhaustive"
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Werror", "-I", str(repo / "csrc"), "-o", str(exe),
                    str(repo / "tests" / "bf16_mean_exhaustive.c")], check=True, timeout=120)
    out = subprocess.run([str(exe), "127", "2", "3", "4", "5", "6", "7", "8", "9", "1000", str((1 << 15) - 1)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    if "no vector kernels" not in out.stdout:
        assert out.stdout.count(" wrong 0 ") >= 10, out.stdout


def test_float16_float32_fold_every_pair_sampled(tmp_path):
    """tests/f16_mean_exhaustive.c: every 127th mean bit pattern against all
    2^16 x patterns, through rr_mean_fold16_vec at each vector level, against
    rr_mean16_f16: k = 2..9 and 16 (the float32 fold: k = 2, powers of 2,
    Markstein's step at AVX-512), 1000 and 2^13 - 1 (its last k), and 2^13
    (the double fold again). Stride 1, every pair: docs/performance.md."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    exe = tmp_path / "f16_mean_exhaustive"
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Werror", "-I", str(repo / "csrc"), "-o", str(exe),
                    str(repo / "tests" / "f16_mean_exhaustive.c")], check=True, timeout=120)
    ks = ["2", "3", "4", "5", "6", "7", "8", "9", "16", "1000", str((1 << 13) - 1), str(1 << 13)]
    out = subprocess.run([str(exe), "127", *ks], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    if "no vector kernels" not in out.stdout:
        assert out.stdout.count(" wrong 0 ") >= len(ks), out.stdout
