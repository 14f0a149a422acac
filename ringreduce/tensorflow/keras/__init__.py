"""The names of horovod.tensorflow.keras (and horovod.keras), so a Keras
script runs after one changed line:

    import ringreduce.tensorflow.keras as hvd

Everything of ringreduce.tensorflow is here; allreduce, allgather, broadcast
and reducescatter take and return values (numpy) as Horovod's Keras
functions do; load_model restores a model saved with DistributedOptimizer
with its optimizer distributed again."""

import keras as _keras

from .. import *  # noqa: F401,F403  the whole TF layer
from .. import __all__ as _tf_all
from .. import ops as _ops
from ..basics import global_process_set
from ..compression import Compression
from ..optimizer import DistributedOptimizer
from . import callbacks, elastic


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """value reduced over all ranks (op defaults to Average), as numpy."""
    return _ops.allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, name=name, process_set=process_set).numpy()


def allgather(value, name=None, process_set=global_process_set):
    return _ops.allgather(value, name=name, process_set=process_set).numpy()


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    return _ops.broadcast(value, root_rank, name=name, process_set=process_set).numpy()


def reducescatter(value, name=None, op=_ops.Average, process_set=global_process_set):
    return _ops.reducescatter(value, op=op, name=name, process_set=process_set).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """keras.models.load_model, then the optimizer wrapped by
    DistributedOptimizer again with its state (iterations, slots) carried
    over. custom_optimizers: optimizer classes of your own, found by name."""
    objects = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = _keras.models.load_model(filepath, custom_objects=objects)
    saved = model.optimizer
    if saved is None:
        return model
    wrapped = DistributedOptimizer(saved, compression=compression)
    if wrapped is not saved:
        _carry_state(saved, wrapped, model.trainable_variables)
        model.optimizer = wrapped
    return model


def _carry_state(saved, wrapped, trainable_variables) -> None:
    """Builds wrapped on the model's variables and copies saved's state in:
    the same optimizer class on the same variables makes the same variables,
    in the same order."""
    if not saved.built:
        return
    if not wrapped.built:
        wrapped.build(trainable_variables)
    mine, theirs = list(wrapped.variables), list(saved.variables)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise ValueError("the distributed optimizer's state does not match the saved optimizer's; "
                         "load the model with keras.models.load_model and wrap its optimizer yourself")
    for new, old in zip(mine, theirs):
        new.assign(old)


__all__ = sorted(set(_tf_all) | {"allreduce", "allgather", "broadcast", "reducescatter", "load_model",
                                 "callbacks", "DistributedOptimizer", "Compression"})
