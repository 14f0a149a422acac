"""rr.allreduce(x, op="avg", weight=w): the weighted mean sum_r(w_r x_r) /
sum_r(w_r), against numpy on every dtype, odd sizes, worlds of 2, 3 and 4;
bit-identical on every rank; integers and 16-bit floats computed wider
(no overflow, no truncation); bad weights raise on every rank, naming the
rank at fault, and leave the ring usable."""
import numpy as np
import pytest

from cases import DTYPES

# Ring sizes: 1 and 7 elements ride the small path; 40001 float64 (320 KB) take the ring.
CASES = """
import math
import ml_dtypes
from cases import digest, np_dtype
from ringreduce.core.collectives import weighted_dtypes
n, r = rr.size(), rr.rank()
out = {}
for dtype in DTYPES:
    dt = np_dtype(dtype)
    for size in (1, 7, (3, 5), 40001):
        for kind in ("int", "float"):
            rng = [np.random.default_rng([k, n, DTYPES.index(dtype)]) for k in range(n)]
            if dt.kind in "iu":
                info = np.iinfo(dt)
                xs = [g.integers(info.min, info.max, size, dtype=dt, endpoint=True) for g in rng]
            else:
                xs = [(g.standard_normal(size) * 100).astype(dt) for g in rng]
            ws = [k + 1 if k % 2 == 0 else 3 * k for k in range(n)]  # unequal, one rank often 3x another
            ws = [w if kind == "int" else w * 0.37 for w in ws]
            got = rr.allreduce(xs[r], op="avg", weight=ws[r])
            total = math.fsum(ws)
            ref = sum(np.asarray(x, np.float64) * (w / total) for x, w in zip(xs, ws))
            out[dtype, size, kind] = (digest(got), str(got.dtype), got.shape, got.astype(np.float64), ref)
result = out
"""


@pytest.fixture(scope="module")
def weighted_results(world_pool):
    cache = {}

    def get(n):
        if n not in cache:
            ranks = world_pool.run(n, f"DTYPES = {DTYPES!r}\n" + CASES, timeout=300)
            cache[n] = [r.result for r in ranks]
        return cache[n]
    return get


def _tolerance(dtype: str, n: int, ref: np.ndarray) -> np.ndarray:
    """How far a correct weighted mean may be from the float64 reference
    sum_r (w_r / W) x_r, elementwise:
    - float64: each rank's prescale x * (w/W) rounds once (half an ulp) and
      the N-term sum rounds N-1 times: within N ulps of the largest term.
    - float32: the same in float32 (the reference is float64): N float32 ulps.
    - float16, bfloat16: computed in float32 (error N float32 ulps, far below
      a 16-bit ulp), then rounded once to 16 bits: at most one 16-bit ulp of
      the result (half for the rounding, the rest for the float32 error
      moving a value across a rounding boundary), plus the float32 error
      itself where terms cancel to (near) zero.
    - integers: computed in float64 (the int64 inputs rounded to float64
      first, as the reference does): N float64 ulps of the largest term."""
    big = np.float64(np.max(np.abs(ref))) + 1.0
    if dtype == "float32":
        return np.full(ref.shape, n * np.finfo(np.float32).eps * big)
    if dtype in ("float16", "bfloat16"):
        import ml_dtypes
        info = ml_dtypes.finfo(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.finfo(np.float16)
        rounded = ref.astype(info.dtype).astype(np.float64)
        return np.abs(rounded) * float(info.eps) + float(info.smallest_subnormal) + n * np.finfo(np.float32).eps * big
    return np.full(ref.shape, n * np.finfo(np.float64).eps * big)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_mean_matches_numpy_on_every_rank(weighted_results, n, dtype):
    per_rank = weighted_results(n)
    cases = [k for k in per_rank[0] if k[0] == dtype]
    assert len(cases) == 8
    want_dtype = "float64" if dtype.startswith(("int", "uint")) else dtype
    for case in cases:
        dig0 = per_rank[0][case][0]
        for r, results in enumerate(per_rank):
            dig, got_dtype, shape, got, ref = results[case]
            assert got_dtype == want_dtype, f"rank {r}: {case} returned {got_dtype}"
            assert shape == np.shape(ref)
            err = np.abs(got - ref)
            tol = _tolerance(dtype, n, ref)
            assert np.all(err <= tol), f"rank {r} of {n}: {case} off by {err.max()} (tolerance {tol.max()})"
            assert dig == dig0, f"rank {r} of {n}: {case} not bit-identical to rank 0"


def test_no_overflow_no_truncation(world_pool):
    """Sums that overflow the input's dtype (int16 30000 + 30000, float16
    40000 + 40000) and means that are no integer (int32 1 and 2 weighted 1:2)."""
    ranks = world_pool.run(2, """
        import ml_dtypes
        r = rr.rank()
        a = rr.allreduce(np.full(5, 30000, np.int16), op="avg", weight=[1, 3][r])
        b = rr.allreduce(np.full(5, 40000, np.float16), op="avg", weight=[2.5, 0.5][r])
        c = rr.allreduce(np.array([1, 2], np.int32) if r == 0 else np.array([2, 4], np.int32), op="avg",
                         weight=[1, 2][r])
        d = rr.allreduce(np.full(3, 60000, np.uint16), op="avg", weight=[7, 9][r])
        e = rr.allreduce(np.full(3, 3e38, ml_dtypes.bfloat16), op="avg", weight=[1, 1][r])
        # a rank of weight 0 adds nothing, whatever it holds
        f = rr.allreduce(np.array([np.inf, np.nan], np.float32) if r == 1 else np.array([1.5, 2.5], np.float32),
                         op="avg", weight=[4, 0][r])
        result = [(v.dtype.name, v.astype(np.float64).tolist()) for v in (a, b, c, d, e, f)]
    """, timeout=120)
    for rk in ranks:
        a, b, c, d, e, f = rk.result
        assert a == ("float64", [30000.0] * 5)
        assert b == ("float16", [40000.0] * 5)
        assert c[0] == "float64" and np.allclose(c[1], [5 / 3, 10 / 3], rtol=4e-16, atol=0)  # 2 ulps
        assert d == ("float64", [60000.0] * 3)
        assert e[0] == "bfloat16" and np.isfinite(e[1]).all() and e[1] == ranks[0].result[4][1]
        assert f == ("float32", [1.5, 2.5])


def test_out_and_process_set(world_pool):
    ranks = world_pool.run(3, """
        r = rr.rank()
        out = np.empty(4, np.float64)
        got = rr.allreduce(np.full(4, r, np.int8), op="avg", weight=r + 1, out=out)
        try:
            rr.allreduce(np.full(4, r, np.int8), op="avg", weight=1, out=np.empty(4, np.int8))
        except ValueError as e:
            bad_out = str(e)
        except rr.MismatchError as e:
            bad_out = "mismatch " + str(e)
        ps = rr.add_process_set([0, 2])
        s = rr.allreduce(np.full(2, float(r)), op="avg", weight=[1, 0, 3][r], process_set=ps) if r != 1 else None
        result = (got is out, out.tolist(), bad_out, None if s is None else s.tolist())
    """, timeout=120)
    for rk in ranks:
        same, out, bad_out, s = rk.result
        assert same and out == [(0 * 1 + 1 * 2 + 2 * 3) / 6] * 4
        assert "out must be" in bad_out and "float64" in bad_out
        if rk.rank != 1:
            assert s == [(0 * 1 + 2 * 3) / 4] * 2


VALIDATION = """
import math
r = rr.rank()
def attempt(weight, op="avg"):
    try:
        rr.allreduce(np.ones(3, np.float32), op=op, weight=weight)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
out = {}
out["negative"] = attempt([2, -1, 3][r])
out["nan"] = attempt([2.0, 1.0, float("nan")][r])
out["inf"] = attempt([2.0, float("inf"), 1.0][r])
out["huge int"] = attempt([2, 1, 2**60][r])
out["zero total"] = attempt(0)
out["kinds"] = attempt([2, 1.5, 3][r])
out["not a number"] = attempt([2, "3", 3][r])
out["bool"] = attempt([True, 1, 1][r])
out["op"] = attempt(1 if r != 0 else 1, op="sum" if r == 0 else "avg")
# one rank passes no weight: it runs a plain allreduce beside the others' weighted one
try:
    if r == 2:
        rr.allreduce(np.ones(3, np.float32), op="avg")
    else:
        rr.allreduce(np.ones(3, np.float32), op="avg", weight=1)
    out["unweighted"] = "ok"
except Exception as e:
    out["unweighted"] = f"{type(e).__name__}: {e}"
# still usable: every error above came before data moved
out["after"] = rr.allreduce(np.ones(2), op="avg", weight=r + 1).tolist()
result = out
"""


def test_bad_weights_raise_on_every_rank_naming_the_rank(world_pool):
    ranks = world_pool.run(3, VALIDATION, timeout=120)
    for rk in ranks:
        got = rk.result
        assert got["negative"].startswith("ValueError") and "rank 1 (-1.0)" in got["negative"], got["negative"]
        assert got["nan"].startswith("ValueError") and "rank 2 (nan)" in got["nan"], got["nan"]
        assert got["inf"].startswith("ValueError") and "rank 1 (inf)" in got["inf"], got["inf"]
        assert got["huge int"].startswith("ValueError") and "rank 2 (an integer beyond 2**53)" in got["huge int"]
        assert got["zero total"].startswith("ValueError") and "sum to 0" in got["zero total"]
        assert got["kinds"].startswith("ValueError") and "float weights on rank 1" in got["kinds"], got["kinds"]
        if rk.rank == 1:
            assert got["not a number"].startswith("TypeError") and "real number" in got["not a number"]
        else:
            assert got["not a number"].startswith("MismatchError") and "rank 1" in got["not a number"]
            assert "real number" in got["not a number"]
        if rk.rank == 0:
            assert got["bool"].startswith("TypeError")
            assert got["op"].startswith("ValueError") and "op='avg'" in got["op"]
        else:
            assert got["bool"].startswith("MismatchError") and "rank 0" in got["bool"]
            assert got["op"].startswith("MismatchError") and "rank 0" in got["op"]
        assert got["unweighted"].startswith("MismatchError"), got["unweighted"]
        assert got["after"] == [1.0, 1.0]  # a weighted mean of ones


# --------------------------------------------------------------------------- TensorFlow

TF_JOB = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf, keras
import ringreduce.tensorflow as rrtf
rrtf.init()
n, r = rrtf.size(), rrtf.rank()
b = [2, 5, 9][:n]                        # unequal local batches
B = sum(b)
rng = np.random.default_rng(7)
X, Y = rng.standard_normal((B, 6)), rng.integers(0, 3, B)
lo = sum(b[:r])
xs, ys = X[lo:lo + b[r]], Y[lo:lo + b[r]]
# the batch's mean, in the logits' dtype (Keras' losses compute in floatx, float32, whatever the model's)
loss_fn = lambda y, logits: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
out = {}

def model_for(dtype):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh", dtype=dtype),
                             keras.layers.Dense(3, dtype=dtype)])

def big_batch_grads(m):
    with tf.GradientTape() as t:
        loss = loss_fn(Y, m(X))
    return [g.numpy() for g in t.gradient(loss, m.trainable_variables)]

for dtype in ("float64", "float32"):
    m = model_for(dtype)
    @tf.function
    def step(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(y, m(x))
        tape = rrtf.DistributedGradientTape(t, local_batch_size=tf.shape(x)[0])
        return tape.gradient(loss, m.trainable_variables)
    out["tape", dtype] = ([g.numpy() for g in step(tf.constant(xs, dtype), tf.constant(ys))], big_batch_grads(m))
    plain = rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=b[r])  # a number, eagerly
    with plain as t:
        loss = loss_fn(tf.constant(ys), m(tf.constant(xs, dtype)))
    out["eager number", dtype] = ([g.numpy() for g in t.gradient(loss, m.trainable_variables)], big_batch_grads(m))

# Keras fit with DistributedOptimizer: one SGD step (lr 1) on each rank's shard == one big-batch step.
m = model_for("float64")
before = [v.numpy() for v in m.trainable_variables]
want = [w - g for w, g in zip(before, big_batch_grads(m))]
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), local_batch_size=b[r])
m.compile(optimizer=opt, loss=keras_loss)
m.fit(xs, ys, batch_size=b[r], epochs=1, shuffle=False, verbose=0)
out["fit"] = ([v.numpy() for v in m.trainable_variables], want)
# The compiled step reads the weight at every step: equal weights now give the plain mean of the ranks' gradients.
before = [v.numpy() for v in m.trainable_variables]
with tf.GradientTape() as t:
    loss = loss_fn(ys, m(xs))
mine = [g.numpy() for g in t.gradient(loss, m.trainable_variables)]
mean = [rr.allreduce(g, op="avg") for g in mine]
opt.set_local_batch_size(1)
m.fit(xs, ys, batch_size=b[r], epochs=1, shuffle=False, verbose=0)
out["fit reweighted"] = ([v.numpy() for v in m.trainable_variables], [w - g for w, g in zip(before, mean)])
import pickle
opt.set_local_batch_size(b[r])
clone = pickle.loads(pickle.dumps(opt))  # the weight travels as its value; the clone has a variable of its own
out["pickled"] = (type(clone)._rr_reduction._weight.numpy().tolist(),
                  type(clone)._rr_reduction._weight is not type(opt)._rr_reduction._weight)

# Sparse gradients (an embedding's IndexedSlices) and fp16 compression, weighted.
keras.utils.set_random_seed(2)
emb = keras.layers.Embedding(10, 4, dtype="float64")
ids_all = rng.integers(0, 10, B)
ids = ids_all[lo:lo + b[r]]
emb.build((None,))
def emb_loss(i):
    return tf.reduce_mean(tf.reduce_sum(emb(i) ** 2, axis=1))
with tf.GradientTape() as t:
    loss = emb_loss(ids_all)
want = tf.convert_to_tensor(t.gradient(loss, emb.trainable_variables)[0]).numpy()
with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=b[r]) as t:
    loss = emb_loss(ids)
g = t.gradient(loss, emb.trainable_variables)[0]
out["sparse"] = (isinstance(g, tf.IndexedSlices), tf.convert_to_tensor(g).numpy(), want)
m = model_for("float32")
with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=b[r], compression=rrtf.Compression.fp16) as t:
    loss = loss_fn(ys, m(xs))
out["fp16"] = ([g.numpy() for g in t.gradient(loss, m.trainable_variables)], big_batch_grads(m))
with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=b[r], compression=rrtf.Compression.int8) as t:
    loss = loss_fn(ys, m(xs))
out["int8"] = ([g.numpy() for g in t.gradient(loss, m.trainable_variables)], big_batch_grads(m))
with tf.GradientTape() as t:
    loss = loss_fn(ys, m(xs))
out["int8 largest"] = max(float(np.max(np.abs(g.numpy()))) * b[r] / B for g in t.gradient(loss, m.trainable_variables))

# On a process set: ranks 0 and 2 average weighted by their batches; a bad weight is named by world and set rank.
ps = rrtf.add_process_set([0, 2])
m = model_for("float64")  # on every rank: Keras names layers by count, and gradients are paired by those names
if r != 1:
    with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=b[r], process_set=ps) as t:
        loss = loss_fn(ys, m(xs))
    got = [g.numpy() for g in t.gradient(loss, m.trainable_variables)]
    rows = np.r_[0:b[0], b[0] + b[1]:B]
    with tf.GradientTape() as t:
        loss = loss_fn(Y[rows], m(X[rows]))
    out["set"] = (got, [g.numpy() for g in t.gradient(loss, m.trainable_variables)])
    try:
        with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=[1, 0, -2][r], process_set=ps) as t:
            loss = loss_fn(ys, m(xs))
        t.gradient(loss, m.trainable_variables)
        out["set bad"] = "ok"
    except Exception as e:
        out["set bad"] = f"{type(e).__name__}: {e}"
# rank 1 waits in the engine (which negotiates the set's work on the world's ring) until the set is done
rrtf.allreduce(tf.constant(1.0), name="set done")
rrtf.remove_process_set(ps)

# Bad weights fail the step on every rank, naming the rank; the ring goes on.
def attempt(weight):
    try:
        with rrtf.DistributedGradientTape(tf.GradientTape(), local_batch_size=weight) as t:
            loss = loss_fn(ys, m(xs))
        t.gradient(loss, m.trainable_variables)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
out["negative"] = attempt([4, -3, 2][r])
out["zero"] = attempt(0)
out["after"] = attempt(b[r])
try:
    rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), op=rrtf.Sum, local_batch_size=3)
except ValueError as e:
    out["sum"] = str(e)
unweighted = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0))
m2 = model_for("float32")
m2.compile(optimizer=unweighted, loss=keras_loss)
m2.fit(xs[:2], ys[:2], batch_size=2, epochs=1, verbose=0)
try:
    unweighted.set_local_batch_size(3)
except RuntimeError as e:
    out["late"] = str(e)
result = out
"""


def _close(got, want, rtol_eps, dtype):
    """|got - want| <= k * eps(dtype) * (max |want| + 1), elementwise for each pair."""
    eps = np.finfo(dtype).eps
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        bound = rtol_eps * eps * (np.max(np.abs(w)) + 1.0)
        assert np.max(np.abs(g - w)) <= bound, f"off by {np.max(np.abs(g - w))}, bound {bound}"


@pytest.mark.slow
def test_tensorflow_weighted_gradients_equal_one_big_batch(tmp_path):
    """Unequal local batches (2, 5, 9 rows on 3 ranks), each rank's loss the
    mean of its own batch: the weighted average equals the gradient of the
    mean loss over all 16 rows, computed on one rank. Tolerance: 64 ulps of
    the gradient's dtype times its largest element. Both sides sum at most
    16 per-row terms (error within ~16 ulps each side, the big batch's in
    one reduction, the weighted one in a local mean, one prescale rounding
    and a 3-term ring sum), so 64 ulps leaves room while a wrong weight (the
    plain mean of 2-, 5- and 9-row means differs by tens of percent) fails
    by orders of magnitude."""
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    from ranks import run_ranks
    ranks = run_ranks(3, TF_JOB, tmp_path, timeout=400, init=False)
    for rk in ranks:
        out = rk.result
        for dtype in ("float64", "float32"):
            _close(*out["tape", dtype], 64, dtype)
            _close(*out["eager number", dtype], 64, dtype)
        _close(*out["fit"], 64, "float64")
        _close(*out["fit reweighted"], 64, "float64")
        is_sparse, got, want = out["sparse"]
        assert is_sparse
        _close([got], [want], 64, "float64")
        _close(*out["fp16"], 4, "float16")  # fp16 on the wire: a few float16 ulps
        # int8 on the wire (docs/compression.md): each rank rounds its prescaled gradient to L = 127 // N levels
        # of a block's largest value on any rank (S), so the sum is off by at most N * S / (2 L), plus float32
        largest = max(other.result["int8 largest"] for other in ranks)
        for g, w in zip(*out["int8"]):
            assert np.max(np.abs(g - w)) <= 3 * largest / (2 * (127 // 3)) * 1.001 + 1e-6, np.max(np.abs(g - w))
        assert "rank 1 (-3.0)" in out["negative"], out["negative"]
        assert "sum to 0" in out["zero"], out["zero"]
        assert out["after"] == "ok"
        if rk.rank != 1:
            _close(*out["set"], 64, "float64")
            assert "world rank 2 (rank 1 of process set 1) (-2.0)" in out["set bad"], out["set bad"]
        assert out["pickled"] == ([1.0, float([2, 5, 9][rk.rank])], True)
        assert "op=Average" in out["sum"]
        assert "already reduced unweighted" in out["late"]
    for rk in ranks[1:]:  # bit-identical everywhere
        for k in ("tape", "float32"), "fit":
            for a, b in zip(rk.result[k][0], ranks[0].result[k][0]):
                assert np.array_equal(a, b)
