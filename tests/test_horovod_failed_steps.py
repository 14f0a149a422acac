"""A training step that fails on one collective of several (a MismatchError)
leaves nothing in flight: the steps after it train as if it had not run,
eagerly and in a tf.function, with DistributedGradientTape (and eagerly
with DistributedOptimizer). And
engine.withdraw, which makes that so."""
import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
import os, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
import ringreduce.tensorflow as rrtf
rrtf.init()
n, r = rrtf.size(), rrtf.rank()
BAD = 2  # the step whose last collective's shapes differ between ranks

w1 = tf.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), name="w1")
w2 = tf.Variable(np.linspace(0.5, -0.5, 3, dtype=np.float32).reshape(3, 1), name="w2")

@tf.custom_gradient
def slow_on_rank_1(w):
    # Rank 1's w1 gradient comes late: when its step fails, it has not yet
    # handed w1 over, while rank 0 has (the uneven state a real failure leaves).
    def grad(dy):
        pause = tf.numpy_function(lambda: np.float32(time.sleep(0.4 if r == 1 else 0.0) or 0.0), [], tf.float32)
        return dy + pause
    return tf.identity(w), grad

def batch(step):
    rows = 3 if (step == BAD and r == 1) else 2
    return tf.constant(np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 10 + r + step)

def loss_of(x):
    return tf.reduce_sum(tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, slow_on_rank_1(w1))), w2)) ** 2)

def local_grads(x):
    with tf.GradientTape() as tape:
        loss = loss_of(x)
    return [g.numpy() for g in tape.gradient(loss, [w1, w2])]
"""

TAPE = PRELUDE + """
def dist_grads(x):
    # x is a source too: its gradient has the batch's shape, which differs between
    # the ranks at step BAD only, in the same traced function.
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = loss_of(x)
    return rrtf.DistributedGradientTape(tape).gradient(loss, [w1, w2, x])[:2]

step_fn = tf.function(dist_grads, input_signature=[tf.TensorSpec([None, 4], tf.float32)])
if os.environ["MODE"] == "eager":
    def step_fn(x):  # eagerly a tensor has no name to pair by: the odd source is a variable
        extra = tf.Variable(np.ones(x.shape[0], np.float32), name="extra")
        with tf.GradientTape() as tape:
            loss = loss_of(x) + tf.reduce_sum(extra * tf.reduce_sum(x))
        return rrtf.DistributedGradientTape(tape).gradient(loss, [w1, w2, extra])[:2]

result = []
for step in range(5):
    x = batch(step)
    try:
        got = [g.numpy() for g in step_fn(x)]
    except Exception as e:
        result.append(("error", type(e).__name__, isinstance(e, tf.errors.FailedPreconditionError), str(e)))
        continue
    result.append(("ok", got, local_grads(x)))
    for v, g in zip((w1, w2), got):
        v.assign_sub(0.1 * g)
"""


@pytest.mark.parametrize("mode", ["function", "eager"])
def test_a_step_failing_on_one_collective_leaves_nothing_in_flight(tmp_path, mode):
    ranks = run_ranks(2, TAPE, tmp_path, env={"MODE": mode}, init=False, timeout=150)
    steps = [rk.result for rk in ranks]
    for s in range(5):
        outcomes = [steps[rank][s] for rank in range(2)]
        if s == 2:  # the bad step fails on both ranks, as a FailedPreconditionError naming the tensor
            for kind, name, precondition, text in outcomes:
                assert kind == "error" and precondition, (name, text)
                assert "differs between ranks" in text, text
            continue
        assert [o[0] for o in outcomes] == ["ok", "ok"], (s, outcomes)
        mean = [np.mean([outcomes[rank][2][i] for rank in range(2)], axis=0) for i in range(2)]
        for rank in range(2):
            for got, want in zip(outcomes[rank][1], mean):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {s} rank {rank}")
        for got0, got1 in zip(outcomes[0][1], outcomes[1][1]):
            np.testing.assert_array_equal(got0, got1)


OPTIMIZER = PRELUDE + """
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(0.1))
extra = {k: tf.Variable(np.zeros(k, np.float32), name="extra") for k in (2, 3)}
result = []
for step in range(5):
    x = batch(0)
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_of(x)
    pairs = list(zip(tape.gradient(loss, [w1, w2]), [w1, w2]))
    if step == BAD:  # a variable whose shape differs between the ranks, this step only
        v = extra[2 + r]
        pairs.append((tf.ones_like(v), v))
    before, local = [w1.numpy(), w2.numpy()], local_grads(x)
    try:
        opt.apply_gradients(pairs)
    except Exception as e:
        result.append(("error", type(e).__name__, isinstance(e, tf.errors.FailedPreconditionError), str(e)))
        w1.assign(before[0]); w2.assign(before[1])
        continue
    result.append(("ok", [(b - a.numpy()) / 0.1 for a, b in zip((w1, w2), before)], local))
"""


def test_a_failed_optimizer_step_leaves_nothing_in_flight(tmp_path):
    ranks = run_ranks(2, OPTIMIZER, tmp_path, init=False, timeout=150)
    steps = [rk.result for rk in ranks]
    for s in range(5):
        outcomes = [steps[rank][s] for rank in range(2)]
        if s == 2:
            for kind, name, precondition, text in outcomes:
                assert kind == "error" and precondition and "differs between ranks" in text, (name, text)
            continue
        assert [o[0] for o in outcomes] == ["ok", "ok"], (s, outcomes)
        mean = [np.mean([outcomes[rank][2][i] for rank in range(2)], axis=0) for i in range(2)]
        for rank in range(2):
            for got, want in zip(outcomes[rank][1], mean):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {s} rank {rank}")


ENGINE = """
from ringreduce.engine import engine
from ringreduce import WithdrawnError
eng = engine()
result = {}
# Rank 0 hands over a tensor rank 1 never does: withdrawn, its wait says so, and its name is free again.
if rr.rank() == 0:
    lone = eng.enqueue("lone", np.ones(3, np.float32), "sum")
    eng.withdraw(lone)
    try:
        eng.wait(lone)
    except WithdrawnError as e:
        result["withdrawn"] = str(e)
# Withdrawing one that ran (or is running) waits it out: nothing stays in flight.
h = eng.enqueue("both", np.full(4, rr.rank() + 1.0, np.float32), "sum")
eng.wait(h)
eng.withdraw(h)
again = eng.enqueue("lone", np.full(2, rr.rank() + 1.0, np.float32), "sum")
result["again"] = eng.wait(again).tolist()
result["pending"] = len(eng._pending)
"""


def test_engine_withdraw_frees_the_name_and_the_wait_raises(tmp_path):
    ranks = run_ranks(2, ENGINE, tmp_path, timeout=60)
    assert "withdrawn" in ranks[0].result["withdrawn"] and "'lone'" in ranks[0].result["withdrawn"]
    for rk in ranks:
        assert rk.result["again"] == [3.0, 3.0]
        assert rk.result["pending"] == 0
