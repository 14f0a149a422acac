"""Average of integer tensors through ringreduce.tensorflow: never a factor
cast to the integer dtype (1/size would be 0: silently all zeros).

As Horovod: a dense integer Average is the sum divided by size in float64,
truncated back to the dtype; a sparse one (tf.IndexedSlices) is the gathered
values divided by size with TF's `/`, a float tensor. Pinned for every
integer dtype, single and grouped, sparse, dense and mixed, eagerly and in a
tf.function, on two and three ranks."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

JOB = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
from ringreduce.tensorflow.ops import scale_tensor
hvd.init()
r, n = hvd.rank(), hvd.size()
bad = []

def check(label, got, want):
    # Float results within one rounding: inside a tf.function, TF's optimizer turns / size into * (1 / size).
    got, want = np.asarray(got), np.asarray(want)
    close = np.array_equal(got, want) if want.dtype.kind in "iu" else np.allclose(got, want, rtol=1e-6, atol=0)
    if got.shape != want.shape or got.dtype != want.dtype or not close:
        bad.append(f"{label}: got {got.dtype}{got.shape} {got.ravel()[:6]}, want {want.dtype}{want.shape} {want.ravel()[:6]}")

def rows(k, dtype):
    # Rank k's rows; the sums over ranks are not multiples of n.
    return np.array([[1 + k, 2], [7, 3 * k + 1]], dtype)

INTS = [tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.int64, tf.uint32, tf.uint64]
RING = {tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.int64}  # the ring's integer dtypes; sparse takes any
for dt in INTS:
    npdt = dt.as_numpy_dtype
    mine = rows(r, npdt)
    every = np.concatenate([rows(k, npdt) for k in range(n)])
    idx = np.array([r, n + r], np.int64)
    every_idx = np.concatenate([[k, n + k] for k in range(n)]).astype(np.int64)
    # Horovod's sparse average: values / size with TF's division.
    float_dt = (tf.constant(1, dt) / tf.constant(1, dt)).dtype.as_numpy_dtype
    want_sparse = every.astype(np.float64) / n
    want_sparse = want_sparse.astype(float_dt)
    total = np.sum([rows(k, npdt).astype(np.int64) for k in range(n)], axis=0)
    want_dense = (total.astype(np.float64) / n).astype(npdt)
    for mode, run in [("eager", lambda f: f()), ("tf.function", lambda f: tf.function(f)())]:
        label = f"{dt.name} {mode}"
        slices = tf.IndexedSlices(tf.constant(mine), tf.constant(idx), tf.constant([2 * n, 2], tf.int64))
        dense = tf.constant(mine)
        got = run(lambda: hvd.allreduce(slices, op=hvd.Average))
        check(f"sparse average {label}", got.values, want_sparse)
        check(f"sparse average indices {label}", got.indices, every_idx)
        got = run(lambda: hvd.allreduce(slices, op=hvd.Average, prescale_factor=2.0, postscale_factor=1.5))
        check(f"sparse average scaled {label}", got.values, (want_sparse.astype(np.float64) * 3.0).astype(float_dt))
        got = run(lambda: hvd.allreduce(slices, op=hvd.Sum, postscale_factor=0.5))
        check(f"sparse sum halved {label}", got.values, (every.astype(np.float64) * 0.5).astype(npdt))
        if dt not in RING:
            continue
        got = run(lambda: hvd.allreduce(dense, op=hvd.Average))
        check(f"dense average {label}", got, want_dense)
        got = run(lambda: hvd.grouped_allreduce([slices, slices], op=hvd.Average))
        for g in got:
            check(f"grouped sparse average {label}", g.values, want_sparse)
        got = run(lambda: hvd.grouped_allreduce([slices, dense], op=hvd.Average))
        check(f"grouped mixed average, sparse {label}", got[0].values, want_sparse)
        check(f"grouped mixed average, dense {label}", got[1], want_dense)
    # A factor below one on integers: computed in float64, then truncated (never cast to 0).
    check(f"scale_tensor {dt.name}", scale_tensor(tf.constant(mine), 0.5), (mine.astype(np.float64) * 0.5).astype(npdt))
result = bad
"""


@pytest.mark.parametrize("n", [2, 3])
def test_integer_average_is_never_zeroed(tmp_path, n):
    ranks = run_ranks(n, JOB, tmp_path, timeout=300, init=False)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: " + "\n".join(r.result)
