"""Keras data-parallel training on Ray actors: ringreduce.ray.RayExecutor
places one actor per rank, forms the ring among them, and runs `train` on
every rank (docs/ringrun.md, "Ray").

    python examples/ray_train.py --workers 2 --epochs 4             # a local Ray cluster
    python examples/ray_train.py --address auto --workers 8 --gpus-per-worker 1   # a running cluster

Prints each rank's test accuracy and whether every rank ends with the same
weights (it must: the gradients are averaged over the ring every step).
"""
from __future__ import annotations

import argparse

import numpy as np


def train(epochs: int = 4, batch_size: int = 32, lr: float = 0.05, seed: int = 1) -> dict:
    """One rank's training, as under ringrun: the Horovod-style TF layer,
    each rank on its own shard of scikit-learn's digits."""
    import keras
    from sklearn.datasets import load_digits

    import ringreduce.tensorflow as rrtf

    rrtf.init()  # the executor formed the ring already: this only learns the hosts' layout
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    n = len(x_train) // rrtf.size() * rrtf.size()  # equal shards: every rank takes as many steps
    shard = slice(rrtf.rank(), n, rrtf.size())

    keras.utils.set_random_seed(seed + rrtf.rank())  # ranks start apart; the broadcast below aligns them
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(lr * rrtf.size())),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x_train[shard], y_train[shard], batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {"rank": rrtf.rank(), "accuracy": float(accuracy), "weights": model.get_weights()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--gpus-per-worker", type=float, default=0)
    parser.add_argument("--strategy", default="PACK", help="PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    parser.add_argument("--address", default=None, help="a running Ray cluster (auto, ray://...); default: a local one")
    args = parser.parse_args()

    import ray

    from ringreduce.ray import RayExecutor

    ray.init(address=args.address, include_dashboard=False)
    executor = RayExecutor(num_workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                           gpus_per_worker=args.gpus_per_worker, placement_strategy=args.strategy)
    executor.start()
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs})
    finally:
        executor.shutdown()
    for r in results:
        print(f"rank {r['rank']}: test accuracy {r['accuracy']:.3f}")
    same = all(np.array_equal(a, b) for r in results for a, b in zip(r["weights"], results[0]["weights"]))
    print(f"weights identical on every rank: {same}")


if __name__ == "__main__":
    main()
