"""Keras callbacks for synchronous data-parallel training."""
from __future__ import annotations

import keras
import numpy as np

import ringreduce as rr

from .ops import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Starts every rank from root's weights (and optimizer state). A model
    built lazily (no keras.Input) has no weights until its first step builds
    them: it is broadcast after that step instead, as Horovod does."""

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._pending = True

    def on_train_begin(self, logs=None):
        self._pending = True
        if self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._broadcast()

    def _broadcast(self):
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        variables = list(self.model.variables) + (list(opt.variables) if opt is not None else [])
        broadcast_variables(variables, self.root_rank)
        self._pending = False


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics with their average over all ranks."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        values = rr.allreduce(np.array([float(logs[k]) for k in keys], dtype=np.float64), op="avg",
                              name="metrics")
        logs.update(dict(zip(keys, values.tolist())))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramps the learning rate linearly from initial_lr / size to initial_lr
    over the first warmup_epochs: synchronous training on N ranks uses an N
    times larger batch, and scaling its rate up at once can diverge."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, steps_per_epoch: int | None = None,
                 verbose: int = 0):
        super().__init__()
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch >= self.warmup_epochs:
            return
        steps = self.steps_per_epoch or self.params.get("steps") or 1
        progress = (self._epoch + batch / steps) / self.warmup_epochs
        size = rr.size()
        self.model.optimizer.learning_rate.assign(self.initial_lr / size * (1 + progress * (size - 1)))

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.warmup_epochs:
            self.model.optimizer.learning_rate.assign(self.initial_lr)
            if self.verbose and rr.rank() == 0:
                print(f"learning-rate warm-up done: {self.initial_lr}")
