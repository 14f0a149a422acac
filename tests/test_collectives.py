"""reduce_scatter, allgather, broadcast, barrier, out=, odd inputs, world info."""
import subprocess
import sys

import numpy as np
import pytest

from cases import DTYPES, np_dtype
from ranks import REPO, run_ranks


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_reduce_scatter_chunks_concatenate_to_the_allreduce(tmp_path, n):
    ranks = run_ranks(n, """
        out = {}
        for count in [0, 1, rr.size() - 1, 2 * rr.size() + 1, 100_003]:
            for dtype in ["float32", "int64", "float16"]:
                x = (np.arange(count) % 11 + rr.rank()).astype(dtype)
                out[(count, dtype)] = (rr.reduce_scatter(x), rr.allreduce(x))
        x = np.arange(30, dtype=np.int32).reshape(5, 6) * (rr.rank() + 1)
        out["avg"] = (rr.reduce_scatter(x, op="avg"), rr.allreduce(x, op="avg").reshape(-1))
        result = out
    """, tmp_path)
    for key in ranks[0].result:
        chunks = [r.result[key][0] for r in ranks]
        full = ranks[0].result[key][1].reshape(-1)
        count = full.size
        for i, c in enumerate(chunks):
            assert c.ndim == 1 and c.dtype == full.dtype
            assert c.size == count // n + (1 if i < count % n else 0), f"{key}: chunk {i} has {c.size}"
        assert np.concatenate(chunks).tobytes() == full.tobytes(), f"{key}: chunks != allreduce"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_allgather_concatenates_uneven_rows(tmp_path, n):
    ranks = run_ranks(n, """
        from cases import DTYPES, np_dtype
        out = {}
        for dtype in DTYPES:
            rows = [0, 1, 3, 7, 2][rr.rank() % 5]
            out[dtype] = rr.allgather(np.full((rows, 3, 2), rr.rank() + 1).astype(np_dtype(dtype)))
        out["big"] = rr.allgather(np.full(70_000 + rr.rank(), rr.rank(), dtype=np.float32))
        out["scalar"] = rr.allgather(np.float64(rr.rank()))
        result = out
    """, tmp_path)
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
def test_broadcast_from_any_root(tmp_path, n):
    ranks = run_ranks(n, """
        from cases import DTYPES, np_dtype
        out = {}
        for root in range(rr.size()):
            for dtype in DTYPES:
                for count in [0, 1, 5, 300_001]:
                    x = np.full(count, root + 1 if rr.rank() == root else 99).astype(np_dtype(dtype))
                    out[(root, dtype, count)] = rr.broadcast(x, root=root)
        result = {k: (v.dtype.name, v.shape, bool((v == v.dtype.type(k[0] + 1)).all())) for k, v in out.items()}
    """, tmp_path)
    for r in ranks:
        for (root, dtype, count), (got_dtype, shape, ok) in r.result.items():
            assert ok and shape == (count,) and got_dtype == np_dtype(dtype).name, (r.rank, root, dtype, count)


def test_out_argument_and_non_contiguous_inputs(tmp_path):
    ranks = run_ranks(3, """
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
    """, tmp_path)
    for r in ranks:
        assert all(r.result.values()), (r.rank, r.result)


def test_bad_out_and_op_raise_locally(tmp_path):
    ranks = run_ranks(2, """
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
    """, tmp_path)
    for r in ranks:
        errors, after = r.result
        assert all(errors), errors
        assert after == [2.0, 2.0, 2.0]


def test_world_info_and_barrier(tmp_path):
    ranks = run_ranks(4, """
        import time
        if rr.rank() == 2:
            time.sleep(1.0)
        t0 = time.time()
        rr.barrier()
        waited = time.time() - t0
        result = (rr.rank(), rr.size(), rr.local_rank(), rr.local_size(), rr.is_initialized(), waited)
    """, tmp_path)
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
