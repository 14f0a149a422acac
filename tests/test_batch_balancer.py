"""ringreduce.balance.BatchBalancer: shares of the global batch move toward
each rank's measured speed, every `every` steps, identically on every rank;
integer shares, at least min_batch, summing to the global batch. Step times
are injected (record()), never measured, so the tests are deterministic."""
import pytest

from ringreduce.balance import apportion


@pytest.mark.parametrize("total, weights, least, want", [
    (10, [1, 1], 1, (5, 5)),
    (11, [1, 1], 1, (6, 5)),            # a tie goes to the lower rank
    (50, [2, 2, 1], 1, (20, 20, 10)),
    (7, [1, 1, 1], 1, (3, 2, 2)),
    (10, [1000, 1, 1], 2, (6, 2, 2)),   # min_batch holds; the rest goes by weight
    (4, [5, 0, 0, 0], 1, (1, 1, 1, 1)),
    (100, [3, 1], 1, (75, 25)),
])
def test_apportion(total, weights, least, want):
    got = apportion(total, weights, least)
    assert got == want
    assert sum(got) == total and min(got) >= least


def test_apportion_sums_and_bounds_over_many_cases():
    import random
    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randint(1, 8)
        least = rng.randint(1, 4)
        total = rng.randint(n * least, 500)
        weights = [rng.random() * rng.choice([1, 10, 1000]) for _ in range(n)]
        got = apportion(total, weights, least)
        assert sum(got) == total and min(got) >= least and len(got) == n
        ideal = [total * w / sum(weights) for w in weights]
        for g, i in zip(got, ideal):  # within one of proportional, unless min_batch lifted some
            assert g >= least and (g <= max(i + 1, least) or any(x < least for x in ideal))


CONVERGE = """
from ringreduce.balance import BatchBalancer
n, r = rr.size(), rr.rank()
# rank n-1 is twice as slow per sample: injected compute seconds, proportional to its batch
per_sample = [0.001] * (n - 1) + [0.002]
bal = BatchBalancer(global_batch_size=60, every=5, smoothing=0.5)
start = bal.shares
changes = []
for step in range(60):
    lo, hi = bal.rows(step)
    assert hi - lo == bal.local_batch_size
    bal.record(per_sample[r] * bal.local_batch_size)
    if bal.step():
        changes.append(step)
result = (start, bal.shares, bal.history, changes, [round(e, 6) for e in bal.estimates])
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shares_converge_to_measured_speed_on_every_rank(world_pool, n):
    ranks = world_pool.run(n, CONVERGE, timeout=120)
    start, final, history, changes, estimates = ranks[0].result
    assert sum(start) == 60 and max(start) - min(start) <= 1  # equal to begin with
    # throughput 1000 samples/s, the slow rank 500: shares 2:...:2:1
    want = apportion(60, [2] * (n - 1) + [1])
    assert final == want, (final, want)
    assert estimates == [1000.0] * (n - 1) + [500.0]
    assert changes and changes[0] == 4  # the first exchange, after `every` steps, already moves them
    for rk in ranks[1:]:
        assert rk.result == ranks[0].result  # every rank decided the same, at the same steps


SMOOTHED = """
from ringreduce.balance import BatchBalancer
r = rr.rank()
bal = BatchBalancer(global_batch_size=100, every=2, smoothing=0.75, min_batch=5)
seen = []
for step in range(40):
    # rank 1 is 3x slower from step 10 on (an injected slowdown); before that all alike
    slow = 3.0 if (r == 1 and step >= 10) else 1.0
    bal.record(0.01 * slow * bal.local_batch_size)
    bal.step()
    seen.append(bal.shares)
result = seen
"""


def test_smoothed_shares_move_gradually_toward_the_slowdown(world_pool):
    ranks = world_pool.run(2, SMOOTHED, timeout=120)
    seen = ranks[0].result
    assert ranks[1].result == seen
    assert all(sum(s) == 100 and min(s) >= 5 for s in seen)
    assert seen[9] == (50, 50)  # no slowdown yet: equal speeds keep equal shares
    slow_share = [s[1] for s in seen[10:]]
    # smoothing: the slow rank's share falls over several exchanges, not at once, never rising, toward 25
    assert slow_share[1] > 25 and slow_share[-1] in (25, 26)
    assert all(b <= a for a, b in zip(slow_share, slow_share[1:]))
    assert len(set(slow_share)) > 3


VALIDATION = """
from ringreduce.balance import BatchBalancer
r = rr.rank()
out = {}
bal = BatchBalancer(global_batch_size=[10, 10, 12][r], every=1)
bal.record(0.1)
try:
    bal.step()
    out["global"] = "ok"
except ValueError as e:
    out["global"] = str(e)
def local(fn):
    try:
        fn()
        return "ok"
    except ValueError as e:
        return str(e)
b = BatchBalancer(global_batch_size=9, every=3)
out["negative seconds"] = local(lambda: b.record(-1.0))
out["nan seconds"] = local(lambda: b.record(float("nan")))
out["too small"] = local(lambda: BatchBalancer(global_batch_size=5, min_batch=2))
out["bad shares"] = local(lambda: BatchBalancer(global_batch_size=9, shares=[3, 3, 2]))
out["bad smoothing"] = local(lambda: BatchBalancer(global_batch_size=9, smoothing=1.0))
# a rank that measured nothing keeps the shares where they are (no estimate for it yet)
c = BatchBalancer(global_batch_size=9, every=1)
if r != 0:
    c.record(0.5)
c.step()
out["unmeasured"] = c.shares
result = out
"""


def test_validation(world_pool):
    ranks = world_pool.run(3, VALIDATION, timeout=120)
    for rk in ranks:
        out = rk.result
        assert "disagree on global_batch_size" in out["global"] and "rank 2 has 12" in out["global"]
        for key in ("negative seconds", "nan seconds", "too small", "bad shares", "bad smoothing"):
            assert out[key] != "ok", key
        assert out["unmeasured"] == (3, 3, 3)


KERAS_FIT = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import time
import tensorflow as tf, keras
import ringreduce.tensorflow as rrtf
from ringreduce.tensorflow.balance import BatchBalancer, fit
rrtf.init()
n, r = rrtf.size(), rrtf.rank()
rng = np.random.default_rng(5)
X, Y = rng.standard_normal((47, 5)), rng.integers(0, 3, 47)   # 47: an epoch's remainder rows are left out
G = 10

class Slow(keras.layers.Layer):
    # sleeps 20 ms per row on rank 1 (an injected slowdown), passing its input through
    def call(self, x):
        if r != 1:
            return x
        pause = tf.numpy_function(lambda rows: np.float64(time.sleep(0.02 * rows) or 0.0), [tf.shape(x)[0]],
                                  tf.float64, stateful=True)
        pause.set_shape([])
        return x + tf.cast(pause, x.dtype) * 0

    def compute_output_shape(self, shape):
        return shape

def model(slow=False):
    keras.utils.set_random_seed(4)
    layers = [Slow(dtype="float64")] if slow else []
    return keras.Sequential([keras.Input((5,))] + layers + [keras.layers.Dense(3, dtype="float64")])

def reference(epochs):
    # one process, SGD on the global batches in fit()'s order
    m = model()
    loss = lambda y, z: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))
    for epoch in range(epochs):
        order = np.random.default_rng([0, epoch]).permutation(len(X))
        for k in range(len(X) // G):
            rows = order[k * G:(k + 1) * G]
            with tf.GradientTape() as t:
                l = loss(Y[rows], m(X[rows]))
            for v, g in zip(m.trainable_variables, t.gradient(l, m.trainable_variables)):
                v.assign_sub(0.5 * g)
    return [v.numpy() for v in m.trainable_variables]

out = {}
for label, kwargs in (("fixed", dict(every=1000, shares=[3, 7])), ("moving", dict(every=2, smoothing=0.0))):
    m = model(slow=label == "moving")
    m.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.5), local_batch_size=1),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64"))
    bal = BatchBalancer(global_batch_size=G, **kwargs)
    records = fit(m, X, Y, bal, epochs=2)
    out[label] = ([v.numpy() for v in m.trainable_variables], [rec[:3] for rec in records], bal.history)
out["want"] = reference(2)
result = out
"""


@pytest.mark.slow
def test_keras_fit_with_shares_trains_as_one_global_batch(tmp_path):
    """fit() shards by share and weights the gradients by it: two epochs
    equal plain SGD on the global batches, whatever the shares (fixed
    unequal, or moving every 2 steps with measured times). Tolerance: 1e-12
    relative, float64 (8 SGD steps, each within a few dozen ulps of the
    one-process step, see test_weighted_average.py)."""
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    import numpy as np
    from ranks import run_ranks
    ranks = run_ranks(2, KERAS_FIT, tmp_path, timeout=400, init=False)
    want = ranks[0].result["want"]
    for rk in ranks:
        for label in ("fixed", "moving"):
            got, records, history = rk.result[label]
            for g, w in zip(got, want):
                assert np.allclose(g, w, rtol=1e-12, atol=1e-12), (label, np.max(np.abs(g - w)))
            assert records == ranks[0].result[label][1] and history == ranks[0].result[label][2]
        assert [rec[2] for rec in rk.result["fixed"][1]] == [(3, 7)] * 2  # one round an epoch: shares never move
        assert len(rk.result["moving"][1]) == 4  # rounds of 2 steps, 4 steps an epoch, 2 epochs
        # rank 1 sleeps 20 ms a row in its step: its share falls below half (a sleep, not CPU: holds under load)
        assert rk.result["moving"][2][-1][1][1] < 5, rk.result["moving"][2]
