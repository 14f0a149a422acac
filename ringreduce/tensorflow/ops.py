"""ringreduce collectives as TensorFlow ops: eager and inside tf.function,
with gradients where they have one. Built on tf.numpy_function, whose C
work (the ring) runs with the GIL released; where TensorFlow sees a GPU, on
tf.py_function instead, which leaves tensors where they are: GPU tensors
cross to cupy and back through DLPack and are reduced on the GPU."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import ringreduce as rr


def _numpy_op(fn, inputs, dtype, shape, name):
    _refuse_tf1_graphs()
    if on_gpu_hosts():
        out = tf.py_function(lambda *ts: _to_tf(fn(*[_from_tf(t) for t in ts])), inputs, dtype, name=name)
    else:
        out = tf.numpy_function(fn, inputs, dtype, stateful=True, name=name)
    out.set_shape(shape)
    return out


def _refuse_tf1_graphs() -> None:
    """Eager code and tf.function run collectives in program order, the same
    on every rank (tf.function orders stateful ops). A TF1 graph run by a
    Session does not: independent collectives would run in a different order
    on each rank and pair different tensors, silently. So they are refused."""
    if not tf.compat.v1.executing_eagerly_outside_functions():
        raise RuntimeError(
            "ringreduce.tensorflow collectives need TensorFlow 2 execution (eager code or tf.function): "
            "in a TF1 graph (tf.compat.v1 Session, or eager execution disabled) independent collectives "
            "run in a different order on each rank and would pair different tensors")


def on_gpu_hosts() -> bool:
    """Whether the ops run as py_functions (TensorFlow sees a GPU)."""
    return bool(tf.config.list_logical_devices("GPU"))


def _from_tf(t):
    """An eager tensor as the collectives take it: a cupy view of GPU memory
    (DLPack, no copy), else numpy. TensorFlow's to_dlpack returns once the
    tensor's data is ready."""
    if "GPU" not in t.device:
        return t.numpy()
    import cupy
    return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(t))


def _to_tf(a):
    if isinstance(a, np.ndarray):
        return a
    # TensorFlow's from_dlpack does not wait for cupy's stream: the result
    # (copied or unpacked there) must be written before TensorFlow reads it.
    import cupy
    with a.device:
        cupy.cuda.get_current_stream().synchronize()
    capsule = a.toDlpack() if hasattr(a, "toDlpack") else a.__dlpack__()  # cupy < 15 / later
    return tf.experimental.dlpack.from_dlpack(capsule)


def allreduce(tensor, op: str = "avg", name: str | None = None):
    """Reduces tensor over all ranks (op: sum, avg, min, max, prod). For sum
    and avg the gradient is the same allreduce of the incoming gradient.
    IndexedSlices (sparse gradients) are allgathered instead."""
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op)
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _allreduce(x):
        y = _numpy_op(lambda a: rr.allreduce(a, op=op, name=name), [x], x.dtype, x.shape, "RingAllreduce")

        def grad(dy):
            if op not in ("sum", "avg"):
                raise NotImplementedError(f"allreduce with op={op!r} has no gradient")
            return allreduce(dy, op=op)
        return y, grad
    return _allreduce(tensor)


def _allreduce_sparse(slices: tf.IndexedSlices, op: str) -> tf.IndexedSlices:
    """Sparse gradients travel as their rows: every rank's values and indices,
    gathered (duplicates are summed when applied, as TF does)."""
    if op not in ("sum", "avg"):
        raise ValueError("sparse allreduce supports sum and avg")
    values = allgather(slices.values)
    if op == "avg":
        values = values / tf.cast(rr.size(), values.dtype)
    return tf.IndexedSlices(values, allgather(slices.indices), slices.dense_shape)


def allgather(tensor, name: str | None = None):
    """Concatenates every rank's tensor along axis 0; the gradient is this
    rank's rows of the summed incoming gradient."""
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _allgather(x):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:])
        y = _numpy_op(lambda a: rr.allgather(a, name=name), [x], x.dtype, shape, "RingAllgather")

        def grad(dy):
            rows = tf.shape(x)[0]
            counts = allgather(tf.reshape(rows, [1]))
            start = tf.reduce_sum(counts[:rr.rank()])
            return allreduce(dy, op="sum")[start:start + rows]
        return y, grad
    return _allgather(tensor)


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """Root's tensor on every rank; the gradient flows back to the root, summed."""
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _broadcast(x):
        y = _numpy_op(lambda a: rr.broadcast(a, root=root_rank, name=name), [x], x.dtype, x.shape,
                      "RingBroadcast")

        def grad(dy):
            summed = allreduce(dy, op="sum")
            return summed if rr.rank() == root_rank else tf.zeros_like(summed)
        return y, grad
    return _broadcast(tensor)


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assigns root's values to every variable, on every rank (in order)."""
    for v in variables:
        v.assign(broadcast(tf.convert_to_tensor(v), root_rank, name=f"bcast.{_path(v)}"))


def _path(v) -> str:
    return getattr(v, "path", None) or v.name


def as_numpy(x) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)
