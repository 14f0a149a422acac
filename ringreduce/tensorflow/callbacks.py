"""Keras callbacks for synchronous data-parallel training, with Horovod's
names and signatures."""
from __future__ import annotations

import warnings

import keras
import numpy as np

import ringreduce as rr

from .ops import broadcast_variables
from .optimizer import local_variable_ids
from ..engine import engine


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Starts every rank from root's weights (and optimizer state). A model
    built lazily (no keras.Input) has no weights until its first step builds
    them: it is broadcast after that step instead, as Horovod does. Local
    variables stay each rank's own: local_variables=, and those of a
    DistributedOptimizer (register_local_var, Partial* local_layers).
    It also tells the flight recorder the training step of each batch
    (rr.flight_recorder.set_step), so a dump says at which step each
    collective ran."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self._local = {id(v) for v in (local_variables or [])}  # kept as each rank has them
        self._pending = True
        self._step = 0

    def on_train_begin(self, logs=None):
        self._pending = True
        self._step = _optimizer_step(self.model)
        if self.model.built:
            self._broadcast()

    def on_train_batch_begin(self, batch, logs=None):
        rr.flight_recorder.set_step(self._step)  # kept with each collective of the step: one assignment
        self._step += 1

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._broadcast()

    def _broadcast(self):
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        variables = list(self.model.variables) + (list(opt.variables) if opt is not None else [])
        # The optimizer's local variables (register_local_var, a Partial optimizer's local layers), as Horovod's.
        local = self._local | (local_variable_ids(opt) if opt is not None else frozenset())
        broadcast_variables([v for v in variables if id(v) not in local], self.root_rank)
        self._pending = False


def _optimizer_step(model) -> int:
    """The optimizer's iterations at the start of fit() (0 before its first
    step), from which the callback counts the training step for the flight
    recorder without reading a variable per batch."""
    opt = getattr(model, "optimizer", None)
    try:
        return int(opt.iterations.numpy()) if opt is not None and opt.built else 0
    except (AttributeError, TypeError, ValueError):
        return 0


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics with their average over all ranks."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        # One collective per metric, named by it (as Horovod's): ranks pair them
        # by name, and a metric only some ranks log is named when it stalls.
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.asarray(v).dtype.kind in "biuf")
        eng = engine()
        handles = [(k, eng.enqueue(f"metric.{k}", np.float64(logs[k]), op="avg")) for k in keys]
        try:
            logs.update({k: float(eng.wait(h)) for k, h in handles})
        except BaseException:  # one failed (a metric some rank lacks): the rest go, so next epoch's names are free
            for _, h in handles:
                eng.withdraw(h)
            raise


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to initial_lr * multiplier(epoch) from start_epoch
    until end_epoch (exclusive), as Horovod's does: at each epoch's first
    batch (staircase=True, or a constant multiplier), or at every batch with
    a fractional epoch (staircase=False; steps_per_epoch found from fit's
    parameters when not given). Outside that range the rate is left alone.

    momentum_correction scales the momentum with the rate change for one
    step (Goyal et al.), where the optimizer's momentum is a variable; Keras
    3's SGD keeps it as a Python float that the compiled train step has
    already read, so there it is skipped, with a warning."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.staircase, self.multiplier = True, (lambda epoch: multiplier)
        self.current_epoch = 0
        self._restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("steps_per_epoch is needed (fit did not say how many steps an epoch has)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))

    def _adjust(self, epoch):
        opt = self.model.optimizer
        old_lr = float(np.asarray(opt.learning_rate))
        new_lr = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate = new_lr
        momentum = getattr(opt, "momentum", None)
        if not self.momentum_correction or not momentum or old_lr == 0:
            return
        if hasattr(momentum, "assign"):
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)
        elif not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn(f"momentum_correction: {type(opt).__name__}.momentum is a Python float, fixed in the "
                          "compiled train step, so it is not corrected (pass momentum_correction=False to silence)")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size to initial_lr over the
    first warmup_epochs, batch by batch, reaching initial_lr at the last batch
    of the warm-up (Goyal et al., as Horovod's): N ranks train with an N
    times larger batch, and a rate scaled up at once can diverge."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shifted by one step so the last warm-up batch lands on initial_lr exactly.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / rr.size() * (epoch * (rr.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rr.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the whole model whenever `monitor` improves (save_best_only), on
    rank 0 only, as Horovod's. Horovod's estimator sets `filepath` itself;
    here pass filepath= (a .keras path) or set .filepath before fit()."""

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", filepath=None):
        # Keras checks the path's suffix now; a stand-in passes, the real one is checked at fit().
        super().__init__("best.keras", monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if self.filepath is None or not str(self.filepath).endswith((".keras", ".h5")):
            raise ValueError(f"BestModelCheckpoint needs filepath= ending in .keras, got {self.filepath!r}")
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if rr.rank() == 0:  # every rank holds the same model: one file, one writer
            super()._save_model(epoch, batch, logs)
        else:  # the others keep `best` as rank 0 does, and write nothing
            self._should_save_model(epoch, batch, logs, self._get_file_path(epoch, batch, logs))
