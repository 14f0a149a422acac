"""rr.alltoall against numpy: every dtype, uneven and empty splits, 0-row
inputs, multi-dimensional rows; over shared-memory links, TCP, tiny pipeline
segments and MPI; bad splits and mismatches raise on every rank."""
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cases import MOVABLE, alltoall_input, alltoall_reference, digest
from ranks import REPO, run_ranks
from test_mpi import MPIRUN, _missing as mpi_missing

# Runs on every rank: each builds every rank's input (cases.py) for each case,
# checks its own result against numpy and returns a digest of it.
CHECK_CASES = """
from cases import MOVABLE, alltoall_input, alltoall_reference, digest

def splits_for(kind, case, origin, n):
    rng = np.random.default_rng([case, origin])
    if kind == 0:
        return [int(v) for v in rng.integers(0, 4, n)]            # uneven
    if kind == 1:
        return [0 if d % 2 else int(rng.integers(1, 3)) for d in range(n)]  # nothing to odd ranks
    if kind == 2:
        return [0] * n if origin == n - 1 else [1] * n            # one rank sends 0 rows
    if kind == 3:
        return [2] * n                                            # equal: splits=None
    return [int(v) for v in rng.integers(0, 3, n)]

def check_cases(dtypes, trailings, big_rows):
    n, r = rr.size(), rr.rank()
    out = {}
    case = 0
    for dtype in dtypes:
        for trailing in trailings:
            for kind in range(5):
                case += 1
                splits = [splits_for(kind, case, o, n) for o in range(n)]
                if kind == 4:  # large: the ring, not the inline header pass
                    splits = [[s * big_rows + (o + d) % 3 for d, s in enumerate(row)] for o, row in enumerate(splits)]
                inputs = [alltoall_input(o, splits[o], trailing, dtype, case) for o in range(n)]
                got, got_splits = rr.alltoall(inputs[r], splits=None if kind == 3 else splits[r], name=f"c{case}")
                want = alltoall_reference(inputs, splits, r)
                ok = (got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
                      and got_splits.dtype == np.int32 and got_splits.tolist() == [splits[o][r] for o in range(n)])
                out[(dtype, trailing, kind)] = (ok, digest(got))
    return out
"""


def assert_all_ok(ranks):
    for rk in ranks:
        bad = [case for case, (ok, _) in rk.result.items() if not ok]
        assert not bad, f"rank {rk.rank}: {bad[:5]} differ from numpy"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_alltoall_matches_numpy_for_every_dtype(world_pool, n):
    ranks = world_pool.run(n, CHECK_CASES + """
result = check_cases(MOVABLE, [(), (3, 2)], big_rows=2000)
# 0-row input on every rank, the default split, and Horovod's (size, 0) empty tensor
x = np.zeros((0, 4), np.float32)
got, splits = rr.alltoall(x)
empty = rr.alltoall(np.zeros((rr.size(), 0), np.int16))
result["empty"] = (got.shape == (0, 4) and splits.tolist() == [0] * rr.size()
                   and empty[0].shape == (rr.size(), 0) and empty[1].tolist() == [1] * rr.size(), "")
""", timeout=300)
    assert_all_ok(ranks)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("links", ["tcp", "shm"])
def test_alltoall_ring_pipelines_in_tiny_segments(world_pool, n, links):
    """Every case on the ring (no inline path) in 64-byte segments, so every
    block is cut in many windows and forwarding wraps across steps."""
    env = {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_SEGMENT_BYTES": "64"}
    if links == "tcp":
        env["RINGREDUCE_SHM_BYTES"] = "0"
    ranks = world_pool.run(n, CHECK_CASES + """
result = check_cases(["float32", "int16", "S4", "[('a', '<i4'), ('b', '<f8')]"], [(), (5,)], big_rows=40)
""", env=env, timeout=300)
    assert_all_ok(ranks)


@pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))
def test_alltoall_over_mpi(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, pickle, sys\nimport numpy as np\nimport ringreduce as rr\nrr.init()\n"
                      + CHECK_CASES + textwrap.dedent("""
        from ringreduce.core.communicator import current as _state
        result = check_cases(["float64", "uint16", "S4"], [(), (3,)], big_rows=3000)
        result["source"] = (_state.world.source == "MPI communicator", "")
        with open(sys.argv[1] + f".rank{rr.rank()}", "wb") as f:
            pickle.dump(result, f)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "RINGREDUCE_SEGMENT_BYTES": "4096"}
    proc = subprocess.run([MPIRUN, "-np", "3", sys.executable, str(script), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(3):
        res = pickle.loads((tmp_path / f"out.rank{r}").read_bytes())
        bad = [case for case, (ok, _) in res.items() if not ok]
        assert not bad, f"rank {r}: {bad[:5]}"


def test_bad_splits_and_mismatches_raise_on_every_rank_and_the_ring_stays_usable(world_pool):
    ranks = world_pool.run(3, """
n, r = rr.size(), rr.rank()
def attempt(x, splits=None):
    try:
        rr.alltoall(x, splits)
    except (rr.MismatchError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None
out = {}
ok = np.zeros((6, 2), np.float32)
out["dtype"] = attempt(ok.astype(np.int16 if r == 1 else np.uint16))
out["trailing"] = attempt(np.zeros((6, 3 if r == 2 else 2), np.float32))
out["length"] = attempt(ok, [2, 2, 2] if r != 1 else [3, 3])
out["negative"] = attempt(ok, [2, 2, 2] if r != 2 else [7, -1, 0])
out["sum"] = attempt(ok, [2, 2, 2] if r != 0 else [2, 2, 1])
out["indivisible"] = attempt(np.zeros((6 if r else 7, 2), np.float32))
out["bytes"] = attempt(np.zeros((3, 1), "S4" if r else "S5"), [1, 1, 1])
got, splits = rr.alltoall(np.full((3, 2), r, np.int64), [1, 1, 1])  # still usable
out["after"] = got[:, 0].tolist(), splits.tolist()
errors = {}
for name, call in [("scalar", lambda: rr.alltoall(np.float32(1))),
                   ("float splits", lambda: rr.alltoall(ok, [2.0, 2.0, 2.0])),
                   ("objects", lambda: rr.alltoall(np.array([None] * 3, dtype=object)))]:
    try:
        call()
    except (TypeError, ValueError) as exc:
        errors[name] = type(exc).__name__
out["local"] = errors
result = out
""", timeout=120)
    expect = {"dtype": ("MismatchError", ["rank 0: uint16", "rank 1: int16"]),
              "trailing": ("MismatchError", ["shape[1:]", "rank 2: (3,)"]),
              "length": ("ValueError", ["rank 1 passed 2"]),
              "negative": ("ValueError", ["rank 2", "[7, -1, 0]"]),
              "sum": ("ValueError", ["rank 0", "(sum 5) for 6 rows"]),
              "indivisible": ("ValueError", ["rank 0 has 7"]),
              "bytes": ("MismatchError", ["rank 0: |S5", "rank 1: |S4"])}
    for rk in ranks:
        for case, (cls, words) in expect.items():
            got = rk.result[case]
            assert got is not None and got[0] == cls, (rk.rank, case, got)
            assert all(w in got[1] for w in words), (rk.rank, case, got[1])
            assert got == ranks[0].result[case], "every rank raises the same error"
        assert rk.result["after"] == ([0, 1, 2], [1, 1, 1])
        assert rk.result["local"] == {"scalar": "ValueError", "float splits": "TypeError", "objects": "TypeError"}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_tensorflow_alltoall_values_and_gradient(tmp_path, n):
    """As hvd.alltoall: (received, received_splits) with splits, received
    alone without; the gradient sends every row's gradient home (the
    alltoall of the incoming gradient with received_splits), eager and in
    tf.function."""
    ranks = run_ranks(n, """
import tensorflow as tf
import ringreduce.tensorflow as rrtf
n, r = rr.size(), rr.rank()
out = {}
# Horovod's pattern: rank r sends r+1 copies of each destination's index.
vals = np.repeat(np.arange(n), r + 1).astype(np.float64)
x = tf.Variable(np.stack([vals, -vals], axis=1))
with tf.GradientTape() as tape:
    got, got_splits = rrtf.alltoall(x, tf.constant([r + 1] * n, tf.int32))
    weights = tf.cast(tf.range(tf.shape(got)[0]) + 1, tf.float64)[:, None]
    loss = tf.reduce_sum(got * weights)
out["eager"] = (got.numpy(), got_splits.numpy(), tape.gradient(loss, x).numpy())

@tf.function
def equal_split(y):
    with tf.GradientTape() as t:
        t.watch(y)
        received = rrtf.alltoall(y)  # no splits: the tensor alone
        loss = tf.reduce_sum(received * tf.cast(tf.range(tf.shape(received)[0]) + 1, tf.float32)[:, None])
    return received, t.gradient(loss, y)
y = tf.reshape(tf.range(2 * n * 3, dtype=tf.float32), (2 * n, 3)) + 100.0 * r
received, grad = equal_split(y)
out["function"] = (received.numpy(), grad.numpy())
out["int16"] = rrtf.alltoall(tf.constant(np.full((n, 2), r, np.int16))).numpy()
try:
    rrtf.alltoall(x, tf.constant([1.0] * n))
except TypeError as exc:
    out["float splits"] = str(exc)
result = out
""", tmp_path, timeout=300)
    for rk in ranks:
        r = rk.rank
        got, got_splits, grad = rk.result["eager"]
        assert got_splits.tolist() == [o + 1 for o in range(n)]
        assert got.shape == (n * (n + 1) // 2, 2) and (got[:, 0] == r).all() and (got[:, 1] == -r).all()
        # Rank r's rows for d land at d's rows sum(o+1 for o < r) ... : the
        # gradient is that position + 1.
        want = np.concatenate([np.arange(r + 1) + sum(o + 1 for o in range(r)) + 1 for _ in range(n)]).astype(float)
        assert np.array_equal(grad, np.stack([want, want], axis=1)), (r, grad)
        received, g = rk.result["function"]
        inputs = [np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) + 100 * o for o in range(n)]
        assert np.array_equal(received, np.concatenate([x[2 * r:2 * r + 2] for x in inputs]))
        pos = np.concatenate([np.arange(2) + 2 * r + 1 for _ in range(n)]).astype(np.float32)
        assert np.array_equal(g, np.repeat(pos[:, None], 3, axis=1))
        assert rk.result["int16"].dtype == np.int16 and rk.result["int16"][:, 0].tolist() == list(range(n))
        assert "int32 or int64" in rk.result["float splits"]
