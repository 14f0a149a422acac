"""Which dtypes each collective takes: int16/uint16 reduce like numpy on every
path (small inline, ring, reduce_scatter); ops that only move bytes take every
fixed-size dtype and catch a dtype mismatch; reductions refuse the rest."""
import ml_dtypes
import numpy as np
import pytest

from cases import OPS, np_dtype
from ranks import run_ranks
from ringreduce import _core


@pytest.mark.parametrize("name", ["int16", "uint16"])
@pytest.mark.parametrize("op", OPS)
def test_16_bit_integer_kernels_wrap_like_numpy(name, op):
    dt = np.dtype(name)
    info = np.iinfo(dt)
    g = np.random.default_rng(7)
    a = g.integers(info.min, info.max, 1001, dtype=dt, endpoint=True)
    b = g.integers(info.min, info.max, 1001, dtype=dt, endpoint=True)
    a[:4] = [info.max, info.min, info.max, -1 if dt.kind == "i" else 0]  # overflow both ways
    b[:4] = [info.max, info.min, 2, info.min]
    got = a.copy()
    _core.reduce(got, b.tobytes(), getattr(_core, name.upper()), getattr(_core, op.upper()))
    with np.errstate(over="ignore"):
        want = {"sum": a + b, "avg": a + b, "prod": a * b, "min": np.minimum(a, b), "max": np.maximum(a, b)}[op]
    assert got.tobytes() == want.tobytes()
    _core.divide(got, getattr(_core, name.upper()), 3)
    assert got.tobytes() == (want // dt.type(3)).tobytes()  # floor division, as numpy's //


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("path", ["auto", "ring"])
def test_16_bit_integers_reduce_on_every_path(world_pool, n, path):
    env = {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_SEGMENT_BYTES": "64"} if path == "ring" else {}
    ranks = world_pool.run(n, """
from cases import OPS, make_input, reference, digest
n, r = rr.size(), rr.rank()
out = {}
for dtype in ["int16", "uint16"]:
    for op in OPS:
        for count in [0, 1, max(n - 1, 0), 2 * n + 1, 70_001]:
            inputs = [make_input(i, (count,), dtype, op) for i in range(n)]
            if op == "sum":  # values that overflow, so the sums wrap
                inputs = [(x.astype(np.int64) * 3001).astype(dtype) for x in inputs]
            want = reference(inputs, dtype, op)
            got = rr.allreduce(inputs[r], op=op)
            lo = r * (count // n) + min(r, count % n)
            mine = rr.reduce_scatter(inputs[r], op=op)
            ok = got.tobytes() == want.tobytes() and mine.tobytes() == want[lo:lo + mine.size].tobytes()
            out[(dtype, op, count)] = (ok, digest(got))
result = out
""", env=env, timeout=240)
    for rk in ranks:
        bad = [k for k, (ok, _) in rk.result.items() if not ok]
        assert not bad, f"rank {rk.rank}: {bad[:5]}"
        assert rk.result == ranks[0].result, "every rank bit-identical"


def test_byte_moving_ops_take_every_fixed_size_dtype(world_pool):
    ranks = world_pool.run(3, """
from cases import MOVABLE, any_bytes, digest
n, r = rr.size(), rr.rank()
out = {}
for dtype in MOVABLE:
    for rows in [0, 1, 5, 40_000]:
        mine = any_bytes((rows + r, 2), dtype, [r, rows])
        got = rr.allgather(mine)
        want = b"".join(any_bytes((rows + i, 2), dtype, [i, rows]).tobytes() for i in range(n))
        root = rows % n
        b = rr.broadcast(mine if r == root else any_bytes((rows + root, 2), dtype, [9, rows]), root=root)
        want_b = any_bytes((rows + root, 2), dtype, [root, rows])
        out[(dtype, rows)] = (got.dtype == mine.dtype and got.shape == (3 * rows + 3, 2) and got.tobytes() == want
                              and b.dtype == mine.dtype and b.shape == want_b.shape and b.tobytes() == want_b.tobytes())
result = out
""", timeout=240)
    for rk in ranks:
        bad = [k for k, ok in rk.result.items() if not ok]
        assert not bad, f"rank {rk.rank}: {bad[:5]}"


def test_dtype_mismatch_on_byte_moving_ops_names_both_dtypes(world_pool):
    ranks = world_pool.run(2, """
r = rr.rank()
out = {}
for name, mine, theirs in [("strings", "S4", "S5"), ("ints", "int16", "uint16"), ("bool", "bool", "uint8"),
                           ("complex", "complex64", "float64")]:
    x = np.zeros((2, 3), mine if r == 0 else theirs)
    for op, call in [("allgather", lambda: rr.allgather(x)), ("broadcast", lambda: rr.broadcast(x)),
                     ("alltoall", lambda: rr.alltoall(x))]:
        try:
            call()
            out[(name, op)] = None
        except rr.MismatchError as exc:
            out[(name, op)] = str(exc)
out["after"] = rr.allgather(np.array([r], np.uint64)).tolist()  # the ring stays usable
result = out
""", timeout=120)
    pairs = {"strings": ("|S4", "|S5"), "ints": ("int16", "uint16"), "bool": ("bool", "uint8"),
             "complex": ("complex64", "float64")}
    for rk in ranks:
        for (name, op), msg in [(k, v) for k, v in rk.result.items() if k != "after"]:
            a, b = pairs[name]
            assert msg and f"rank 0: {a}" in msg and f"rank 1: {b}" in msg and op in msg, (name, op, msg)
        assert rk.result["after"] == [0, 1]


def test_reductions_refuse_what_they_cannot_reduce(world_pool):
    ranks = world_pool.run(2, """
from cases import MOVABLE_ONLY, np_dtype
out = {}
for dtype in MOVABLE_ONLY:
    x = np.zeros(4, np_dtype(dtype))
    for op, call in [("allreduce", lambda: rr.allreduce(x)), ("reduce_scatter", lambda: rr.reduce_scatter(x))]:
        try:
            call()
            out[(dtype, op)] = None
        except TypeError as exc:
            out[(dtype, op)] = str(exc)
for op, call in [("allgather", lambda: rr.allgather(np.array([None, 1]))),
                 ("broadcast", lambda: rr.broadcast(np.array([None, 1]))),
                 ("allreduce", lambda: rr.allreduce(np.array([None, 1])))]:
    try:
        call()
        out[("object", op)] = None
    except TypeError as exc:
        out[("object", op)] = str(exc)
out["after"] = rr.allreduce(np.array([1, 2], np.int16)).tolist()
result = out
""", timeout=120)
    for rk in ranks:
        for (dtype, op), msg in [(k, v) for k, v in rk.result.items() if k != "after"]:
            shown = "object" if dtype == "object" else str(np_dtype(dtype))
            assert msg is not None and shown in msg, (dtype, op, msg)
        assert rk.result["after"] == [2, 4]


def test_new_dtype_codes_are_appended():
    """Codes are the wire's: the new ones were appended, the old kept."""
    assert (_core.FLOAT16, _core.BFLOAT16, _core.INT64, _core.INT16, _core.UINT16) == (0, 1, 7, 8, 9)
    assert np_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_on_different_16_bit_kernels_agree_on_nans_bit_for_bit(tmp_path, n):
    """Rank 0 runs the portable kernels, rank 1 AVX2's, rank 2 AVX-512's (a
    CPU without F16C beside newer ones). A small allreduce has every
    rank reduce all the data itself: NaN payloads must come out alike."""
    if _core.kernels16() == "portable":
        pytest.skip("this CPU runs only the portable 16-bit kernels")
    ranks = run_ranks(n, """
import ml_dtypes
from ringreduce import _core
level = _core.kernels16(["portable", "avx2", "avx512"][rr.rank()])
out = []
for dt, nans in (("float16", (0x7c01, 0x7e00)), ("bfloat16", (0x7f81, 0x7fc0))):
    bits = np.arange(nans[0], nans[0] + 64, dtype=np.uint16) + rr.rank() * 5  # NaNs, other payloads per rank
    x = bits.view(ml_dtypes.bfloat16 if dt == "bfloat16" else np.float16)
    for op in ("sum", "prod"):
        out.append(rr.allreduce(x, op=op).view(np.uint16).tobytes())
result = (level, out)
""", tmp_path)
    levels = [rank.result[0] for rank in ranks]
    assert levels[0] == "portable" and all(lv != "portable" for lv in levels[1:]), levels
    for rank in ranks[1:]:
        assert rank.result[1] == ranks[0].result[1], rank.rank
