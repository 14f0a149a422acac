"""horovod.tensorflow's optimizer options, Partial* wrappers,
SyncBatchNormalization and rewrapping a built optimizer: few multi-rank jobs
(TensorFlow is slow to import), each checking many things."""
import re

import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
import ringreduce.tensorflow as rrtf
rrtf.init()
n, r = rrtf.size(), rrtf.rank()
"""

OPTIONS = PRELUDE + """
import ringreduce.tensorflow.overlap as ov
from ringreduce.tensorflow.optimizer import Average, Sum
out = {}
handed = []  # what each rank hands to the engine: (name, op, array)
real_submit = ov.HandOvers.submit
def spying_submit(self, name, op, array, process_set=None, compression=None):
    handed.append((name, op, np.array(array)))
    return real_submit(self, name, op, array, process_set, compression)
ov.HandOvers.submit = spying_submit

vs = [tf.Variable(np.zeros(k + 2, dtype=np.float32), name=f"v{k}") for k in range(4)]
def tape_grads(local=False, **options):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(v) * float((r + 1) * (k + 1)) for k, v in enumerate(vs))
        t = rrtf.DistributedGradientTape(tape, **options)
        if local:
            t.register_local_source(vs[0])
        return t.gradient(loss, vs)
    handed.clear()
    grads = [g.numpy() for g in step()]
    ops = [o for o in step.get_concrete_function().graph.get_operations() if "RingHandOver" in o.name and "PyFunc" in o.type]
    return grads, len(ops), list(handed)

out["avg"] = tape_grads(op=Average)
out["sum"] = tape_grads(op=Sum)
out["sum string"] = tape_grads(op="sum")
out["average=False"] = tape_grads(average=False)
out["predivide"] = tape_grads(op=Average, gradient_predivide_factor=4.0)
out["groups=2"] = tape_grads(groups=2)
out["groups list"] = tape_grads(groups=[[vs[0], vs[3]]])
out["local"] = tape_grads(local=True)

# Partial tape: a local layer keeps its own gradient (over size); the shared one is averaged.
keras.utils.set_random_seed(0)
local_layer, shared_layer = keras.layers.Dense(3), keras.layers.Dense(2)
x = tf.constant(np.full((4, 5), r + 1.0, dtype=np.float32))
with tf.GradientTape(persistent=True) as tape:
    loss = tf.reduce_sum(shared_layer(local_layer(x)))
plain = tape.gradient(loss, local_layer.trainable_weights + shared_layer.trainable_weights)
partial = rrtf.PartialDistributedGradientTape(tape, local_layers=local_layer).gradient(
    loss, local_layer.trainable_weights + shared_layer.trainable_weights)
out["partial tape"] = ([g.numpy() for g in plain], [g.numpy() for g in partial])

# Accumulation: 4 passes, averaged over them; iterations counts every pass (as Horovod).
w = tf.Variable(np.zeros(3, dtype=np.float32))
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                average_aggregated_gradients=True)
trace = []
for i in range(4):
    opt.apply([tf.constant(np.full(3, r + 1.0 + i, dtype=np.float32))], [w])
    trace.append((w.numpy().copy(), int(opt.iterations.numpy())))
out["accumulated"] = trace

# Options that cannot work raise, on every rank, before any data moves
# (a look-alike of a ProcessSet is not one: training on a set is in test_tensorflow.py).
class OtherSet:
    process_set_id, ranks = 1, [0]
errors = {}
for label, call in [
    ("process set", lambda: rrtf.DistributedOptimizer(keras.optimizers.SGD(), process_set=OtherSet())),
    ("max", lambda: rrtf.DistributedOptimizer(keras.optimizers.SGD(), op="max")),
    ("predivide with sum", lambda: rrtf.DistributedOptimizer(keras.optimizers.SGD(), op=Sum,
                                                             gradient_predivide_factor=2.0)),
    ("not keras", lambda: rrtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))),
]:
    try:
        call()
        errors[label] = "no error"
    except Exception as e:
        errors[label] = type(e).__name__
out["errors"] = errors
rrtf.DistributedOptimizer(keras.optimizers.SGD(), process_set=None)  # the global set: fine
result = out
"""


@pytest.mark.parametrize("n", [2, 3])
def test_options_of_the_tape_and_optimizer(tmp_path, n):
    ranks = run_ranks(n, OPTIONS, tmp_path, timeout=240, init=False)
    mean_rank = (n + 1) / 2  # rank r's gradient of v_k is (r+1)(k+1)
    for rk in ranks:
        res = rk.result
        for label, factor in [("avg", mean_rank), ("sum", n * mean_rank), ("sum string", n * mean_rank),
                              ("average=False", n * mean_rank), ("predivide", mean_rank),
                              ("groups=2", mean_rank), ("groups list", mean_rank)]:
            grads, hand_overs, _ = res[label]
            for k, g in enumerate(grads):
                np.testing.assert_allclose(g, np.full(k + 2, factor * (k + 1)), rtol=1e-6, err_msg=label)
        # One hand-over per gradient; one per group when grouped (the two others alone).
        assert res["avg"][1] == 4 and res["groups=2"][1] == 2 and res["groups list"][1] == 3
        # Predivided by 4 before the ring, summed there, and multiplied by 4/size after.
        for name, op, array in res["predivide"][2]:
            k = int(re.search(r"v(\d+):0$", name).group(1))  # the variable v{k} the gradient is of
            assert op == "sum"
            np.testing.assert_allclose(array, np.full(k + 2, (rk.rank + 1) * (k + 1) / 4.0), rtol=1e-6)
        # A local source: this rank's own gradient over size; the others averaged.
        grads, hand_overs, handed = res["local"]
        np.testing.assert_allclose(grads[0], np.full(2, (rk.rank + 1) / n), rtol=1e-6)
        np.testing.assert_allclose(grads[1], np.full(3, mean_rank * 2), rtol=1e-6)
        assert hand_overs == 3 and not any(name.endswith(".v0:0") for name, _, _ in handed)
        plain, partial = res["partial tape"]
        np.testing.assert_allclose(partial[0], plain[0] / n, rtol=1e-6)  # local kernel
        np.testing.assert_allclose(partial[1], plain[1] / n, rtol=1e-6)  # local bias
        np.testing.assert_allclose(partial[2], np.mean([r.result["partial tape"][0][2] for r in ranks], axis=0),
                                   rtol=1e-5)
        # Passes i=0..3 on rank r give r+1+i: updates after passes 2 and 4, each the mean over
        # 2 passes and n ranks; iterations 1, 2, 3, 4.
        (w0, it0), (w1, it1), (w2, it2), (w3, it3) = res["accumulated"]
        assert (it0, it1, it2, it3) == (1, 2, 3, 4)
        np.testing.assert_array_equal(w0, np.zeros(3))
        np.testing.assert_allclose(w1, np.full(3, -(mean_rank + 0.5)), rtol=1e-6)
        np.testing.assert_array_equal(w2, w1)
        np.testing.assert_allclose(w3, w1 - (mean_rank + 2.5), rtol=1e-6)
        assert res["errors"] == {"process set": "TypeError", "max": "ValueError",
                                 "predivide with sum": "ValueError", "not keras": "ValueError"}, res["errors"]


TRAINING = PRELUDE + """
import ringreduce as rr
from ringreduce.tensorflow.optimizer import Average
out = {}
rng = np.random.default_rng(0)
batch, steps, lr = 6, 4, 0.1
x = rng.normal(size=(n * batch * steps, 5)).astype(np.float32) * 2 + 1
y = rng.integers(0, 3, size=n * batch * steps)
idx = np.concatenate([np.arange((i * n + r) * batch, (i * n + r + 1) * batch) for i in range(steps)])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# 1. SyncBatchNormalization in fit, with predivided and grouped gradients: N ranks on their
#    shards train like one process (plain BatchNormalization) on the whole batch.
def make_model(norm):
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), norm(momentum=0.5),
                             keras.layers.Activation("relu"), keras.layers.Dense(3)])
model = make_model(rrtf.SyncBatchNormalization)
model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(lr), op=Average,
                                                  gradient_predivide_factor=float(n), groups=2), loss=loss)
model.fit(x[idx], y[idx], batch_size=batch, epochs=1, shuffle=False, verbose=0)
out["syncbn weights"] = model.get_weights()  # kernels, gamma, beta, moving mean and variance

# 2. Unequal batches (rank r holds r + 2 rows): outputs, moving statistics and gradients
#    (summed over ranks) equal one process's on the rows of every rank together.
rows = [k + 2 for k in range(n)]
start = sum(rows[:r])
data = rng.normal(size=(sum(rows), 4)).astype(np.float32) * 3 - 1
weights = rng.normal(size=(sum(rows), 4)).astype(np.float32)
def run_bn(layer, xs, ws, tape_wrapper):
    xs = tf.constant(xs)
    with tf.GradientTape() as tape:
        tape.watch(xs)
        yv = layer(xs, training=True)
        l = tf.reduce_sum(yv * ws)
    grads = tape_wrapper(tape).gradient(l, [xs, layer.gamma, layer.beta])
    return [yv.numpy(), layer.moving_mean.numpy(), layer.moving_variance.numpy()] + [g.numpy() for g in grads]
bn = rrtf.SyncBatchNormalization(momentum=0.0)
bn.build((None, 4))
# the input's gradient is this rank's own; gamma's and beta's are summed over ranks
class SumShared:
    def __init__(self, tape):
        self.tape = tape
    def gradient(self, target, sources):
        t = rrtf.DistributedGradientTape(self.tape, op="sum", scale_local_gradients=False)
        t.register_local_source(sources[0])
        return t.gradient(target, sources)
out["unequal"] = run_bn(bn, data[start:start + rows[r]], weights[start:start + rows[r]], SumShared)

# 3. PartialDistributedOptimizer in fit: the local layer is each rank's own (its own start),
#    the shared one stays identical; both equal one process minimising the mean of every
#    rank's loss, where each rank's local layer sees only that rank's data.
def local_and_shared(seed):
    local = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed))
    shared = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(100))
    return local, shared
local, shared = local_and_shared(seed=r)
pmodel = keras.Sequential([keras.Input((5,)), local, shared])
start_local = [w.copy() for w in local.get_weights()]
pmodel.compile(optimizer=rrtf.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[local]), loss=loss)
pmodel.fit(x[idx], y[idx], batch_size=batch, epochs=1, shuffle=False, verbose=0)
out["partial local"] = local.get_weights()
out["partial shared"] = shared.get_weights()
all_starts = [rr.allgather(w[None]) for w in start_local]  # every rank's local start, for rank 0
# One process, on rank 0 only, once every distributed part is done: the layers it makes would
# shift the names of later layers (and so of their gradients) on rank 0 alone.
if r == 0:
    single = make_model(keras.layers.BatchNormalization)
    single.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    single.fit(x, y, batch_size=n * batch, epochs=1, shuffle=False, verbose=0)
    out["single syncbn weights"] = single.get_weights()
    plain_bn = keras.layers.BatchNormalization(momentum=0.0)
    plain_bn.build((None, 4))
    out["unequal single"] = run_bn(plain_bn, data, weights, lambda tape: tape)
    out["rows"] = rows
    locals_, shared1 = [], None
    for k in range(n):
        lk, sk = local_and_shared(seed=k)
        lk.build((None, 5))
        lk.set_weights([s[k] for s in all_starts])
        locals_.append(lk)
        if shared1 is None:
            shared1 = sk
            shared1.build((None, 4))
    sgd = keras.optimizers.SGD(lr)
    variables = [v for lk in locals_ for v in lk.trainable_weights] + shared1.trainable_weights
    for i in range(steps):
        with tf.GradientTape() as tape:
            total = 0.0
            for k in range(n):
                rows_k = slice((i * n + k) * batch, (i * n + k + 1) * batch)
                total += loss(y[rows_k], shared1(locals_[k](x[rows_k])))
            total = total / n
        sgd.apply(tape.gradient(total, variables), variables)
    out["partial single"] = ([lk.get_weights() for lk in locals_], shared1.get_weights())
result = out
"""


@pytest.mark.parametrize("n", [2, 3])
def test_syncbn_partial_and_options_train_like_one_process(tmp_path, n):
    ranks = run_ranks(n, TRAINING, tmp_path, timeout=300, init=False)
    zero = ranks[0].result
    for rk in ranks:
        for mine, want in zip(rk.result["syncbn weights"], zero["single syncbn weights"]):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
        rows = zero["rows"]
        start = sum(rows[:rk.rank])
        y, mean, var, dx, dgamma, dbeta = rk.result["unequal"]
        y1, mean1, var1, dx1, dgamma1, dbeta1 = zero["unequal single"]
        np.testing.assert_allclose(y, y1[start:start + rows[rk.rank]], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dx, dx1[start:start + rows[rk.rank]], rtol=1e-4, atol=1e-5)
        for mine, want in [(mean, mean1), (var, var1), (dgamma, dgamma1), (dbeta, dbeta1)]:
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
        single_locals, single_shared = zero["partial single"]
        for mine, want in zip(rk.result["partial shared"], single_shared):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
        for mine, want in zip(rk.result["partial local"], single_locals[rk.rank]):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(ranks[0].result["partial local"][0], ranks[1].result["partial local"][0])


REWRAP = PRELUDE + """
import sys
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 4)).astype(np.float32)
y = (x.sum(axis=1) > 0).astype(np.int64)
def build():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
out = {}
# A model trained without ringreduce (the same on every rank), saved, loaded as load_model does.
model = build()
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
path = os.path.join(os.environ["RR_TEST_DIR"], f"plain{r}.keras")
model.save(path)
loaded = keras.models.load_model(path)
state = [v.numpy().copy() for v in loaded.optimizer.variables]
opt = rrtf.DistributedOptimizer(loaded.optimizer)
out["same object"] = opt is loaded.optimizer
out["state kept"] = all(np.array_equal(a, v.numpy()) for a, v in zip(state, opt.variables)) and len(state) == len(opt.variables)
out["iterations"] = int(opt.iterations.numpy())
out["class"] = (type(opt).__module__, type(opt).__qualname__, hasattr(type(opt), "_rr_reduction"))
out["serialized"] = keras.optimizers.serialize(opt)["class_name"]
copy = type(opt).from_config(opt.get_config())
out["from_config"] = (copy.get_config() == opt.get_config(), hasattr(type(copy), "_rr_reduction"))
# Training on: every rank now sees different data, and stays identical to the others.
loaded.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
loaded.fit(x[r::n], y[r::n], batch_size=4, epochs=1, verbose=0)
out["iterations after"] = int(opt.iterations.numpy())
weights = np.concatenate([w.ravel() for w in loaded.get_weights()])
import ringreduce as rr
out["identical"] = bool(np.array_equal(rr.broadcast(weights, root=0), weights))
# Wrapping again replaces the options and keeps the state.
again = rrtf.DistributedOptimizer(opt, op="sum")
out["rewrapped"] = (again is opt, type(again).__mro__[1].__name__, type(again)._rr_reduction.op,
                    int(again.iterations.numpy()))
result = out
"""


def test_rewrapping_a_loaded_optimizer_keeps_its_state(tmp_path):
    ranks = run_ranks(2, REWRAP, tmp_path, timeout=240, init=False, env={"RR_TEST_DIR": str(tmp_path)})
    for rk in ranks:
        res = rk.result
        assert res["same object"] and res["state kept"], res
        assert res["iterations"] == 32 // 8
        assert res["class"] == ("keras.src.optimizers.adam", "Adam", True)
        assert res["serialized"] == "Adam"
        assert res["from_config"] == (True, True)
        assert res["iterations after"] == 32 // 8 + 16 // 4
        assert res["identical"]
        assert res["rewrapped"] == (True, "Adam", "sum", 8)


# docs/horovod.md: "op=Adasum raises NotImplementedError", in the ops and in
# DistributedOptimizer and DistributedGradientTape alike, so Horovod code that
# catches NotImplementedError to fall back works.
@pytest.mark.parametrize("make", ["optimizer", "tape"])
def test_adasum_in_the_optimizer_and_tape_is_not_implemented_as_documented(make):
    pytest.importorskip("tensorflow")
    import keras
    import tensorflow as tf
    import ringreduce.tensorflow as hvd
    with pytest.raises(NotImplementedError, match="Adasum"):
        if make == "optimizer":
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
        else:
            hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum)
    with pytest.raises(ValueError, match="not gradient reductions"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max)


# Horovod's Keras-2 tests of aggregation and local variables (they read
# optimizer._compute_gradients, var.ref() and _agg_helper.counter), by their
# intent, on Keras 3's public API.
AGGREGATION = PRELUDE + """
out = {}

# Accumulation inside a compiled step: backward_passes_per_step=2 sums two passes
# (not averaged), communicates and applies on every second; iterations counts each pass.
w = tf.Variable(np.zeros(3, np.float32))
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
@tf.function
def step(i):
    opt.apply([tf.fill([3], tf.cast(i, tf.float32) + r + 1.0)], [w])
trace = []
for i in range(4):
    step(tf.constant(i))
    trace.append((w.numpy().copy(), int(opt.iterations.numpy())))
out["accumulated in tf.function"] = trace

# An infinite gradient in one pass of one rank: the aggregated, reduced gradient is
# infinite there and nowhere else, on every rank alike (no error, no NaN elsewhere).
w = tf.Variable(np.zeros(2, np.float32))
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
opt.apply([tf.constant(np.array([np.inf if r == 0 else 1.0, 1.0], np.float32))], [w])
opt.apply([tf.constant(np.ones(2, np.float32))], [w])
out["inf"] = w.numpy()

# sparse_as_dense with aggregation: an Embedding's IndexedSlices, summed over two passes
# as dense tensors, then averaged over ranks.
emb = keras.layers.Embedding(5, 2, embeddings_initializer="zeros")
emb.build((None,))
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=True, backward_passes_per_step=2)
sparse = []
for i in range(2):
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(emb(tf.constant([r, 2 + i])) * (r + 1.0))
    g = t.gradient(loss, emb.trainable_weights)
    sparse.append(isinstance(g[0], tf.IndexedSlices))
    opt.apply(g, emb.trainable_weights)
out["sparse"] = (sparse, emb.embeddings.numpy())

# Local variables (register_local_var, or a Partial optimizer's local layers) are left out
# of BroadcastGlobalVariablesCallback: each rank keeps its own; the rest is root's.
model = keras.Sequential([keras.Input((2,)),
                          keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(r + 1.0)),
                          keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(10.0 * (r + 1)))])
opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(0.0))  # lr 0: only the broadcast changes weights
for v in model.layers[1].trainable_weights:
    opt.register_local_var(v)
model.compile(optimizer=opt, loss="mse")
model.fit(np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32), batch_size=2, epochs=1, verbose=0,
          callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
partial_model = keras.Sequential([keras.Input((2,)),
                                  keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(r + 1.0)),
                                  keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(10.0 * (r + 1)))])
popt = rrtf.PartialDistributedOptimizer(keras.optimizers.SGD(0.0), local_layers=[partial_model.layers[1]])
partial_model.compile(optimizer=popt, loss="mse")
partial_model.fit(np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32), batch_size=2, epochs=1, verbose=0,
                  callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
out["broadcast"] = [(m.layers[0].kernel.numpy(), m.layers[1].kernel.numpy()) for m in (model, partial_model)]

# PartialDistributedGradientTape.get_local_and_global_gradients: (local, global) lists of
# (gradient, variable), in the order of the sources; local ones this rank's own / size.
local_layer = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
shared = tf.Variable(np.ones(2, np.float32))
x = tf.constant(np.full((1, 3), r + 1.0, np.float32))
def local_and_global():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local_layer(x)) + tf.reduce_sum(shared) * (r + 1.0)
    lg, gg = rrtf.PartialDistributedGradientTape(tape, local_layers=local_layer).get_local_and_global_gradients(
        loss, [shared] + local_layer.trainable_weights)
    which.append(([v is local_layer.kernel for _, v in lg], [v is shared for _, v in gg]))  # when traced
    return [g for g, _ in lg], [g for g, _ in gg]
local_layer(x)
for mode, fn in [("eager", local_and_global), ("tf.function", tf.function(local_and_global))]:
    which = []
    lg, gg = fn()
    out[f"local and global {mode}"] = (list(zip([g.numpy() for g in lg], which[0][0])),
                                       list(zip([g.numpy() for g in gg], which[0][1])))
result = out
"""


def test_aggregation_local_variables_and_local_and_global_gradients(tmp_path):
    n = 2
    ranks = run_ranks(n, AGGREGATION, tmp_path, timeout=300, init=False)
    mean_rank = (n + 1) / 2
    for rk in ranks:
        res, r = rk.result, rk.rank
        # Passes i=0..3 give i+r+1; sums of passes (0,1) and (2,3), averaged over ranks.
        (w0, it0), (w1, it1), (w2, it2), (w3, it3) = res["accumulated in tf.function"]
        assert (it0, it1, it2, it3) == (1, 2, 3, 4)
        np.testing.assert_array_equal(w0, np.zeros(3))
        np.testing.assert_allclose(w1, np.full(3, -(2 * mean_rank + 1)), rtol=1e-6)
        np.testing.assert_array_equal(w2, w1)
        np.testing.assert_allclose(w3, w1 - (2 * mean_rank + 5), rtol=1e-6)

        np.testing.assert_array_equal(res["inf"], np.array([-np.inf, -2.0], np.float32))

        sparse, table = res["sparse"]
        assert sparse == [True, True]
        want = np.zeros((5, 2))
        for q in range(n):
            want[q] -= 2 * (q + 1) / n
            want[2] -= (q + 1) / n
            want[3] -= (q + 1) / n
        np.testing.assert_allclose(table, want, rtol=1e-6)

        for shared_kernel, local_kernel in res["broadcast"]:
            np.testing.assert_array_equal(shared_kernel, np.full((2, 1), 1.0))  # rank 0's
            np.testing.assert_array_equal(local_kernel, np.full((1, 1), 10.0 * (r + 1)))  # its own

        for mode in ("eager", "tf.function"):
            local, global_ = res[f"local and global {mode}"]
            assert [is_kernel for _, is_kernel in local] == [True], mode
            assert [is_shared for _, is_shared in global_] == [True], mode
            np.testing.assert_allclose(local[0][0], np.full((3, 2), (r + 1) / n), rtol=1e-6)
            np.testing.assert_allclose(global_[0][0], np.full(2, mean_rank), rtol=1e-6)
