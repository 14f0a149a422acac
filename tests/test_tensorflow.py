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
