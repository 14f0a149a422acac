"""Balanced batches in Keras (ringreduce.balance over this layer):

    import ringreduce.tensorflow as hvd
    from ringreduce.tensorflow.balance import BatchBalancer, fit
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), local_batch_size=1), loss=...)
    bal = BatchBalancer(global_batch_size=256, every=20)
    fit(model, x, y, bal, epochs=5)        # the same full x, y on every rank

fit() shards numpy arrays as Horovod scripts shard by rank, but by share:
each epoch every rank orders the rows alike (a permutation from `seed` and
the epoch), global batch k is rows [k G, (k+1) G) of that order, and rank r
trains on its share's slice of it (BatchBalancer.rows): the ranks' rows are
disjoint and each step together one global batch; every rank runs the same
number of steps (len(x) // G per epoch; the remainder rows of an epoch are
left out). The optimizer's weight is set to the share before each round, so
with a mean loss a step equals one step on the global batch.

Each rank's compute time per step is its wall time less the time it
blocked on collectives' results (ops.waited_seconds(): the gradients'
waits, the weights' allgather), so waiting for a slower rank does not count
as slowness. With overlap on (RINGREDUCE_OVERLAP), backprop that runs while
a gradient's wait blocks counts as waiting: an estimate, which makes every
rank look about equally faster.

Shares change only every `every` steps, so fit() runs Keras' fit once per
stretch of steps between changes ("a round"): each call sees callbacks'
on_train_begin / on_epoch_* once per round (broadcast initial variables
before fit(), not with a callback here).
"""
from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from ringreduce import balance as _balance

from .basics import check_process_set, global_process_set
from .ops import allgather, waited_seconds


class BatchBalancer(_balance.BatchBalancer):
    """ringreduce.balance.BatchBalancer whose measurements travel through
    this layer's engine (an eager allgather, named, so it pairs with the
    other ranks' whatever else the engine runs)."""

    def __init__(self, global_batch_size: int, every: int = 10, smoothing: float = 0.5, min_batch: int = 1,
                 shares=None, process_set=global_process_set):
        ps = check_process_set(process_set)

        def gather(a):
            return allgather(tf.constant(a), name="ringreduce.balance", process_set=ps).numpy()
        super().__init__(global_batch_size, every, smoothing, min_batch, shares, ps, gather)


class _ComputeClock(keras.callbacks.Callback):
    """Records each batch's compute time (wall less collective waits) and
    steps the balancer."""

    def __init__(self, balancer):
        super().__init__()
        self.balancer = balancer

    def on_train_batch_begin(self, batch, logs=None):
        self._start, self._waited = time.perf_counter(), waited_seconds()

    def on_train_batch_end(self, batch, logs=None):
        wall = time.perf_counter() - self._start
        self.balancer.record(max(0.0, wall - (waited_seconds() - self._waited)))
        self.balancer.step()


def fit(model, x, y, balancer: _balance.BatchBalancer, epochs: int = 1, shuffle: bool = True, seed: int = 0,
        callbacks=None, verbose=0):
    """Trains a compiled model (its optimizer a DistributedOptimizer) on
    numpy arrays x, y (the same on every rank) with the balancer's shares;
    see the module docstring. Returns one record per round: (epoch, first
    step, shares, the round's last logs)."""
    optimizer = model.optimizer
    if not hasattr(optimizer, "set_local_batch_size"):
        raise TypeError("fit() needs a model compiled with a ringreduce DistributedOptimizer")
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows, y {len(y)}")
    steps = len(x) // balancer.global_batch_size
    if steps < 1:
        raise ValueError(f"{len(x)} rows make no global batch of {balancer.global_batch_size}")
    clock = _ComputeClock(balancer)
    records = []
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(x)) if shuffle else np.arange(len(x))
        step = 0
        while step < steps:
            # up to the next exchange, where the shares may change
            span = min(balancer.every - balancer.steps % balancer.every, steps - step)
            rows = np.concatenate([order[slice(*balancer.rows(step + k))] for k in range(span)])
            shares, b = balancer.shares, balancer.local_batch_size
            optimizer.set_local_batch_size(b)
            history = model.fit(x[rows], y[rows], batch_size=b, epochs=1, shuffle=False, verbose=verbose,
                                callbacks=[clock] + list(callbacks or ()))
            records.append((epoch, step, shares, {k: v[-1] for k, v in history.history.items()}))
            step += span
    return records
