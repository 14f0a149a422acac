"""SyncBatchNormalization: batch normalization over the global batch.

In training, each rank's per-channel sum, sum of squares and count are summed
over all ranks, so the mean and variance are those of every rank's batch
together (ranks may hold batches of different sizes). The sums travel through
the background engine, like the gradients: a direct collective here would run
beside gradients the engine is already reducing and the ranks could see the
two in different orders. The gradient of that sum is the same sum of the
incoming gradients, so backprop reaches every rank's inputs.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import ringreduce as rr

from ..engine import engine


def _engine_sum(name: str, x):
    """x summed over all ranks, through the engine. Stateful: every rank
    reaches these in program order, one at a time."""
    def run(a):
        return np.asarray(engine().wait(engine().enqueue(name, a, "sum")), dtype=a.dtype)
    y = tf.numpy_function(run, [x], x.dtype, stateful=True, name="RingSyncBatchNormSum")
    y.set_shape(x.shape)
    return y


def _summed_over_ranks(name: str, x):
    @tf.custom_gradient
    def f(t):
        def grad(dy):
            return _engine_sum(name + ".grad", dy)
        return _engine_sum(name, t), grad
    return f(x)


@keras.saving.register_keras_serializable(package="ringreduce")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training statistics are those
    of the global batch (every rank's batch together). Inference uses the
    moving statistics, which every rank updates identically."""

    def _moments(self, inputs, mask):
        if rr.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(inputs * weights, axis=axes)
        squares = tf.reduce_sum(tf.square(inputs) * weights, axis=axes)
        name = f"syncbn.{getattr(self, 'path', None) or self.name}"
        count, total, squares = tf.unstack(_summed_over_ranks(name, tf.stack([count, total, squares])))
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return mean, variance
