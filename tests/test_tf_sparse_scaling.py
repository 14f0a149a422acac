"""Sparse allreduce (tf.IndexedSlices) applies prescale_factor and
postscale_factor, where Horovod raises NotImplementedError: the gathered
values times prescale * postscale, for Sum, and divided by size besides for
Average, on every float dtype (integers: tests/test_tf_integer_average.py),
eagerly and in a tf.function."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

JOB = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
bad = []
for dt in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
    npdt = dt.as_numpy_dtype
    rows = lambda k: np.array([[1.5 + k, -2.0], [0.25, 3.0 * k + 1]], np.float64)
    every = np.concatenate([rows(k) for k in range(n)])
    slices = tf.IndexedSlices(tf.constant(rows(r).astype(npdt)), tf.constant([r, n + r], tf.int64),
                              tf.constant([2 * n, 2], tf.int64))
    for op, pre, post in [(hvd.Sum, 2.0, 0.5), (hvd.Sum, 3.0, 1.0), (hvd.Average, 1.0, 4.0), (hvd.Average, 0.5, 3.0)]:
        want = every * pre * post / (n if op == hvd.Average else 1)
        for mode, run in [("eager", lambda f: f()), ("tf.function", lambda f: tf.function(f)())]:
            got = run(lambda: hvd.allreduce(slices, op=op, prescale_factor=pre, postscale_factor=post))
            values = got.values.numpy()
            tol = 1e-2 if dt.size == 2 else 1e-6
            if got.values.dtype != dt or not np.allclose(values.astype(np.float64), want, rtol=tol, atol=0):
                bad.append(f"{dt.name} {op} pre={pre} post={post} {mode}: {got.values.dtype.name} {values.ravel()}, "
                           f"want {want.ravel()}")
result = bad
"""


def test_sparse_allreduce_applies_prescale_and_postscale(tmp_path):
    ranks = run_ranks(2, JOB, tmp_path, timeout=240, init=False)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result}"
