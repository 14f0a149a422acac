"""The collectives on GPU arrays (cupy) through the public API: ranks sharing
one GPU, and rings where CPU ranks and GPU ranks meet. Each GPU result must be
a cupy array on the input's device, bit-identical to what the host ring gives
for the same inputs (itself checked against numpy in test_allreduce.py).
A dtype the GPU ranks' cupy cannot hold (bfloat16 before cupy 14) is left
out on every rank alike, and the test warns naming it. Without a GPU only
the tests of that agreement and of a GPU array failing clearly run."""
import warnings

import numpy as np
import pytest

from needs import WHY_NO_GPU, gpu
from ranks import run_ranks


BODY = """
import cupy as cp
from cases import DTYPES, OPS, dtypes_every_rank_holds, make_input, np_dtype
mode = MODE
on_gpu = mode == "gpu" or (mode == "mixed" and rr.rank() % 2 == 1)
xp = cp if on_gpu else np
bad = []

def cupy_holds(name):
    if not on_gpu:
        return True
    try:
        a = np.arange(3).astype(np_dtype(name))
        back = cp.asnumpy(cp.asarray(a))
        return back.dtype == a.dtype and back.tobytes() == a.tobytes()
    except Exception:  # cupy's TypeError / ValueError for a dtype it has no type for
        return False

dtypes = dtypes_every_rank_holds(rr, cupy_holds)

def check(what, got, want):
    if on_gpu and not (isinstance(got, cp.ndarray) and got.device.id == 0):
        bad.append((what, "not a cupy array on device 0", type(got)))
        return
    got = cp.asnumpy(got) if on_gpu else got
    if got.shape != want.shape or got.tobytes() != want.tobytes():
        bad.append(what)

for dtype in dtypes:
    for op in OPS:
        for count in [0, 1, rr.size() - 1, 2 * rr.size() + 1, 70_001, 1_000_003]:
            x = make_input(rr.rank(), (count,), dtype, op)
            want = rr.allreduce(x, op=op)  # the host ring
            check(("allreduce", dtype, op, count), rr.allreduce(xp.asarray(x), op=op), want)
            if count == 70_001:  # every rank, or the ring's ranks run different sequences
                y = xp.asarray(x) if on_gpu else x.copy()
                rr.allreduce(y, op=op, out=y)
                check(("in place", dtype, op), y, want)
n, r = rr.size(), rr.rank()
for count in [5, 300_007]:
    x = (np.arange(count) % 97 + r).astype(np.float32)
    check(("reduce_scatter", count), rr.reduce_scatter(xp.asarray(x)), rr.reduce_scatter(x))
    rows = np.full((count // 100 + r, 3), r, dtype=np.int32)
    check(("allgather", count), rr.allgather(xp.asarray(rows)), rr.allgather(rows))
    b = np.arange(count, dtype=np.float64) * (r + 1)
    check(("broadcast", count), rr.broadcast(xp.asarray(b), root=n - 1), rr.broadcast(b, root=n - 1))
    pieces = np.full((n * (count // 10 + 1) + r, 2), r, dtype=np.int16)  # rank r sends r more rows to the last
    splits = [count // 10 + 1] * (n - 1) + [count // 10 + 1 + r]
    got, got_splits = rr.alltoall(xp.asarray(pieces), splits=splits)
    want, want_splits = rr.alltoall(pieces, splits=splits)
    check(("alltoall", count), got, want)
    if got_splits.tobytes() != want_splits.tobytes():
        bad.append(("alltoall splits", count))
result = bad, [d for d in DTYPES if d not in dtypes]
"""


def test_a_gpu_array_without_a_gpu_fails_clearly(tmp_path):
    if WHY_NO_GPU is None:
        pytest.skip("a GPU is here")
    [rank] = run_ranks(1, """
        class FakeGpuArray:  # what cupy arrays look like to ringreduce
            __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
        try:
            rr.allreduce(FakeGpuArray())
        except rr.RingReduceError as exc:
            result = str(exc)
    """, tmp_path)
    assert "GPU arrays need cupy and a CUDA device" in rank.result


@gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", ["gpu", "mixed"])
def test_collectives_on_gpu_arrays_equal_the_host_ring(tmp_path, n, mode):
    # Every dtype cupy holds: bfloat16 too from cupy 14 (ml_dtypes.bfloat16 arrays).
    ranks = run_ranks(n, BODY.replace("MODE", repr(mode)), tmp_path, timeout=600)
    for r in ranks:
        bad, _ = r.result
        assert bad == [], f"rank {r.rank}: {bad[:5]}"
    left_out = {tuple(r.result[1]) for r in ranks}
    assert len(left_out) == 1, left_out
    if left_out != {()}:
        warnings.warn(f"left out on every rank, cupy cannot hold them here: {sorted(left_out.pop())}")


def test_a_dtype_one_rank_cannot_hold_is_left_out_on_every_rank(tmp_path):
    """cases.dtypes_every_rank_holds: where one rank's array library cannot
    hold bfloat16 (rank 1's here), every rank leaves it out, and only it, so
    the ranks run the same cases in the same order."""
    ranks = run_ranks(3, """
        from cases import DTYPES, dtypes_every_rank_holds
        result = dtypes_every_rank_holds(rr, lambda name: not (rr.rank() == 1 and name == "bfloat16"))
    """, tmp_path)
    from cases import DTYPES
    for r in ranks:
        assert r.result == [d for d in DTYPES if d != "bfloat16"], (r.rank, r.result)


@gpu
def test_engine_fuses_gpu_tensors_on_the_gpu(tmp_path):
    ranks = run_ranks(2, """
        import cupy as cp
        from ringreduce.engine import engine
        e = engine()
        xs = [cp.full(1000 + i, rr.rank() + i, dtype=cp.float32) for i in range(5)]
        hs = [e.enqueue(f"t{i}", x, "sum") for i, x in enumerate(xs)]
        outs = [e.wait(h) for h in hs]
        result = [(type(o).__module__.split(".")[0], cp.asnumpy(o)) for o in outs]
    """, tmp_path, timeout=120)
    for r in ranks:
        for i, (kind, values) in enumerate(r.result):
            assert kind == "cupy" and np.array_equal(values, np.full(1000 + i, 1 + 2 * i, np.float32))
