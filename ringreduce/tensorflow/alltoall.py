"""alltoall as a TensorFlow op, as hvd.alltoall: eager and inside tf.function,
with Horovod's gradient. Tensors go through the host (tf.numpy_function),
GPU tensors included: alltoall moves rows, it has no arithmetic to keep on a GPU."""
from __future__ import annotations

import tensorflow as tf

import ringreduce as rr

from .ops import _refuse_tf1_graphs


def _alltoall_op(x, splits, name):
    """(received, received_splits) as tensors; splits None: equal split."""
    _refuse_tf1_graphs()

    def run(a, *s):
        received, received_splits = rr.alltoall(a, splits=s[0] if s else None, name=name)
        return received, received_splits

    inputs = [x] if splits is None else [x, splits]
    received, received_splits = tf.numpy_function(run, inputs, [x.dtype, tf.int32], stateful=True,
                                                  name="RingAlltoall")
    received.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
    received_splits.set_shape([rr.size()])
    return received, received_splits


def alltoall(tensor, splits=None, name: str | None = None):
    """Scatters tensor's rows to every rank and gathers what each sent here.

    tensor is split along axis 0 into pieces of splits[i] rows for rank i
    (splits: int32 or int64, one entry per rank; default: equal pieces, rows
    divisible by size). Returns, as hvd.alltoall does, (received,
    received_splits) when splits is given, else received alone: the pieces
    every rank addressed to this one, concatenated in rank order, and how
    many rows came from each rank. The gradient is the alltoall of the
    incoming gradient with received_splits as splits: every row goes home."""
    tensor = tf.convert_to_tensor(tensor)
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if splits.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"alltoall splits must be int32 or int64, not {splits.dtype.name}")

    @tf.custom_gradient
    def _alltoall(x):
        received, received_splits = _alltoall_op(x, splits, name)

        def grad(dy, _dsplits=None):
            back, _ = _alltoall_op(tf.convert_to_tensor(dy), received_splits, None)
            return tf.reshape(back, tf.shape(x))
        return (received, received_splits), grad

    received, received_splits = _alltoall(tensor)
    return (received, received_splits) if splits is not None else received
