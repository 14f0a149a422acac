"""Elastic training for TensorFlow and Keras, with Horovod's names
(horovod.tensorflow.elastic, horovod.tensorflow.keras.elastic):

    import ringreduce.tensorflow.keras as hvd
    from ringreduce.tensorflow import elastic

    state = elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: model.optimizer.learning_rate.assign(lr * hvd.size())])

    @elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=[
            elastic.CommitStateCallback(state), elastic.UpdateBatchStateCallback(state),
            elastic.UpdateEpochStateCallback(state)])

    train(state)

States keep variables as numpy copies in memory (commit), put them back
(restore) and sync them from a rank holding the newest commit
(ringreduce.elastic.State). Inside a tf.function TensorFlow turns a lost
peer into tf.errors.UnknownError whose text names ringreduce's exception
(the asynchronous op's status, async_op.py): run() recognises it there too.
"""
from __future__ import annotations

import functools
import re

import keras
import numpy as np
import tensorflow as tf

from ringreduce import elastic as _elastic
from ringreduce.elastic import HostsUpdatedInterrupt, ObjectState, State

from . import basics

# The exception's type, as TensorFlow writes it into the text of the error it
# raises instead (a py_function's traceback, or the async op's status).
_LOST_RING = re.compile(r"ringreduce\.[\w.]*(PeerLostError|StaleGenerationError|RingReduceError)\b")


def recoverable(exc: BaseException) -> bool:
    """A lost ring, raised directly or wrapped by TensorFlow (never a mismatch)."""
    if _elastic.recoverable(exc):
        return True
    if isinstance(exc, tf.errors.OpError) and not isinstance(exc, tf.errors.FailedPreconditionError):
        return bool(_LOST_RING.search(exc.message or ""))
    return False


def run(func):
    """Horovod's hvd.elastic.run for TensorFlow: `@run def train(state, ...)`."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return _elastic.runner.run_with(func, state, args, kwargs, recoverable=recoverable)
    return wrapper


def _relearn_layout() -> None:
    """cross_rank() and friends describe the new world (a collective: every rank runs it)."""
    basics._cross.clear()
    basics._learn_layout()


class _VariablesState(ObjectState):
    """Variables saved as numpy copies; other values as ObjectState's."""

    def __init__(self, variables, **kwargs):
        self._variables = list(variables)
        self._saved_variables: list = []
        super().__init__(**kwargs)
        self.register_reset_callbacks([_relearn_layout])

    def variables(self) -> list:
        return self._variables

    def save(self) -> None:
        self._saved_variables = [np.array(v.numpy(), copy=True) for v in self.variables()]
        super().save()

    def restore(self) -> None:
        for v, value in zip(self.variables(), self._saved_variables):
            v.assign(value)
        super().restore()

    def _sync_from(self, root: int) -> None:
        values = _elastic.broadcast_object([v.numpy() for v in self.variables()], root, "elastic.variables")
        for v, value in zip(self.variables(), values):
            v.assign(value)
        super()._sync_from(root)


class TensorFlowState(_VariablesState):
    """tf.Variables and any values: `TensorFlowState(model.variables, epoch=0)`."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise NotImplementedError("TensorFlowState(session=...): TF1 sessions are not elastic here; "
                                      "use eager code or tf.function")
        if variables is None:  # TF2 keeps no global collection of variables to default to
            raise ValueError("TensorFlowState needs variables=[...] (e.g. model.variables + optimizer.variables)")
        super().__init__(variables, **kwargs)


class TensorFlowKerasState(_VariablesState):
    """A Keras model's weights and its optimizer's variables, and any values.
    The optimizer's slots are made here if its first step has not made them
    yet, so every rank, a newcomer too, holds the same variables to sync."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__([], **kwargs)

    def variables(self) -> list:
        return list(self.model.variables) + (list(self.optimizer.variables) if self.optimizer is not None else [])


KerasState = TensorFlowKerasState  # horovod.tensorflow.keras.elastic's name


class CommitStateCallback(keras.callbacks.Callback):
    """Commits every `batches_per_commit` batches and at each epoch's end.

    The commit is made at the next hook (the next batch's or epoch's start,
    or the end of training), once every callback of that batch or epoch end
    has run: in Horovod's documented order the Update*StateCallbacks come
    after this one, and committing at once would save the weights with the
    batch and epoch counts of the step before (an epoch trained twice after
    a restore). No collective runs in between, so nothing is lost by waiting."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit
        self.due = False

    def _commit_if_due(self):
        if self.due:
            self.due = False  # first: a HostsUpdatedInterrupt must not commit again on the way out
            self.state.commit()

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a reset
        self.due = False

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.due = True
            self.batches_remaining = self.batches_per_commit

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self.due = True

    def on_train_end(self, logs=None):
        self._commit_if_due()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """state.batch: batches done in the current epoch (0 at its end)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """state.epoch: epochs done across resets (fit's own count restarts at 0)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HostsUpdatedInterrupt"]
