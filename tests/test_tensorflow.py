"""The TensorFlow layer: few, short tests (TensorFlow is slow to import)."""
import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

EQUIVALENCE = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
from sklearn.datasets import load_digits
import ringreduce.tensorflow as rrtf

def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])

digits = load_digits()
x, y = (digits.data / 16.0).astype(np.float32)[:1024], digits.target[:1024]
rrtf.init()
n, r, batch, steps = rrtf.size(), rrtf.rank(), 16, 8
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

class SameWeights(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        w = self.model.get_weights()[0]
        self.drift = max(getattr(self, "drift", 0.0), float(np.abs(w - rr.broadcast(w, root=0)).max()))

model = make_model(seed=r)  # different starts: the broadcast callback must fix that
model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss=loss)
# Rank r's batch i is rows [(i*n + r)*batch, ...): the global batch i is their concatenation.
idx = np.concatenate([np.arange((i * n + r) * batch, (i * n + r + 1) * batch) for i in range(steps)])
check = SameWeights()
model.fit(x[idx], y[idx], batch_size=batch, epochs=1, shuffle=False, verbose=0,
          callbacks=[rrtf.BroadcastGlobalVariablesCallback(0), check])
result = {"weights": model.get_weights(), "drift": check.drift}
if r == 0:  # one process, the concatenated batches, the same start
    single = make_model(seed=0)
    single.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    single.fit(x[: steps * n * batch], y[: steps * n * batch], batch_size=n * batch, epochs=1, shuffle=False, verbose=0)
    result["single"] = single.get_weights()
"""


@pytest.mark.slow
def test_four_ranks_train_like_one_process_on_the_whole_batch(tmp_path):
    ranks = run_ranks(4, EQUIVALENCE, tmp_path, timeout=240, init=False)
    single = ranks[0].result["single"]
    for r in ranks:
        assert r.result["drift"] == 0.0, f"rank {r.rank} drifted from rank 0 during training"
        for mine, want in zip(r.result["weights"], single):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)


def test_tape_compression_accumulation_root_and_mismatch(tmp_path):
    ranks = run_ranks(2, """
        import os
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import numpy as np, tensorflow as tf, keras
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        out = {}
        v = tf.Variable(np.full(5, rrtf.rank() + 1.0, dtype=np.float32))
        rrtf.broadcast_variables([v], root_rank=1)
        out["root1"] = v.numpy()
        for name, comp in [("none", rrtf.Compression.none), ("fp16", rrtf.Compression.fp16),
                           ("bf16", rrtf.Compression.bf16)]:
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(v * float(rrtf.rank() + 1))
                return rrtf.DistributedGradientTape(tape, compression=comp).gradient(loss, [v])[0]
            out[name] = step().numpy()
        # Accumulation: two local passes, one exchange, one update.
        w = tf.Variable(np.zeros(3, dtype=np.float32))
        opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
        for i in range(2):
            opt.apply([tf.constant(np.full(3, rrtf.rank() + 1.0 + i, dtype=np.float32))], [w])
            out[f"after{i}"] = w.numpy().copy()
        # A model that differs between ranks: a clear error, no hang.
        bad = tf.Variable(np.zeros(3 + rrtf.rank(), dtype=np.float32))
        try:
            with tf.GradientTape() as tape:
                l2 = tf.reduce_sum(bad * 2.0)
            rrtf.DistributedGradientTape(tape).gradient(l2, [bad])
            out["mismatch"] = "no error"
        except Exception as e:
            out["mismatch"] = f"{type(e).__name__}: {e}"
        result = out
    """, tmp_path, timeout=180, init=False)
    for r in ranks:
        res = r.result
        assert np.array_equal(res["root1"], np.full(5, 2.0, dtype=np.float32))
        for name in ("none", "fp16", "bf16"):
            assert np.array_equal(res[name], np.full(5, 1.5, dtype=np.float32)), (name, res[name])
        assert np.array_equal(res["after0"], np.zeros(3)), "applied before k passes"
        # summed over 2 passes per rank: rank0 1+2, rank1 2+3 -> averaged over ranks 4; SGD lr 1
        assert np.array_equal(res["after1"], np.full(3, -4.0, dtype=np.float32)), res["after1"]
        assert "MismatchError" in res["mismatch"] and "differs between ranks" in res["mismatch"], res["mismatch"]


@pytest.mark.slow
def test_sparse_gradients_and_hand_over_during_backprop(tmp_path):
    ranks = run_ranks(2, """
        import os, time
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import numpy as np, tensorflow as tf, keras
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        r, out = rrtf.rank(), {}

        # An Embedding's gradient is IndexedSlices: allgathered, or densified on request.
        keras.utils.set_random_seed(0)
        emb = keras.layers.Embedding(20, 3)
        emb.build((None,))
        ids = tf.constant([[1, 2, 2], [5, 5, 5]][r])
        for dense in (False, True):
            @tf.function
            def sparse_step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(emb(ids) * float(r + 1))
                return rrtf.DistributedGradientTape(tape, sparse_as_dense=dense).gradient(loss, emb.trainable_variables)[0]
            g = sparse_step()
            out[f"sparse_as_dense={dense}"] = (type(g).__name__, tf.convert_to_tensor(g).numpy())
        # The whole model through DistributedOptimizer: the update itself is sparse.
        opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0))
        before = emb.embeddings.numpy().copy()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids) * float(r + 1))
        opt.apply(tape.gradient(loss, emb.trainable_variables), emb.trainable_variables)
        out["update"] = before - emb.embeddings.numpy()

        # The last layer's gradient is handed over before backprop reaches the first layer.
        marks = {}
        def marker(label):
            # Identity whose gradient notes when backprop passed through it.
            def mark(dy):
                marks.setdefault(label, time.monotonic())
                return dy
            @tf.custom_gradient
            def f(x):
                def grad(dy):  # stateless: a stateful op here would hold back every later stateful op
                    marked = tf.numpy_function(mark, [dy], dy.dtype, stateful=False)
                    marked.set_shape(dy.shape)
                    return marked
                return tf.identity(x), grad
            return f
        input_side = marker("backprop done")  # its gradient runs once backprop has gone through every layer
        first_output = marker("reached the first layer")  # the first layer's gradients need what passes here
        import ringreduce.tensorflow.overlap as ov
        real_submit = ov.HandOvers.submit
        def spying_submit(self, name, op, array, process_set=None, compression=None):
            marks.setdefault(name, time.monotonic())
            return real_submit(self, name, op, array, process_set, compression)
        ov.HandOvers.submit = spying_submit
        layers = [keras.layers.Dense(512, activation="relu") for _ in range(6)] + [keras.layers.Dense(10)]
        model = keras.Sequential([keras.Input((512,)), *layers])
        x, scale = tf.random.normal((256, 512)), tf.Variable(1.0)
        def forward(h):
            h = first_output(layers[0](h))
            for layer in layers[1:]:
                h = layer(h)
            return h
        @tf.function
        def step():  # scale's gradient needs dy at the input: backprop through every layer
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(forward(input_side(x * scale)) ** 2)
            return rrtf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables + [scale])
        step()
        marks.clear()
        step()
        last_kernel = [k for k in marks if layers[-1].kernel.path in k][0]
        first_kernel = [k for k in marks if layers[0].kernel.path in k][0]
        out["order"] = (marks[last_kernel] < marks["backprop done"], marks[first_kernel] >= marks["reached the first layer"])
        result = out
    """, tmp_path, timeout=180, init=False)
    # rank 0 looks up rows 1, 2, 2 (weight 1), rank 1 rows 5, 5, 5 (weight 2): averaged over 2 ranks
    want = np.zeros((20, 3), dtype=np.float32)
    want[1], want[2], want[5] = 0.5, 1.0, 3.0
    for r in ranks:
        kind, sparse = r.result["sparse_as_dense=False"]
        assert kind == "IndexedSlices", kind
        np.testing.assert_array_equal(sparse, want)
        kind, dense = r.result["sparse_as_dense=True"]
        assert kind != "IndexedSlices", kind
        np.testing.assert_array_equal(dense, want)
        np.testing.assert_allclose(r.result["update"], want, rtol=1e-6)
        handed_early, first_at_end = r.result["order"]
        assert handed_early, f"rank {r.rank}: the last layer's gradient left only after backprop had finished"
        assert first_at_end, f"rank {r.rank}: the first layer's gradient was handed over before it could exist?"


@pytest.mark.slow
def test_ops_as_py_functions_the_path_tensorflow_takes_with_a_gpu(tmp_path):
    """With a GPU visible the ops are py_functions handing tensors over as they
    are (DLPack for GPU ones). Forced here on CPU tensors: values, shapes and
    gradients must match the numpy_function path."""
    ranks = run_ranks(2, """
        import os
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        import ringreduce.tensorflow as rrtf
        from ringreduce.tensorflow import ops
        rrtf.init()
        r = rrtf.rank()
        x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1))
        outs = {}
        for mode in ["numpy_function", "py_function"]:
            ops.on_gpu_hosts = (lambda: mode == "py_function")
            @tf.function
            def step(v):
                with tf.GradientTape() as tape:
                    tape.watch(v)
                    y = rrtf.allreduce(v, op="sum")
                    loss = tf.reduce_sum(y * y)
                return y, tape.gradient(loss, v), rrtf.allgather(v[: r + 1]), rrtf.broadcast(v, root_rank=1)
            y, g, ag, bc = step(x)
            kinds = {o.type for o in step.get_concrete_function(x).graph.get_operations() if "PyFunc" in o.type}
            outs[mode] = [t.numpy() for t in (y, g, ag, bc)] + [y.shape.as_list(), ag.shape.as_list()]
            outs[mode + " ops"] = kinds
        result = outs
    """, tmp_path, timeout=180)
    assert ranks[0].result["py_function ops"] == {"EagerPyFunc"}
    assert ranks[0].result["numpy_function ops"] == {"PyFunc"}
    for r in ranks:
        a, b = r.result["numpy_function"], r.result["py_function"]
        for want, got in zip(a, b):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(ranks[0].result["py_function"][0], base * 3)
    np.testing.assert_array_equal(ranks[0].result["py_function"][1], 2 * (base * 3) * 2)  # d/dx sum(y^2), allreduced
    assert ranks[0].result["py_function"][2].shape == (3, 4)  # 1 row from rank 0, 2 from rank 1


def test_accumulation_on_a_lazily_built_model_trains_like_one_process(tmp_path):
    """backward_passes_per_step=2 on a model without keras.Input (built by fit):
    two local passes summed, averaged over ranks, equal one process's step on
    the four batches together at twice the rate (gradients summed over passes).
    The broadcast callback must not break such a model either."""
    ranks = run_ranks(2, """
        import os
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import numpy as np, keras
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        n, r, batch, steps, lr = rrtf.size(), rrtf.rank(), 4, 6, 0.05
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(n * batch * steps, 5)).astype(np.float32), rng.normal(size=(n * batch * steps, 2)).astype(np.float32)

        def make_model(seed):
            keras.utils.set_random_seed(seed)
            return keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])

        # The same start on every rank: a lazily built model is only broadcast after its first step.
        model = make_model(seed=0)
        model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2), loss="mse")
        idx = np.concatenate([np.arange((i * n + r) * batch, (i * n + r + 1) * batch) for i in range(steps)])
        model.fit(x[idx], y[idx], batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
        result = {"weights": model.get_weights()}
        if r == 0:  # one process: 2 passes x 2 ranks of batches per update, gradients summed over passes
            single = make_model(seed=0)
            single.compile(optimizer=keras.optimizers.SGD(2 * lr), loss="mse")
            single.fit(x, y, batch_size=2 * n * batch, epochs=1, shuffle=False, verbose=0)
            result["single"] = single.get_weights()
    """, tmp_path, timeout=180, init=False)
    single = ranks[0].result["single"]
    for r in ranks:
        for mine, want in zip(r.result["weights"], single):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)


SAVE_WITH_CHECKPOINT = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, keras
import ringreduce.tensorflow as rrtf
rrtf.init()
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
y = (x.sum(axis=1) > 0).astype(np.int64)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = [rrtf.BroadcastGlobalVariablesCallback(0)]
if rrtf.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(sys.argv[1]))
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
keras.models.clone_model(model)  # serializes the compiled model, optimizer included, as saving does
"""

LOAD_AND_TRAIN_ON = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, keras
out = {}
for with_ringreduce in (False, True):
    if with_ringreduce:
        import ringreduce.tensorflow
    out[with_ringreduce] = {"ringreduce imported": "ringreduce" in sys.modules}
    model = keras.models.load_model(sys.argv[1])
    keras.models.clone_model(model)
    opt = model.optimizer
    out[with_ringreduce]["optimizer"] = f"{type(opt).__module__}.{type(opt).__qualname__}"
    out[with_ringreduce]["iterations before"] = int(opt.iterations.numpy())
    x = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int64)
    out[with_ringreduce]["loss"] = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history["loss"][-1]
    out[with_ringreduce]["iterations after"] = int(opt.iterations.numpy())
print(repr(out))
"""


def test_checkpoint_of_a_distributed_optimizer_loads_without_ringreduce(tmp_path):
    import ast
    import os
    import subprocess
    import sys

    from ranks import REPO
    (tmp_path / "save.py").write_text(SAVE_WITH_CHECKPOINT)
    (tmp_path / "load.py").write_text(LOAD_AND_TRAIN_ON)
    checkpoint = tmp_path / "model.keras"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    saved = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable,
                            str(tmp_path / "save.py"), str(checkpoint)],
                           capture_output=True, text=True, timeout=180, env=env)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    # One plain process, run from elsewhere with no path to ringreduce until it imports it on purpose.
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RINGREDUCE_")}
    loaded = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(checkpoint)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env=plain_env)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    out = ast.literal_eval(loaded.stdout.strip().splitlines()[-1])
    assert out[False]["ringreduce imported"] is False and out[True]["ringreduce imported"] is True
    for res in out.values():
        assert res["optimizer"] == "keras.src.optimizers.adam.Adam", res
        assert res["iterations before"] == 64 // 8  # the saved optimizer state came back
        assert res["iterations after"] == 2 * 64 // 8
        assert np.isfinite(res["loss"]), res


BY_NAME = """
import os, random, threading
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
import ringreduce.tensorflow as hvd
hvd.init()
n, r = hvd.size(), hvd.rank()
bad = []
pair = hvd.add_process_set([0, 2])

# 1. Training on a set's members matches one process on the members' batches.
def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)
batch, steps = 8, 4
if r in pair.ranks:
    me = pair.rank()
    idx = np.concatenate([np.arange((i * 2 + me) * batch, (i * 2 + me + 1) * batch) for i in range(steps)])
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=pair), loss="mse")
    model.fit(x[idx], y[idx], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    single = make_model()
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    single.fit(x[:steps * 2 * batch], y[:steps * 2 * batch], batch_size=2 * batch, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), single.get_weights()):
        if not np.allclose(a, b, atol=1e-5):
            bad.append(f"set training differs from one process by {np.abs(a - b).max()}")
    # and the tape, in a tf.function
    v = tf.Variable(np.ones(3, np.float32) * (r + 1))
    @tf.function
    def tape_step():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(v * v)
        return hvd.DistributedGradientTape(t, process_set=pair).gradient(loss, [v])[0]
    if not np.allclose(tape_step().numpy(), np.full(3, (2 * 1 + 2 * 3) / 2.0)):
        bad.append(f"tape on a set: {tape_step().numpy()}")
else:
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=pair)
    w = tf.Variable([1.0])
    try:
        opt.apply([tf.constant([1.0])], [w])
        bad.append("a non-member applied gradients on the set")
    except ValueError as e:
        if "not a member" not in str(e):
            bad.append(f"non-member: {e}")

# 2. Two threads per rank issue named collectives concurrently, in another order on each rank.
results, lock = {}, threading.Lock()
def reduce_thread(tag):
    for i in range(6):
        got = hvd.allreduce(tf.fill([4], float(r + i)), op=hvd.Sum, name=f"{tag}.sum.{i}")
        with lock:
            results[f"{tag}.sum.{i}"] = np.array_equal(got.numpy(), np.full(4, float(sum(range(n)) + n * i), np.float32))
def gather_thread(tag):
    f = tf.function(lambda t, i: hvd.allgather(t, name=f"{tag}.fn.{i}"))
    for i in range(6):
        got = hvd.allgather(tf.fill([r + 1], float(i)), name=f"{tag}.gather.{i}") if i % 2 else f(tf.fill([r + 1], float(i)), i)
        with lock:
            results[f"{tag}.gather.{i}"] = np.array_equal(got.numpy(), np.full(sum(range(1, n + 1)), float(i), np.float32))
jobs = [(reduce_thread, "A"), (gather_thread, "B")]
if r % 2:
    jobs.reverse()  # odd ranks start the other thread first
random.seed(r)
threads = [threading.Thread(target=fn, args=(tag,)) for fn, tag in jobs]
for th in threads: th.start()
for th in threads: th.join(timeout=120)
if len(results) != 12 or not all(results.values()):
    bad.append(f"threads: {results}")

# 3. Two independent collectives in one tf.function; a name fixed at trace time, the same on every rank.
@tf.function
def two(t):
    return hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.allreduce(t * 2, op=hvd.Sum)
for _ in range(2):
    s, g, s2 = two(tf.fill([2], float(r)))
    if not (np.array_equal(s.numpy(), [3.0, 3.0]) and np.array_equal(g.numpy(), np.repeat(np.arange(n, dtype=np.float32), 2))
            and np.array_equal(s2.numpy(), [6.0, 6.0])):
        bad.append(f"two in one tf.function: {s.numpy()} {g.numpy()} {s2.numpy()}")

# 4. A name clash (the same name, other shapes) fails on every rank; the engine goes on.
for mode, call in [("eager", lambda: hvd.allreduce(tf.ones(2 + r), name="clash")),
                   ("tf.function", tf.function(lambda: hvd.allreduce(tf.ones(2 + r), name="clash.fn")))]:
    try:
        call()
        bad.append(f"clash {mode}: no error")
    except tf.errors.FailedPreconditionError as e:
        # Eagerly hvd.MismatchError itself; in a tf.function TensorFlow's class for the op's status.
        if not (hvd.is_mismatch(e) and (mode != "eager" or isinstance(e, hvd.MismatchError))) or "clash" not in str(e):
            bad.append(f"clash {mode}: {type(e).__name__} {e}")
    if hvd.allreduce(tf.ones(3), op=hvd.Sum, name="after").numpy().tolist() != [3.0] * 3:
        bad.append(f"engine after clash {mode}")
result = bad
"""


def test_collectives_pair_by_name_threads_sets_and_clashes(tmp_path):
    ranks = run_ranks(3, BY_NAME, tmp_path, timeout=600, init=False)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result}"


# RINGREDUCE_OVERLAP takes 0 or 1: anything else (off, false, no, 2) is a
# ValueError naming it at rrtf.init(), before joining any ring, as rr.init
# does with its settings (never an overlap left on silently).
@pytest.mark.parametrize("text", ["off", "false", "no", "2"])
def test_a_nonsense_ringreduce_overlap_is_refused_at_tf_init(monkeypatch, text):
    pytest.importorskip("tensorflow")
    import ringreduce as rr
    import ringreduce.tensorflow as rrtf
    from ringreduce.tensorflow.overlap import overlap_enabled
    monkeypatch.setenv("RINGREDUCE_OVERLAP", text)
    with pytest.raises(ValueError, match=f"RINGREDUCE_OVERLAP='{text}' makes no sense: use 0 or 1"):
        overlap_enabled()
    was = rr.is_initialized()
    with pytest.raises(ValueError, match="RINGREDUCE_OVERLAP"):
        rrtf.init()
    assert rr.is_initialized() == was  # refused before joining anything
    for ok, on in [("0", False), ("1", True), (" 1 ", True)]:
        monkeypatch.setenv("RINGREDUCE_OVERLAP", ok)
        assert overlap_enabled() is on
    monkeypatch.delenv("RINGREDUCE_OVERLAP")
    assert overlap_enabled() is True
