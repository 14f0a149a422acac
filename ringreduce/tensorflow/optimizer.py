"""DistributedOptimizer (Keras 3) and DistributedGradientTape: synchronous
data-parallel training over the ring (or over a process set's members:
process_set=), with horovod.tensorflow's options, and gradients handed over
as backprop produces them (overlap.py).

Horovod's semantics, kept here: op Average or Sum; gradient_predivide_factor f
divides by f before the sum and by size/f after it; groups (or num_groups)
hand the gradients of a group over together, so they travel fused; variables
registered as local (register_local_var / register_local_source, or the
Partial* wrappers) keep their own gradient, divided by size when
scale_local_gradients; backward_passes_per_step k sums k passes locally and
communicates on every k-th (divided by k if average_aggregated_gradients).

Beyond Horovod: local_batch_size= (or set_local_batch_size(n) on the
optimizer or tape) averages the gradients weighted by each rank's batch
size, for ranks given unequal shares of the global batch (ringreduce.balance):
grad = sum_r (b_r / B) grad_r, B = sum_r b_r, which for a mean loss is the
gradient of one batch of all B samples. Each rank's gradients are
prescaled by b_r / B and summed in the same one fused allreduce as
unweighted ones; B comes from one allgather of every rank's batch size per
step (two float64s a rank), which also checks them on every rank alike
(ringreduce.core.check_weights: negative, NaN, all zero or of mixed kinds
fail the step on every rank, naming the rank at fault)."""
from __future__ import annotations

import math
import warnings

import keras
import numpy as np
import tensorflow as tf


from . import ops as _ops
from .ops import scale_tensor as _scale
from .basics import check_process_set
from .compression import Compression
from .overlap import reduce_gradients

from ringreduce import ProcessSet, global_process_set
from ringreduce.core import check_weights, weight_record

Average = getattr(_ops, "Average", "avg")
Sum = getattr(_ops, "Sum", "sum")


def reduction_op(op, average=None) -> str:
    """'avg' or 'sum' for Horovod's op argument: the Average/Sum constants,
    ringreduce's strings, or objects named so. `average` is Horovod's
    deprecated boolean, which wins when given."""
    if average is not None:
        return "avg" if average else "sum"
    if op is None:
        return "avg"
    for constant, name in ((getattr(_ops, "Average", None), "avg"), (getattr(_ops, "Sum", None), "sum")):
        if constant is not None and type(op) is type(constant) and op == constant:
            return name
    if isinstance(op, int) and not isinstance(op, bool):
        label = {0: "avg", 1: "sum"}.get(op)  # Horovod's numbering: Average = 0, Sum = 1
    else:
        label = str(op if isinstance(op, str) else getattr(op, "name", None) or getattr(op, "__name__", op)).lower()
    if label == "adasum":  # as the ops say it (docs/horovod.md), not a ValueError as for Min/Max
        raise NotImplementedError("op=Adasum: ringreduce has no Adasum reduction; use Average or Sum")
    label = {"avg": "avg", "average": "avg", "mean": "avg", "sum": "sum"}.get(label)
    if label is None:
        raise ValueError(f"gradients are combined with Average or Sum, not {op!r} "
                         "(Min, Max and Product are not gradient reductions)")
    return label


def _gradient_process_set(process_set):
    """The set gradients are combined over (None: the global one). Checked at
    once for its type; registration and membership when gradients are
    reduced (the set may be added after the optimizer is made)."""
    if process_set is None:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ringreduce.ProcessSet, got {type(process_set).__name__}")
    return process_set


class GradientReduction:
    """How gradients are combined over ranks: shared by DistributedOptimizer
    and DistributedGradientTape. Holds the options, not the local variables
    (those belong to each optimizer or tape)."""

    def __init__(self, op=Average, compression=Compression.none, sparse_as_dense=False,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True, average=None, name=None, local_batch_size=None):
        self.op = reduction_op(op, average)
        if gradient_predivide_factor != 1.0 and self.op != "avg":
            raise ValueError("gradient_predivide_factor needs op=Average")
        self.weighted = local_batch_size is not None  # set_local_batch_size checks op and predivide
        self._weight = None  # tf.Variable float64 [kind, value] (core.weight_record), made on first use
        self._owned = False  # _weight is our variable (set from numbers), not the caller's tensor
        self._reduced = False  # a step was built: its weight source is fixed in it
        if num_groups:
            warnings.warn("num_groups is replaced by groups (as in Horovod)", DeprecationWarning, stacklevel=3)
            groups = num_groups if groups is None else groups
        if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups must be a positive integer or a list of lists of variables")
        self.process_set = _gradient_process_set(process_set)
        self.compression, self.sparse_as_dense = compression, sparse_as_dense
        self.predivide = float(gradient_predivide_factor)
        self.groups, self.scale_local_gradients = groups, scale_local_gradients
        self.name = name or "RingAllreduce"
        if self.weighted:
            self.set_local_batch_size(local_batch_size)

    def __getstate__(self):
        """Pickled (with a pickled DistributedOptimizer) with its weight's
        value, not its variable; a tensor weight cannot be pickled."""
        state = dict(self.__dict__)
        if self._owned:
            state["_weight"] = None
            state["_weight_value"] = self._weight.numpy()
        elif self._weight is not None:
            raise TypeError("a DistributedOptimizer weighted by a tensor (local_batch_size=<tensor>) cannot be "
                            "pickled; set a number with set_local_batch_size first")
        return state

    def __setstate__(self, state):
        value = state.pop("_weight_value", None)
        self.__dict__.update(state)
        if value is not None:
            with tf.init_scope():
                self._weight = tf.Variable(value, dtype=tf.float64, trainable=False, name="ringreduce_batch_weight")

    def set_local_batch_size(self, n) -> None:
        """This rank's weight from now on: a real number (kept in a variable,
        read at every step, so a compiled step traced before sees the new
        value), or a scalar tensor of the step (tf.shape(x)[0]: the batch's
        own size, read where the gradients are reduced). Checked against the
        other ranks' when gradients are next reduced."""
        if self.op != "avg" or self.predivide != 1.0:
            raise ValueError("local_batch_size weights an average: it needs op=Average and no "
                             "gradient_predivide_factor")
        tensor = isinstance(n, (tf.Tensor, tf.Variable))
        if self._reduced and not (self._owned and not tensor):
            # a compiled step reads the weight it was built with: only our own variable's value can change under it
            raise RuntimeError("set_local_batch_size: gradients were already reduced " +
                               ("unweighted" if not self.weighted else "with a tensor weight") +
                               ", and a compiled step keeps that; pass local_batch_size= when wrapping instead")
        if tensor:
            if n.shape.rank not in (0, None) or not (n.dtype.is_integer or n.dtype.is_floating):
                raise TypeError(f"local_batch_size must be a scalar number, not a {n.dtype.name} tensor of shape "
                                f"{n.shape}")
            kind = 1.0 if n.dtype.is_integer else 0.0
            self._weight = tf.stack([tf.constant(kind, tf.float64), tf.cast(tf.reshape(n, []), tf.float64)])
            self._owned = False
        else:
            record = weight_record(n)  # TypeError here: not a number at all
            if self._owned:
                self._weight.assign(record)
            elif tf.inside_function():
                # made inside a traced step (a tape in the step): a constant of that trace, as any Python value there
                self._weight = tf.constant(record, tf.float64)
            else:
                with tf.init_scope():
                    self._weight = tf.Variable(record, dtype=tf.float64, trainable=False,
                                               name="ringreduce_batch_weight")
                self._owned = True
        self.weighted = True

    def _weight_record(self):
        """This rank's [kind, value] (float64, core.weight_record's) as a tensor of the step."""
        return self._weight.read_value() if self._owned else self._weight

    def _prescale(self, ps):
        """w_r / W as a float64 scalar tensor, W the weights' sum over the
        set: one allgather of every rank's [kind, value], checked alike on
        every rank (a bad weight fails the step everywhere, naming the rank)."""
        if ps.process_set_id == 0:
            names = None
        else:
            ranks = list(ps.ranks)
            names = lambda r: f"world rank {ranks[r]} (rank {r} of process set {ps.process_set_id})"  # noqa: E731
        rank = ps.rank()
        gathered = _ops.allgather(tf.reshape(self._weight_record(), [1, 2]), process_set=ps)

        def factor(records):
            weights = check_weights(records, names)
            return np.float64(weights[rank] / np.float64(math.fsum(weights.tolist())))
        out = tf.numpy_function(factor, [gathered], tf.float64, stateful=False, name="RingBatchWeight")
        out.set_shape([])
        return out

    def __call__(self, grads, variables, local_ids=frozenset()):
        """Every rank's gradients (of the process set) combined, in the order
        given; local ones stay this rank's own (scaled by 1/size if
        scale_local_gradients; size: the set's)."""
        ps = check_process_set(self.process_set)
        self._reduced = True
        grads, variables = list(grads), list(variables)
        shared = [i for i, v in enumerate(variables) if id(v) not in local_ids]
        out = list(grads)
        size = ps.size()
        with tf.name_scope(self.name):
            if shared:
                sg, sv = [grads[i] for i in shared], [variables[i] for i in shared]
                op = self.op
                if self.weighted:  # the weighted mean as a sum of prescaled gradients
                    factor = self._prescale(ps)
                    sg, op = [_scale_by(g, factor) for g in sg], "sum"
                elif self.predivide != 1.0:  # the average split around the sum, as Horovod does
                    sg, op = [_scale(g, 1.0 / self.predivide) for g in sg], "sum"
                reduced = reduce_gradients(sg, sv, op, self.compression, self.sparse_as_dense,
                                           groups=self._group_positions(sg, sv), process_set=ps)
                if self.predivide != 1.0:
                    reduced = [_scale(g, self.predivide / size) for g in reduced]
                for i, g in zip(shared, reduced):
                    out[i] = g
            if self.scale_local_gradients and size > 1:
                for i, v in enumerate(variables):
                    if id(v) in local_ids:
                        out[i] = _scale(grads[i], 1.0 / size)
        return out

    def _group_positions(self, grads, variables):
        """Groups as lists of positions in grads; a group is handed over as one."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if self.groups is None:
            return None
        if isinstance(self.groups, int):
            return [list(chunk) for chunk in np.array_split(present, min(self.groups, len(present))) if len(chunk)]
        where = {id(v): i for i, v in enumerate(variables)}
        groups = [[where[id(v)] for v in group if id(v) in where and grads[where[id(v)]] is not None]
                  for group in self.groups]
        return [g for g in groups if g]  # a variable in no group forms a group of its own


def _scale_by(g, factor):
    """g * factor (a float64 scalar tensor), as the weighted average needs:
    float32 and float64 in their own dtype, 16-bit floats in float32 then
    rounded once; IndexedSlices by their values. Integer gradients are
    refused: a weighted mean of them is no integer."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_scale_by(g.values, factor), g.indices, g.dense_shape)
    if not g.dtype.is_floating:
        raise TypeError(f"local_batch_size= averages float gradients; this one is {g.dtype.name}")
    if g.dtype.size == 2:
        return tf.cast(tf.cast(g, tf.float32) * tf.cast(factor, tf.float32), g.dtype)
    return g * tf.cast(factor, g.dtype)


class _LocalVariables:
    """Variables whose gradients are not reduced: registered one by one, or
    every trainable weight of a local layer (read at each step, so a layer
    built lazily by its first call counts too)."""

    def __init__(self):
        self.variables, self.layers = {}, []

    def add_variable(self, var):
        self.variables[id(var)] = var  # kept referenced, so its id stays its own

    def add_layers(self, layers):
        if layers is None:
            return
        layers = [layers] if isinstance(layers, keras.layers.Layer) else list(layers)
        if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
            raise ValueError("local_layers must be Keras layers")
        self.layers.extend(layers)

    def ids(self) -> frozenset:
        return frozenset(self.variables) | {id(v) for layer in self.layers for v in layer.trainable_weights}


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True, average=None,
                         use_locking=False, local_batch_size=None):
    """Makes a Keras 3 optimizer distributed: before each update its
    gradients are combined over all ranks (see the module docstring for the
    options). The optimizer is wrapped in place and returned, so a built one
    keeps its state (iterations, slot variables); wrapping a wrapped one
    replaces its options. device_dense, device_sparse and use_locking are
    accepted for Horovod's sake and have no effect: the ring reduces tensors
    where they are. local_batch_size: average weighted by each rank's batch
    size (module docstring); optimizer.set_local_batch_size(n) changes it
    between steps."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras 3 optimizer, not {type(optimizer).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    reduction = GradientReduction(op, compression, sparse_as_dense, gradient_predivide_factor, num_groups, groups,
                                  process_set, scale_local_gradients, average,
                                  name or f"Distributed{type(optimizer).__name__}", local_batch_size)
    base = getattr(type(optimizer), "_rr_base", type(optimizer))
    optimizer.__class__ = _distributed_class(base, reduction, backward_passes_per_step, average_aggregated_gradients)
    return optimizer


def _distributed_class(base, reduction, passes, average_passes):
    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        grads = list(grads)
        local = _local_variables(self).ids()
        if passes == 1:
            return base.apply(self, reduction(grads, variables, local), variables)
        return _accumulate_then_apply(self, base, grads, variables, passes, average_passes,
                                      lambda gs: reduction(gs, variables, local))

    def register_local_var(self, var):
        """This variable's gradient stays this rank's own (not reduced)."""
        _local_variables(self).add_variable(var)

    def set_local_batch_size(self, n):
        """Gradients are averaged weighted by each rank's batch size from the
        next step on, this rank's being n (read at each step: a compiled
        train step traced before sees the new value)."""
        reduction.set_local_batch_size(n)

    def __reduce__(self):
        """Pickled as the plain optimizer (Keras pickles it through its saving
        format), wrapped again with the same options when unpickled: the
        class made here cannot be found by name."""
        cls = type(self)
        self.__class__ = base
        try:
            plain = self.__reduce__()
        finally:
            self.__class__ = cls
        return _unpickle_distributed, (plain, reduction, passes, average_passes)

    # Named and placed as the base class (as Horovod's wrapper is): a saved model
    # then records the plain Keras optimizer, which loads without ringreduce.
    # The options live on the class, so from_config and clone_model copy them.
    return type(base.__name__, (base,), {
        "apply": apply, "register_local_var": register_local_var, "set_local_batch_size": set_local_batch_size,
        "__reduce__": __reduce__, "_rr_base": base,
        "_rr_reduction": reduction, "__module__": base.__module__, "__qualname__": base.__qualname__})


def _unpickle_distributed(plain, reduction, passes, average_passes):
    rebuild, args = plain[0], plain[1]
    optimizer = rebuild(*args)
    optimizer.__class__ = _distributed_class(type(optimizer), reduction, passes, average_passes)
    return optimizer


def local_variable_ids(opt) -> frozenset:
    """ids of the variables a DistributedOptimizer keeps local (none for
    any other optimizer)."""
    if not hasattr(type(opt), "_rr_reduction"):
        return frozenset()
    return _local_variables(opt).ids()


def _local_variables(opt) -> _LocalVariables:
    if "_rr_local" not in opt.__dict__:
        opt.__dict__["_rr_local"] = _LocalVariables()  # past Keras' attribute tracking: not state to save
    return opt.__dict__["_rr_local"]


def _accumulate_then_apply(opt, base, grads, variables, k, average_passes, reduce):
    if "_rr_accumulators" not in opt.__dict__:
        # Shaped from the variables' declared shapes: a lazily built model's
        # variables may have no value yet when the first step is traced.
        with tf.init_scope():
            opt.__dict__["_rr_accumulators"] = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                                                for v in variables]
            opt.__dict__["_rr_passes"] = tf.Variable(0, dtype=tf.int64, trainable=False)
    accumulators, passes = opt.__dict__["_rr_accumulators"], opt.__dict__["_rr_passes"]
    for acc, g in zip(accumulators, grads):
        if g is not None:
            acc.assign_add(tf.convert_to_tensor(g))
    passes.assign_add(1)

    def communicate_and_apply():
        summed = [tf.identity(a) if g is not None else None for a, g in zip(accumulators, grads)]
        if average_passes:
            summed = [None if s is None else s / tf.cast(k, s.dtype) for s in summed]
        base.apply(opt, reduce(summed), variables)
        for a in accumulators:
            a.assign(tf.zeros_like(a))
        return tf.constant(True)

    def count_the_pass():  # as Horovod: iterations counts every pass, applied or not
        opt.iterations.assign_add(1)
        return tf.constant(False)

    return tf.cond(passes % k == 0, communicate_and_apply, count_the_pass)


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients combined over
    all ranks (the same options as DistributedOptimizer), handed over as
    backprop produces them. register_local_source(v) keeps v's gradient local."""

    def __init__(self, gradtape: tf.GradientTape, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True,
                 average=None, local_batch_size=None):
        self._tape = gradtape
        self._reduction = GradientReduction(op, compression, sparse_as_dense, gradient_predivide_factor,
                                            num_groups, groups, process_set, scale_local_gradients, average,
                                            "DistributedGradientTape", local_batch_size)
        self._local = _LocalVariables()

    def set_local_batch_size(self, n):
        """Gradients are averaged weighted by each rank's batch size from now
        on, this rank's being n (see DistributedOptimizer)."""
        self._reduction.set_local_batch_size(n)

    def register_local_source(self, source):
        """This source's gradient stays this rank's own (not reduced)."""
        self._local.add_variable(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = self._reduction(tf.nest.flatten(grads), tf.nest.flatten(sources), self._local.ids())
        return tf.nest.pack_sequence_as(grads, flat)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False,
                                       **kwargs):
        """The gradients of gradient(), split: (local, global), two lists of
        (gradient, variable) pairs, each in the order of the flattened
        sources. local: the registered local sources (register_local_source,
        local_layers), each this rank's own gradient (divided by size when
        scale_local_gradients); global: every other source, its gradient
        combined over the ranks."""
        variables = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients, use_generic_names, **kwargs))
        local = self._local.ids()
        return ([(g, v) for g, v in zip(grads, variables) if id(v) in local],
                [(g, v) for g, v in zip(grads, variables) if id(v) not in local])

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)
