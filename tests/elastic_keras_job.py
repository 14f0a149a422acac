"""An elastic Keras fit for tests/test_elastic.py, with the callbacks.

    ringrun --elastic -np 3 --min-np 2 python tests/elastic_keras_job.py EPOCHS STEPS_PER_EPOCH [FINAL_SIZE]

With FINAL_SIZE, once the epochs are done it keeps committing (no
training) until the world has that many ranks again: a restarted worker
(TensorFlow takes seconds to import) then always joins before the end.

Prints `committed GLOBAL gen G rank R size N pid P` after each batch's
commit (GLOBAL = epochs done * STEPS_PER_EPOCH + batches done), then `done {json}`.
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringreduce.tensorflow.keras as hvd  # noqa: E402
from ringreduce import elastic as rr_elastic  # noqa: E402
elastic = hvd.elastic  # Horovod's spelling: hvd.elastic.KerasState, hvd.elastic.run

epochs, spe = int(sys.argv[1]), int(sys.argv[2])
final_size = int(sys.argv[3]) if len(sys.argv) > 3 else 0
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()
keras.utils.set_random_seed(1)  # the same initial weights everywhere (sync makes them so anyway)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
lr = 0.01
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr * hvd.size(), momentum=0.9)), loss="mse")
sizes_seen = []


def scale_lr():
    model.optimizer.learning_rate.assign(lr * hvd.size())  # learning-rate scaling sees the new size
    sizes_seen.append(hvd.size())


state = elastic.KerasState(model, batch=0, epoch=0)
state.register_reset_callbacks([scale_lr])


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"committed {state.epoch * spe + state.batch} gen {rr_elastic.generation()} rank {hvd.rank()} "
              f"size {hvd.size()} pid {os.getpid()}", flush=True)


def data():
    rng = np.random.default_rng(100 + hvd.rank())
    x = rng.standard_normal((spe * 16, 8)).astype("float32")
    return x, (x @ np.arange(1, 9, dtype="float32"))[:, None] / 10


@elastic.run
def train(state):
    x, y = data()
    if state.epoch < epochs:
        model.fit(x, y, batch_size=16, epochs=epochs - state.epoch, shuffle=False, verbose=0,
                  callbacks=[elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state),
                             elastic.CommitStateCallback(state), Report()])
    while hvd.size() < final_size:
        time.sleep(0.1)
        state.commit()  # raises HostsUpdatedInterrupt once the restarted worker waits


train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print("done " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch,
                            "sha": hashlib.sha256(weights.tobytes()).hexdigest(), "lr_sizes": sizes_seen,
                            "lr": float(model.optimizer.learning_rate.numpy()),
                            "finite": bool(np.isfinite(weights).all())}), flush=True)
