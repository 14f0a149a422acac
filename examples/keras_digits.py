"""Data-parallel Keras training over ringreduce, the full Horovod-style flow.

    ringrun -np 4 python examples/keras_digits.py --checkpoint-dir /tmp/ckpt

Each rank trains on its own shard of scikit-learn's digits; DistributedOptimizer
averages gradients over the ring while backprop runs. The learning rate is
scaled by the number of ranks and warmed up to it; every rank starts from rank
0's weights; epoch metrics are averaged over ranks; only rank 0 writes
checkpoints and prints. Prints the test accuracy at the end.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ringreduce.tensorflow as rrtf  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3, help="for one rank; scaled by the number of ranks")
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves the model here after each epoch")
    args = p.parse_args()

    rrtf.init()
    rank, size = rrtf.rank(), rrtf.size()
    keras.utils.set_random_seed(1234 + rank)  # different starts: the broadcast makes them one

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    scaled_lr = args.lr * size
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.Adam(scaled_lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

    callbacks = [
        rrtf.BroadcastGlobalVariablesCallback(0),     # first, so everyone starts from rank 0's weights
        rrtf.MetricAverageCallback(),                 # before any logger, so it sees the averages
        rrtf.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs),
    ]
    if rank == 0 and args.checkpoint_dir:             # one writer: ranks hold the same weights
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "epoch{epoch:02d}.keras")))

    history = model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                        callbacks=callbacks, verbose=2 if rank == 0 else 0)

    # Each rank scores its share of the test set; the counts are summed over the ring.
    xt, yt = x_test[rank::size], y_test[rank::size]
    correct = np.sum(np.argmax(model.predict(xt, verbose=0), axis=1) == yt) if len(xt) else 0
    counts = rrtf.allreduce(np.array([correct, len(yt)], dtype=np.float64), op="sum").numpy()
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    identical = bool(rrtf.allreduce(weights, op="max").numpy().tobytes() == weights.tobytes()
                     == rrtf.allreduce(weights, op="min").numpy().tobytes())
    if rank == 0:
        print(f"weights identical on every rank: {identical}")
        print(f"ranks={size} final train loss (averaged over ranks)={history.history['loss'][-1]:.4f} "
              f"test accuracy={counts[0] / counts[1]:.4f}")


if __name__ == "__main__":
    main()
