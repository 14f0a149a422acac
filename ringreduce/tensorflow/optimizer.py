"""DistributedOptimizer (Keras 3) and DistributedGradientTape: synchronous
data-parallel training over the ring, with gradients handed over as
backprop produces them (overlap.py)."""
from __future__ import annotations

import tensorflow as tf

from .compression import Compression
from .overlap import reduce_gradients


def DistributedOptimizer(optimizer, compression=Compression.none, backward_passes_per_step: int = 1,
                         average: bool = True, sparse_as_dense: bool = False):
    """Wraps a Keras 3 optimizer: before each update, every gradient is
    averaged (or summed, average=False) over all ranks. With
    backward_passes_per_step=k, gradients of k local steps are summed and
    communicated once, then applied."""
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    base = optimizer.__class__
    op = "avg" if average else "sum"

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        grads = list(grads)
        if backward_passes_per_step == 1:
            return base.apply(self, reduce_gradients(grads, variables, op, compression, sparse_as_dense), variables)
        return _accumulate_then_apply(self, base, grads, variables, backward_passes_per_step,
                                      lambda gs: reduce_gradients(gs, variables, op, compression, sparse_as_dense))

    # Named and placed as the base class (as Horovod's wrapper is): a saved model
    # then records the plain Keras optimizer, which loads without ringreduce.
    cls = type(base.__name__, (base,), {"apply": apply, "_ringreduce_wrapped": True,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})
    return cls.from_config(optimizer.get_config())


def _accumulate_then_apply(opt, base, grads, variables, k, reduce):
    if not hasattr(opt, "_rr_accumulators"):
        # Shaped from the variables' declared shapes: a lazily built model's
        # variables may have no value yet when the first step is traced.
        with tf.init_scope():
            opt._rr_accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]
            opt._rr_passes = tf.Variable(0, dtype=tf.int64, trainable=False)
    for acc, g in zip(opt._rr_accumulators, grads):
        if g is not None:
            acc.assign_add(tf.convert_to_tensor(g))
    opt._rr_passes.assign_add(1)

    def communicate_and_apply():
        summed = [tf.identity(a) for a in opt._rr_accumulators]
        base.apply(opt, reduce(summed), variables)
        for a in opt._rr_accumulators:
            a.assign(tf.zeros_like(a))
        return tf.constant(True)

    return tf.cond(opt._rr_passes % k == 0, communicate_and_apply, lambda: tf.constant(False))


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients averaged (or
    summed) over all ranks, handed over as backprop produces them."""

    def __init__(self, tape: tf.GradientTape, compression=Compression.none, average: bool = True,
                 sparse_as_dense: bool = False):
        self._tape, self._compression = tape, compression
        self._op = "avg" if average else "sum"
        self._sparse_as_dense = sparse_as_dense

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = reduce_gradients(tf.nest.flatten(grads), flat_sources, self._op, self._compression,
                                self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, flat)

    def __getattr__(self, name):
        return getattr(self._tape, name)
