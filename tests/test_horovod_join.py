"""hvd.join() in TensorFlow training with uneven data: the rank that runs out
first joins; the other's gradient allreduces go on with zeros in its place
(average still over both ranks, as Horovod's), eagerly and in tf.function;
join returns the rank that joined last; a broadcast afterwards resyncs."""
import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

JOB = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
hvd.init()
r = hvd.rank()
w = tf.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), name="w")
batches = [np.full((2, 3), r + 1.0 + s, np.float32) for s in range(3 if r == 0 else 5)]

def grads(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
    return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

def local(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
    return tape.gradient(loss, w).numpy()

step = tf.function(grads) if os.environ["MODE"] == "function" else grads
result = {"steps": []}
for x in batches:
    g = step(tf.constant(x)).numpy()
    result["steps"].append((g, local(x)))
    w.assign_sub(0.01 * g)
result["last"] = int(hvd.join())
hvd.broadcast_variables([w], root_rank=1)
result["w"] = w.numpy()
"""


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_join_with_uneven_batches(tmp_path, mode):
    ranks = run_ranks(2, JOB, tmp_path, env={"MODE": mode}, init=False, timeout=150)
    steps0, steps1 = ranks[0].result["steps"], ranks[1].result["steps"]
    assert len(steps0) == 3 and len(steps1) == 5
    for s in range(3):  # both ranks: the average of both
        want = (steps0[s][1] + steps1[s][1]) / 2
        np.testing.assert_allclose(steps0[s][0], want, rtol=1e-5)
        np.testing.assert_array_equal(steps0[s][0], steps1[s][0])
    for s in (3, 4):  # rank 0 has joined: its zeros, still divided by 2
        np.testing.assert_allclose(steps1[s][0], steps1[s][1] / 2, rtol=1e-5)
    assert ranks[0].result["last"] == ranks[1].result["last"] == 1
    np.testing.assert_array_equal(ranks[0].result["w"], ranks[1].result["w"])
