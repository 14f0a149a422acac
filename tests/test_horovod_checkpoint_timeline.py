"""keras callbacks.BestModelCheckpoint (rank 0 saves the best model, by
monitor and mode) and start_timeline / stop_timeline."""
import json

import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
import ringreduce.tensorflow.keras as hvd
hvd.init()
r = hvd.rank()
"""

CHECKPOINT = PRELUDE + """
keras.utils.set_random_seed(0)
x = np.random.default_rng(r).normal(size=(64, 3)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
out = os.path.join(os.environ["OUT"], f"rank{r}")
weights, losses = [], []
class Record(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        weights.append([w.copy() for w in self.model.get_weights()])
        losses.append(logs["loss"])
mode = os.environ["MODE"]
best = hvd.callbacks.BestModelCheckpoint(monitor="loss", mode=mode, filepath=os.path.join(out, "best.keras"))
model.fit(x, y, batch_size=16, epochs=4, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     Record(), best])
result = {"losses": losses, "best": float(best.best), "saved": os.path.exists(os.path.join(out, "best.keras"))}
if result["saved"]:
    at = int(np.argmin(losses) if mode == "min" else np.argmax(losses))
    loaded = keras.saving.load_model(os.path.join(out, "best.keras"), compile=False)
    result["matches_epoch"] = all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), weights[at]))
try:
    model.fit(x, y, epochs=1, verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint()])
except ValueError as e:
    result["no_path"] = str(e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["min", "max"])
def test_best_model_checkpoint_saves_the_best_epoch_on_rank_0_only(tmp_path, mode):
    ranks = run_ranks(2, CHECKPOINT, tmp_path, env={"OUT": str(tmp_path), "MODE": mode}, init=False, timeout=150)
    losses = ranks[0].result["losses"]
    assert losses == ranks[1].result["losses"]  # averaged by MetricAverageCallback
    assert losses[-1] < losses[0]  # training: min and max pick different epochs
    want = min(losses) if mode == "min" else max(losses)
    assert ranks[0].result["best"] == pytest.approx(want)
    assert ranks[0].result["saved"] and ranks[0].result["matches_epoch"]
    assert not ranks[1].result["saved"]
    for rk in ranks:
        assert "filepath" in rk.result["no_path"]


TIMELINE = PRELUDE + """
path = os.path.join(os.environ["OUT"], "trace.json")
hvd.allreduce(tf.constant([1.0]), name="before")
hvd.start_timeline(path, mark_cycles=True)
for i in range(3):
    hvd.allreduce(tf.constant([float(i)]), name=f"during.{i}")
hvd.stop_timeline()
hvd.allreduce(tf.constant([1.0]), name="after")
hvd.stop_timeline()  # none runs: a no-op
hvd.shutdown()
"""


def test_start_and_stop_timeline_trace_exactly_the_collectives_between(tmp_path):
    run_ranks(2, TIMELINE, tmp_path, env={"OUT": str(tmp_path)}, init=False, timeout=120)
    for name in ("trace.json", "trace.rank1.json"):
        events = json.loads((tmp_path / name).read_text())
        threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert threads == {f"during.{i}" for i in range(3)}, threads
        assert any(e.get("name") == "ALLREDUCE" for e in events)
        assert sum(e.get("name") == "CYCLE_START" for e in events) >= 1
