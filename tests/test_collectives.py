"""reduce_scatter, allgather, broadcast, barrier, out=, odd inputs, world info."""
import subprocess
import sys

import numpy as np
import pytest

from cases import DTYPES, np_dtype
from ranks import REPO, run_ranks


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_reduce_scatter_chunks_concatenate_to_the_allreduce(world_pool, n):
    ranks = world_pool.run(n, """
        out = {}
        for count in [0, 1, rr.size() - 1, 2 * rr.size() + 1, 100_003]:
            for dtype in ["float32", "int64", "float16"]:
                x = (np.arange(count) % 11 + rr.rank()).astype(dtype)
                out[(count, dtype)] = (rr.reduce_scatter(x), rr.allreduce(x))
        x = np.arange(30, dtype=np.int32).reshape(5, 6) * (rr.rank() + 1)
        out["avg"] = (rr.reduce_scatter(x, op="avg"), rr.allreduce(x, op="avg").reshape(-1))
        result = out
    """)
    for key in ranks[0].result:
        chunks = [r.result[key][0] for r in ranks]
        full = ranks[0].result[key][1].reshape(-1)
        count = full.size
        for i, c in enumerate(chunks):
            assert c.ndim == 1 and c.dtype == full.dtype
            assert c.size == count // n + (1 if i < count % n else 0), f"{key}: chunk {i} has {c.size}"
        assert np.concatenate(chunks).tobytes() == full.tobytes(), f"{key}: chunks != allreduce"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_allgather_concatenates_uneven_rows(world_pool, n):
    ranks = world_pool.run(n, """
        from cases import DTYPES, np_dtype
        out = {}
        for dtype in DTYPES:
            rows = [0, 1, 3, 7, 2][rr.rank() % 5]
            out[dtype] = rr.allgather(np.full((rows, 3, 2), rr.rank() + 1).astype(np_dtype(dtype)))
        out["big"] = rr.allgather(np.full(70_000 + rr.rank(), rr.rank(), dtype=np.float32))
        out["scalar"] = rr.allgather(np.float64(rr.rank()))
        result = out
    """)
    rows = [[0, 1, 3, 7, 2][r % 5] for r in range(n)]
    for dtype in DTYPES:
        want = np.concatenate([np.full((rows[r], 3, 2), r + 1).astype(np_dtype(dtype)) for r in range(n)])
        for r in ranks:
            assert r.result[dtype].tobytes() == want.tobytes() and r.result[dtype].shape == want.shape, dtype
    big = np.concatenate([np.full(70_000 + r, r, dtype=np.float32) for r in range(n)])
    for r in ranks:
        assert np.array_equal(r.result["big"], big)
        assert np.array_equal(r.result["scalar"], np.arange(n, dtype=np.float64))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_broadcast_from_any_root(world_pool, n):
    ranks = world_pool.run(n, """
        from cases import DTYPES, np_dtype
        out = {}
        for root in range(rr.size()):
            for dtype in DTYPES:
                for count in [0, 1, 5, 300_001]:
                    x = np.full(count, root + 1 if rr.rank() == root else 99).astype(np_dtype(dtype))
                    out[(root, dtype, count)] = rr.broadcast(x, root=root)
        result = {k: (v.dtype.name, v.shape, bool((v == v.dtype.type(k[0] + 1)).all())) for k, v in out.items()}
    """)
    for r in ranks:
        for (root, dtype, count), (got_dtype, shape, ok) in r.result.items():
            assert ok and shape == (count,) and got_dtype == np_dtype(dtype).name, (r.rank, root, dtype, count)


def test_out_argument_and_non_contiguous_inputs(world_pool):
    ranks = world_pool.run(3, """
        base = np.arange(200_000, dtype=np.float64).reshape(400, 500) + rr.rank()
        want = np.arange(200_000, dtype=np.float64).reshape(400, 500) * 3 + 3
        out = np.empty_like(base)
        r1 = rr.allreduce(base, out=out)
        inplace = base.copy()
        r2 = rr.allreduce(inplace, out=inplace)
        small = np.arange(10.0) + rr.rank()
        r3 = rr.allreduce(small, out=small)
        t = rr.allreduce(base.T)                # Fortran-ordered view
        s = rr.allreduce(base[::2, ::3])        # strided view
        result = dict(
            out_is_returned=r1 is out and r2 is inplace and r3 is small,
            out_ok=np.array_equal(out, want), inplace_ok=np.array_equal(inplace, want),
            small_ok=np.array_equal(small, np.arange(10.0) * 3 + 3),
            transposed=np.array_equal(t, want.T), strided=np.array_equal(s, want[::2, ::3]),
            input_untouched=np.array_equal(base, np.arange(200_000, dtype=np.float64).reshape(400, 500) + rr.rank()),
        )
    """)
    for r in ranks:
        assert all(r.result.values()), (r.rank, r.result)


def test_bad_out_and_op_raise_locally(world_pool):
    ranks = world_pool.run(2, """
        errors = []
        for call in [lambda: rr.allreduce(np.ones(3), out=np.ones(4)),
                     lambda: rr.allreduce(np.ones(3), out=np.ones(3, dtype=np.float32)),
                     lambda: rr.allreduce(np.ones(3), op="mean"),
                     lambda: rr.broadcast(np.ones(3), root=5)]:
            try:
                call()
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        result = (errors, rr.allreduce(np.ones(3)).tolist())
    """)
    for r in ranks:
        errors, after = r.result
        assert all(errors), errors
        assert after == [2.0, 2.0, 2.0]


def test_world_info_and_barrier(world_pool):
    ranks = world_pool.run(4, """
        import time
        if rr.rank() == 2:
            time.sleep(1.0)
        t0 = time.time()
        rr.barrier()
        waited = time.time() - t0
        result = (rr.rank(), rr.size(), rr.local_rank(), rr.local_size(), rr.is_initialized(), waited)
    """)
    for r in ranks:
        rank, size, local_rank, local_size, initialized, waited = r.result
        assert (rank, size, local_rank, local_size, initialized) == (r.rank, 4, r.rank, 4, True)
        if rank != 2:
            assert waited > 0.5, f"rank {rank} left the barrier before rank 2 entered it"


def test_single_process_without_environment():
    code = """
import numpy as np, ringreduce as rr
rr.init()
assert (rr.rank(), rr.size(), rr.local_rank(), rr.local_size()) == (0, 1, 0, 1)
x = np.arange(7, dtype=np.int32)
for op in ["sum", "avg", "min", "max", "prod"]:
    y = rr.allreduce(x, op=op)
    assert y is not x and np.array_equal(y, x), op
assert np.array_equal(rr.reduce_scatter(x), x)
assert np.array_equal(rr.allgather(x), x)
assert np.array_equal(rr.broadcast(x), x)
rr.barrier()
rr.shutdown()
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("RINGREDUCE_", "OMPI_", "PMI_", "PMIX_")) and k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_calls_before_init_raise():
    code = """
import numpy as np, ringreduce as rr
try:
    rr.allreduce(np.ones(2))
except rr.RingReduceError as e:
    print("raised:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert "raised:" in out.stdout and "init" in out.stdout, out.stdout + out.stderr


# --------------------------------------------------------------------------- edges, one launch per world size
#
# One job per world size runs every case below and hands back the raw results;
# the parametrized tests then judge them against numpy in the test process.

EDGE_WORLDS = [2, 3, 5]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
ROWS = [0, 200_000, 1, 3, 50_000]  # allgather rows per rank: empty, above and below the small-message limit


def rs_counts(n):
    return [0, 1, n - 1, 2 * n + 1, 100_003]


def real_input(rank, dtype, op, count):
    """Real-valued inputs (not exact in any dtype): near 1 for prod, else about +-10."""
    g = np.random.default_rng([rank, count, FLOATS.index(dtype), ["sum", "avg", "prod", "min", "max"].index(op)])
    v = g.uniform(0.9, 1.1, count) if op == "prod" else g.standard_normal(count) * 10
    return v.astype(np_dtype(dtype))


def gather_input(rank, dtype):
    rows = ROWS[rank % len(ROWS)]
    return (np.arange(rows * 3).reshape(rows, 3) % 7 + rank).astype(np_dtype(dtype))


EDGE_BODY = """
from test_collectives import EDGE_WORLDS, FLOATS, rs_counts, real_input, gather_input
from cases import DTYPES, OPS, np_dtype, make_input
n, r = rr.size(), rr.rank()
res = {}

for dtype in FLOATS:
    for op in OPS:
        for count in [1, 2 * n + 1, 100_003]:
            res["real", dtype, op, count] = rr.allreduce(real_input(r, dtype, op, count), op=op)

for dtype in DTYPES:
    for op in OPS:
        for count in rs_counts(n):
            x = make_input(r, (count,), dtype, op)
            res["rs", dtype, op, count] = (rr.reduce_scatter(x, op=op), rr.allreduce(x, op=op))
    res["gather", dtype] = rr.allgather(gather_input(r, dtype))

res["0d"] = (rr.allreduce(np.float32(r + 1)), rr.allreduce(np.array(r + 1, dtype=np.int8), op="max"),
             rr.reduce_scatter(np.array(r + 1, dtype=np.int32)), rr.broadcast(np.array(r + 1.0), root=n - 1),
             rr.allgather(np.array(r, dtype=np.int64)))

for dtype in DTYPES:
    for count in [5, 100_003]:
        fresh = lambda: make_input(r, (count,), dtype, "sum")
        x = fresh()
        o = np.empty_like(x)
        separate = rr.allreduce(x, out=o)
        inplace = fresh()
        returned_inplace = rr.allreduce(inplace, out=inplace)
        new = rr.allreduce(x)
        strided = rr.allreduce(np.repeat(x, 2)[::2])
        reversed_ = rr.allreduce(x[::-1])
        wide = np.zeros(2 * count, dtype=x.dtype)
        try:
            rr.allreduce(x, out=wide[::2])
            view_out = wide
        except ValueError as e:
            view_out = "ValueError: " + str(e)
        res["out", dtype, count] = dict(
            separate_is_out=separate is o, separate=o, inplace_is_out=returned_inplace is inplace, inplace=inplace,
            new_is_not_x=new is not x, new=new, x_untouched=x.tobytes() == fresh().tobytes(),
            strided=strided, reversed=reversed_, view_out=view_out)

for count in [10, 100_003]:
    buf = np.zeros(count + 1)
    buf[:count] = np.arange(count) + r
    try:
        rr.allreduce(buf[:count], out=buf[1:])
        res["overlap", count] = buf[1:].copy()
    except ValueError as e:
        res["overlap", count] = "ValueError: " + str(e)

for count in [3, 300_001]:
    x = np.full(count, r, dtype=np.int64)
    y = rr.broadcast(x, root=n - 1)
    res["bcast new", count] = (y is not x, bool((x == r).all()), y)

result = res
"""


@pytest.fixture(scope="module")
def edge_results(world_pool):
    cache = {}

    def get(n):
        if n not in cache:
            ranks = world_pool.run(n, EDGE_BODY, timeout=240)
            cache[n] = [r.result for r in ranks]
        return cache[n]
    return get


def assert_same_bits_everywhere(per_rank, key, n):
    first = per_rank[0][key]
    for r, res in enumerate(per_rank):
        got = res[key]
        assert got.dtype == first.dtype and got.shape == first.shape and got.tobytes() == first.tobytes(), \
            f"n={n} {key}: rank {r} is not bit-identical to rank 0"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", EDGE_WORLDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
def test_real_valued_floats_within_rounding(edge_results, n, dtype, op):
    """Values not exact in the dtype: sums and products within n units of
    rounding of numpy's float64 answer (relative to the magnitudes summed);
    min and max exact; the same bits on every rank."""
    per_rank = edge_results(n)
    for count in [1, 2 * n + 1, 100_003]:
        key = ("real", dtype, op, count)
        assert_same_bits_everywhere(per_rank, key, n)
        got = per_rank[0][key]
        assert got.dtype == np_dtype(dtype) and got.shape == (count,), f"n={n} {key}: {got.dtype}{got.shape}"
        inputs = np.stack([real_input(i, dtype, op, count).astype(np.float64) for i in range(n)])
        if op in ("min", "max"):
            want = getattr(inputs, op)(axis=0).astype(np_dtype(dtype))
            assert got.tobytes() == want.tobytes(), f"n={n} {key}: {op} is not exactly numpy's"
            continue
        want = {"sum": inputs.sum(0), "avg": inputs.sum(0) / n, "prod": inputs.prod(0)}[op]
        scale = np.abs(inputs).sum(0) / (n if op == "avg" else 1) if op != "prod" else np.abs(want)
        err = np.abs(got.astype(np.float64) - want)
        worst = int(np.argmax(err - n * ULP[dtype] * scale))
        assert np.all(err <= n * ULP[dtype] * scale), \
            f"n={n} {key}: element {worst} is {got[worst]!r}, numpy says {want[worst]!r} (error {err[worst]:.3g})"


@pytest.mark.parametrize("n", EDGE_WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
def test_reduce_scatter_every_dtype_and_op(edge_results, n, dtype, op):
    from cases import close_enough, make_input, reference
    per_rank = edge_results(n)
    for count in rs_counts(n):
        key = ("rs", dtype, op, count)
        chunks = [res[key][0] for res in per_rank]
        for i, c in enumerate(chunks):
            assert c.ndim == 1 and c.dtype == np_dtype(dtype), f"n={n} {key}: rank {i} got {c.dtype}{c.shape}"
            assert c.size == count // n + (i < count % n), f"n={n} {key}: rank {i} has {c.size} elements"
        whole = np.concatenate(chunks)
        assert whole.tobytes() == per_rank[0][key][1].tobytes(), f"n={n} {key}: chunks != this job's allreduce"
        inputs = [make_input(i, (count,), dtype, op) for i in range(n)]
        assert close_enough(whole, reference(inputs, dtype, op), dtype, op, inputs), f"n={n} {key}: chunks differ from numpy"


@pytest.mark.parametrize("n", EDGE_WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_mixes_empty_small_and_large_contributions(edge_results, n, dtype):
    want = np.concatenate([gather_input(i, dtype) for i in range(n)])
    for r, res in enumerate(edge_results(n)):
        got = res["gather", dtype]
        assert got.shape == want.shape and got.dtype == want.dtype, f"n={n} {dtype}: rank {r} got {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), f"n={n} {dtype}: rank {r} gathered wrong values (rows {ROWS[:n]})"


@pytest.mark.parametrize("n", EDGE_WORLDS)
def test_zero_d_arrays(edge_results, n):
    total = n * (n + 1) // 2
    for r, res in enumerate(edge_results(n)):
        s, m, chunk, b, g = res["0d"]
        assert s.shape == () and s.dtype == np.float32 and s == total, f"n={n} rank {r}: 0-d sum gave {s!r}"
        assert m.shape == () and m.dtype == np.int8 and m == n, f"n={n} rank {r}: 0-d max gave {m!r}"
        assert chunk.dtype == np.int32 and chunk.tolist() == ([total] if r == 0 else []), \
            f"n={n} rank {r}: reduce_scatter of a 0-d array gave {chunk!r}"
        assert b.shape == () and b == float(n), f"n={n} rank {r}: 0-d broadcast from root {n - 1} gave {b!r}"
        assert g.tolist() == list(range(n)), f"n={n} rank {r}: allgather of 0-d arrays gave {g!r}"


@pytest.mark.parametrize("n", EDGE_WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_in_place_and_strided_inputs_for_every_dtype(edge_results, n, dtype):
    from cases import make_input, reference
    for count in [5, 100_003]:
        want = reference([make_input(i, (count,), dtype, "sum") for i in range(n)], dtype, "sum").tobytes()
        case = f"n={n} {dtype} count={count}"
        for r, res in enumerate(edge_results(n)):
            got = res["out", dtype, count]
            assert got["separate_is_out"] and got["separate"].tobytes() == want, f"{case} rank {r}: out= not written"
            assert got["inplace_is_out"] and got["inplace"].tobytes() == want, f"{case} rank {r}: out=x wrong"
            assert got["new_is_not_x"] and got["x_untouched"] and got["new"].tobytes() == want, \
                f"{case} rank {r}: plain allreduce must return a new array and leave x alone"
            assert got["strided"].tobytes() == want, f"{case} rank {r}: strided input wrong"
            assert got["reversed"].tobytes() == np.frombuffer(want, dtype=np_dtype(dtype))[::-1].tobytes(), \
                f"{case} rank {r}: negative-stride input (x[::-1]) wrong"
            view_out = got["view_out"]
            if not isinstance(view_out, str):  # a strided out= may be refused, but if taken it must be filled
                assert view_out[::2].tobytes() == want and not view_out[1::2].any(), \
                    f"{case} rank {r}: out=a[::2] not written correctly (or wrote between its elements)"


@pytest.mark.parametrize("n", EDGE_WORLDS)
def test_out_overlapping_the_input(edge_results, n):
    """out= a view that overlaps x at an offset: refused, or the right answer."""
    for count in [10, 100_003]:
        want = np.arange(count) * n + n * (n - 1) / 2
        for r, res in enumerate(edge_results(n)):
            got = res["overlap", count]
            if not isinstance(got, str):
                assert np.array_equal(got, want), \
                    f"n={n} count={count} rank {r}: allreduce(buf[:-1], out=buf[1:]) gave {got[:4]}..., want {want[:4]}..."


@pytest.mark.parametrize("n", EDGE_WORLDS)
def test_broadcast_returns_a_new_array_and_leaves_the_input(edge_results, n):
    for count in [3, 300_001]:
        for r, res in enumerate(edge_results(n)):
            is_new, untouched, y = res["bcast new", count]
            assert is_new and untouched, f"n={n} count={count} rank {r}: broadcast wrote into its input"
            assert y.dtype == np.int64 and (y == n - 1).all(), f"n={n} count={count} rank {r}: wrong values"


@pytest.mark.parametrize("segment", ["1", "1000", "4099"])
def test_odd_segment_sizes(world_pool, segment):
    """RINGREDUCE_SEGMENT_BYTES that no itemsize divides: the ring must still
    cut between elements (the ring algorithm forced with SMALL_BYTES=0)."""
    ranks = world_pool.run(3, """
        from cases import DTYPES, np_dtype
        res = {}
        for dtype in DTYPES:
            x = (np.arange(20_011) % 13 + rr.rank()).astype(np_dtype(dtype))
            res[dtype] = (rr.allreduce(x), rr.allreduce(x, op="max"), rr.reduce_scatter(x),
                          rr.allgather(x[:1000 * rr.rank() + 7]), rr.broadcast(x, root=2))
        result = res
    """, timeout=120, env={"RINGREDUCE_SEGMENT_BYTES": segment, "RINGREDUCE_SMALL_BYTES": "0"})
    for dtype in DTYPES:
        xs = [(np.arange(20_011) % 13 + i).astype(np_dtype(dtype)) for i in range(3)]
        want_sum = (np.arange(20_011) % 13 * 3 + 3).astype(np_dtype(dtype))
        for r in ranks:
            s, m, chunk, g, b = r.result[dtype]
            case = f"segment={segment} {dtype} rank {r.rank}"
            assert s.tobytes() == want_sum.tobytes(), f"{case}: sum wrong"
            assert m.tobytes() == xs[2].tobytes(), f"{case}: max wrong"
            lo = [0, 6671, 13341, 20011][r.rank]
            assert chunk.tobytes() == want_sum[lo:[0, 6671, 13341, 20011][r.rank + 1]].tobytes(), f"{case}: chunk wrong"
            assert g.tobytes() == np.concatenate([xs[i][:1000 * i + 7] for i in range(3)]).tobytes(), f"{case}: gather"
            assert b.tobytes() == xs[2].tobytes(), f"{case}: broadcast wrong"


def test_shutdown_then_init_joins_a_new_ring(tmp_path):
    """shutdown() then init() right away, on the same RINGREDUCE_ADDR: a new ring."""
    ranks = run_ranks(3, """
        first = rr.allreduce(np.full(5, rr.rank() + 1.0)).tolist()
        rr.shutdown()
        down = rr.is_initialized()
        try:
            rr.allreduce(np.ones(2))
            between = "no error"
        except rr.RingReduceError as e:
            between = str(e)
        rr.init()
        rr.init()  # idempotent
        again = (rr.is_initialized(), rr.rank(), rr.size(),
                 rr.allreduce(np.full(200_000, rr.rank() + 1.0))[:2].tolist(), rr.allreduce(np.ones(2)).tolist())
        result = (first, down, between, again)
    """, tmp_path, timeout=60, env={"RINGREDUCE_START_TIMEOUT": "10"})
    for r in ranks:
        first, down, between, again = r.result
        assert first == [6.0] * 5
        assert down is False and "init" in between, (r.rank, down, between)
        assert again == (True, r.rank, 3, [6.0, 6.0], [3.0, 3.0]), (r.rank, again)


def test_single_process_every_dtype_and_op_is_a_copy():
    """A world of one (no RINGREDUCE_* variables): every collective returns a
    copy of its input, for every dtype, op and size, including out=."""
    code = """
import numpy as np, ringreduce as rr, ml_dtypes
rr.init()
bad = []
for name in ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]:
    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    for shape in [(0,), (1,), (7,), (3, 5, 7), (100_003,), ()]:
        x = (np.arange(int(np.prod(shape))) % 5 - 2).reshape(shape).astype(dt)
        for op in ["sum", "avg", "min", "max", "prod"]:
            y = rr.allreduce(x, op=op)
            if y is x or y.shape != x.shape or y.dtype != x.dtype or y.tobytes() != x.tobytes():
                bad.append(("allreduce", name, shape, op))
        o = np.empty_like(x)
        if rr.allreduce(x, out=o) is not o or o.tobytes() != x.tobytes():
            bad.append(("out", name, shape))
        if rr.reduce_scatter(x).tobytes() != x.tobytes() or rr.reduce_scatter(x).shape != (x.size,):
            bad.append(("reduce_scatter", name, shape))
        g = rr.allgather(x)
        if g.tobytes() != x.tobytes() or g.shape != (x.shape or (1,)):
            bad.append(("allgather", name, shape))
        b = rr.broadcast(x)
        if b is x or b.tobytes() != x.tobytes() or b.shape != x.shape:
            bad.append(("broadcast", name, shape))
rr.barrier()
print("bad:", bad)
"""
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("RINGREDUCE_", "OMPI_", "PMI_", "PMIX_")) and k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "bad: []", out.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_with_different_small_limits_agree_on_the_path(tmp_path, n):
    # RINGREDUCE_SMALL_BYTES differs: rank 1 would send everything inline, the
    # others take the ring. The path is decided from the agreed headers.
    ranks = run_ranks(n, """
        os.environ["RINGREDUCE_SMALL_BYTES"] = str(32 << 20) if os.environ["RINGREDUCE_RANK"] == "1" else "0"
        rr.init()
        count = 50_001
        x = np.arange(count, dtype=np.float32) + rr.rank()
        want = np.arange(count, dtype=np.float32) * rr.size() + sum(range(rr.size()))
        lo, hi = count * rr.rank() // rr.size(), count * (rr.rank() + 1) // rr.size()
        result = dict(
            allreduce=np.array_equal(rr.allreduce(x), want),
            avg=np.array_equal(rr.allreduce(x, op="avg"), want / rr.size()),
            reduce_scatter=rr.reduce_scatter(x).size > 0,
            broadcast=np.array_equal(rr.broadcast(x, root=1), np.arange(count, dtype=np.float32) + 1),
            broadcast0=np.array_equal(rr.broadcast(x, root=0), np.arange(count, dtype=np.float32)),
            allgather=np.array_equal(rr.allgather(x)[count:2 * count], np.arange(count, dtype=np.float32) + 1),
            after=rr.allreduce(np.ones(3)).tolist() == [float(rr.size())] * 3,
        )
        rs = rr.allgather(rr.reduce_scatter(x))
        result["reduce_scatter"] = result["reduce_scatter"] and np.array_equal(rs, want)
    """, tmp_path, init=False, timeout=90)
    for r in ranks:
        assert all(r.result.values()), (r.rank, r.result)


def test_big_endian_arrays_are_reduced_in_native_order(world_pool):
    ranks = world_pool.run(2, """
        out = {}
        for dt in [">f4", ">i8", ">f8", ">i4"]:
            for count in [5, 300_000]:
                x = (np.arange(count) % 100 + rr.rank()).astype(dt)
                want = (np.arange(count) % 100 * 2 + 1).astype(dt)
                y = rr.allreduce(x)
                o = np.empty(count, dtype=dt)
                rr.allreduce(x, out=o)
                out[(dt, count)] = (np.array_equal(y, want), y.dtype.isnative, np.array_equal(o, want),
                                    np.array_equal(rr.broadcast(x, root=1), (np.arange(count) % 100 + 1)),
                                    np.array_equal(rr.allgather(x)[:count], np.arange(count) % 100))
        result = out
    """, timeout=90)
    for r in ranks:
        for key, checks in r.result.items():
            assert all(checks), (r.rank, key, checks)
