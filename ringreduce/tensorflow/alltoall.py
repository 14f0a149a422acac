"""alltoall as a TensorFlow op, as hvd.alltoall: eager and inside tf.function,
on any process set, with Horovod's gradient, through the background engine
(paired by name, as every op of ops.py). Tensors go through the host, GPU
tensors included: alltoall
moves rows, it has no arithmetic to keep on a GPU (async_op.stateful_call).
Bad splits (their dtype,
their count, their sum, a negative entry) raise InvalidArgumentError
(errors.py): eagerly and, for a dtype, when the op is built, as that class;
when only the op's run sees them in a graph, as the op's INVALID_ARGUMENT
status (tf.errors.InvalidArgumentError)."""
from __future__ import annotations

import tensorflow as tf

from .async_op import stateful_call
from .basics import check_process_set, global_process_set
from .errors import raising_tf_errors
from .naming import collective_name
from .ops import refuse_eagerly, run_collective


def _alltoall_op(x, splits, name, ps):
    """(received, received_splits) as tensors; splits None: equal split."""
    label = collective_name("Alltoall", name, ps)

    @raising_tf_errors
    def run(a, *s):
        return run_collective(label, a, "alltoall", ps, splits=s[0] if s else None)

    inputs = [x] if splits is None else [x, splits]
    if tf.executing_eagerly():
        received, received_splits = run(*[t.numpy() for t in inputs])
        return tf.convert_to_tensor(received), tf.convert_to_tensor(received_splits)
    # Its errors a real status; in a TF1 graph no thread held while it waits (async_op.py).
    received, received_splits = stateful_call(run, inputs, [x.dtype, tf.int32], name="RingAlltoall")
    received.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
    received_splits.set_shape([ps.size()])
    return received, received_splits


@raising_tf_errors
def alltoall(tensor, splits=None, name: str | None = None, process_set=global_process_set):
    """Scatters tensor's rows to every rank (of the set) and gathers what each sent here.

    tensor is split along axis 0 into pieces of splits[i] rows for rank i
    (splits: int32 or int64, one entry per rank of the set; default: equal
    pieces, rows divisible by its size). Returns, as hvd.alltoall does,
    (received, received_splits) when splits is given, else received alone:
    the pieces every rank addressed to this one, concatenated in rank order,
    and how many rows came from each rank. The gradient is the alltoall of
    the incoming gradient with received_splits as splits: every row goes home."""
    ps = check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if splits.dtype not in (tf.int32, tf.int64):
            problem = TypeError(f"alltoall splits must be int32 or int64, not {splits.dtype.name}")
            refuse_eagerly("Alltoall", "alltoall", name, ps, problem)
            raise problem

    @tf.custom_gradient
    def _alltoall(x):
        received, received_splits = _alltoall_op(x, splits, name, ps)

        def grad(dy, _dsplits=None):
            back, _ = _alltoall_op(tf.convert_to_tensor(dy), received_splits, None, ps)
            return tf.reshape(back, tf.shape(x))
        return (received, received_splits), grad

    received, received_splits = _alltoall(tensor)
    return (received, received_splits) if splits is not None else received
