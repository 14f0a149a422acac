"""ringreduce collectives as TensorFlow ops, with Horovod's names,
signatures and gradients: eager and inside tf.function, on the global
process set or any other (process_set=: sizes, ranks, Average and gradients
are the set's). Every op hands its array to the background engine
(ringreduce/engine/scheduler.py), which pairs collectives across ranks BY NAME
(naming.py says which name an op gets), and waits for the result. Eagerly
the op body runs at once; in a tf.function it is a tf.numpy_function, whose
wait releases the GIL, followed by ringreduce's status op, so its failures
are real error statuses; in a TF1 graph, ringreduce's asynchronous op
(async_op.py); where TensorFlow sees a GPU, a tf.py_function instead in a
tf.function, which leaves tensors where they are: GPU tensors cross to cupy
and back through DLPack and are reduced on the GPU. Refused arguments raise
InvalidArgumentError, mismatches between ranks MismatchError (errors.py)."""
from __future__ import annotations

import contextlib
import threading
import time
import warnings

import numpy as np
import tensorflow as tf

import ringreduce as rr
from ringreduce.engine import engine, register_kind

from .async_op import in_tf1_graph, stateful_call
from .basics import check_process_set, global_process_set
from .compression import Compression, engine_compressor
from .errors import raising_tf_errors
from .naming import collective_name

# Horovod's reduction ops. They are ringreduce's op names, so op="sum" works too.
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"
Adasum = "adasum"
_REDUCE_OPS = (Average, Sum, Min, Max, Product)


def _numpy_op(fn, inputs, dtype, shape, name):
    """Runs fn (numpy/cupy arrays in, one array out) as a TF op. Eagerly it is
    called directly, so its exceptions (MismatchError, InvalidArgumentError)
    reach the caller as they are; in a graph it is async_op.stateful_call's
    op (stateful, so it runs in program order; failing with the code of its
    error; in a TF1 graph holding no thread while it waits for its
    partners); on GPU hosts in a tf.function, a py_function."""
    fn = raising_tf_errors(fn)
    if tf.executing_eagerly():
        return tf.convert_to_tensor(_to_tf(fn(*[_from_tf(t) for t in inputs])))
    if not in_tf1_graph() and on_gpu_hosts():
        out = tf.py_function(lambda *ts: _to_tf(fn(*[_from_tf(t) for t in ts])), inputs, dtype, name=name)
    else:
        (out,) = stateful_call(fn, inputs, [dtype], name=name)
    out.set_shape(shape)
    return out


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
    if isinstance(a, (np.ndarray, np.generic)):  # host results, numpy scalars too (join's rank)
        return a
    # TensorFlow's from_dlpack does not wait for cupy's stream: the result
    # (copied or unpacked there) must be written before TensorFlow reads it.
    import cupy
    with a.device:
        cupy.cuda.get_current_stream().synchronize()
    capsule = a.toDlpack() if hasattr(a, "toDlpack") else a.__dlpack__()  # cupy < 15 / later
    return tf.experimental.dlpack.from_dlpack(capsule)



_waited = [0.0]  # seconds this process's threads have blocked on the engine's results (waiting())
_waited_lock = threading.Lock()


@contextlib.contextmanager
def waiting():
    """Counts the block's time into waited_seconds(): every wait of this
    layer for a collective's result (the ops, the gradients' hand-overs)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - start
        with _waited_lock:
            _waited[0] += spent


def waited_seconds() -> float:
    """Seconds this process has spent, since it started, blocked on the
    results of collectives run through this layer (waits on several threads
    at once add up). A step's compute time is its wall time less what this
    grew by during it (ringreduce.tensorflow.balance measures so)."""
    with _waited_lock:
        return _waited[0]


def run_collective(name: str, array, kind: str, process_set, op: str = "sum", root: int = 0, **extra):
    """One collective through the background engine, paired across ranks by
    name; blocks until its result is there."""
    eng = engine()
    handle = eng.enqueue(name, array, op=op, kind=kind, root=root, process_set=process_set, **extra)
    with waiting():
        return eng.wait(handle)


def refuse(label: str, kind: str, ps, problem: Exception) -> None:
    """This rank's own bad argument, found before its request reached the
    engine: it still meets the others' request of that name, as a refusal
    (Engine.refuse), so they raise MismatchError naming this rank at once
    instead of waiting RINGREDUCE_TIMEOUT for it. The caller then raises."""
    if not rr.is_initialized():
        return
    engine().refuse(label, problem, kind=kind, process_set=None if ps is None or ps.process_set_id == 0 else ps)


def refuse_eagerly(kind_label: str, kind: str, name, process_set, problem: Exception) -> None:
    """As refuse, for a problem found before the op is made (op, root_rank,
    splits' dtype): eagerly, an unnamed collective takes its number here, as
    on the ranks that went on (collective_name): without it this rank's
    numbering fell one behind, and its next collective of the kind paired
    with the others' previous one: silently the wrong tensor. In a
    tf.function the names are fixed at trace time: nothing to keep in step."""
    if not tf.executing_eagerly():
        return
    try:
        ps = check_process_set(process_set)
    except (TypeError, ValueError):
        return  # not a set this rank runs collectives on: nothing of the others to meet
    refuse(collective_name(kind_label, name, ps), kind, ps, problem)


# --------------------------------------------------------------------------- arguments


def _reduce_op(op, average) -> str:
    """op from Horovod's arguments: op=None means Average; average= is the
    deprecated spelling (True: Average, False: Sum)."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average: give only one of them")
    if average is not None:
        warnings.warn("allreduce(average=...) is deprecated: use op=Average or op=Sum", DeprecationWarning,
                      stacklevel=3)
        op = Average if average else Sum
    if op is None:
        op = Average
    if op == Adasum:
        raise NotImplementedError("op=Adasum: ringreduce has no Adasum reduction; use Average or Sum")
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; choose Average, Sum, Min, Max or Product")
    return op


# ringreduce's C kernels and wire know these dtypes; the others travel as
# their bytes where no arithmetic is needed (allgather, broadcast).
_RING_DTYPES = {np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")} | {
    np.dtype(tf.bfloat16.as_numpy_dtype)}


def _as_bytes(a):
    """a (at least 1-d) as uint8 along its last axis, if the ring has no code
    for its dtype; returns (array, how to undo)."""
    if a.dtype in _RING_DTYPES:
        return a, lambda b: b
    dtype, rest = a.dtype, a.shape[1:]
    if dtype.hasobject:  # tf.string: numpy's own "Cannot change data-type for array of references" said nothing
        raise TypeError("ringreduce cannot move tf.string (or other variable-size) tensors: only fixed-size "
                        "dtypes; broadcast_object / allgather_object carry Python objects")
    raw = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
    return raw, lambda b: np.ascontiguousarray(b).view(dtype).reshape((b.shape[0],) + rest)


def _scale(a, factor: float):
    """a * factor as Horovod scales: integers in float64 then cast back
    (truncating), 16-bit floats in float32, the rest in their own dtype."""
    if factor == 1.0:
        return a
    if a.dtype.kind in "iu":
        return (a.astype(np.float64) * factor).astype(a.dtype)
    if a.dtype.itemsize == 2:
        return (a.astype(np.float32) * np.float32(factor)).astype(a.dtype)
    return a * a.dtype.type(factor)


def scale_tensor(t, factor: float):
    """t * factor (a tf.Tensor or tf.IndexedSlices) as _scale does for arrays:
    integers in float64 then cast back (truncating), 16-bit floats in
    float32, the rest in their own dtype. A factor is never cast to an
    integer dtype (1/size would be 0)."""
    if t is None or factor == 1.0:
        return t
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(scale_tensor(t.values, factor), t.indices, t.dense_shape)
    if t.dtype.is_integer:
        return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)
    if t.dtype.size == 2:
        return tf.cast(tf.cast(t, tf.float32) * factor, t.dtype)
    return t * tf.cast(factor, t.dtype)


def _reduce_array(a, op: str, prescale: float, postscale: float, name, ps, compressor=None):
    a = _scale(a, prescale)
    if op == Average and a.dtype.kind in "iu":  # as Horovod: the sum, scaled by 1/size in float64
        return _scale(run_collective(name, a, "allreduce", ps, op=Sum), postscale / ps.size())
    if compressor is not None:
        return _scale(run_collective(name, a, "allreduce", ps, op=op, compression=compressor), postscale)
    return _scale(run_collective(name, a, "allreduce", ps, op=op), postscale)


# --------------------------------------------------------------------------- allreduce


@raising_tf_errors
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set):
    """Reduces tensor over all ranks (Horovod's signature; op defaults to
    Average). prescale_factor multiplies each rank's tensor before the
    reduction, postscale_factor the result. Integers with Average: the sum
    divided by size in float64, truncated. The gradient (Sum, Average) is
    the same allreduce of the incoming gradient. IndexedSlices are
    allgathered (Sum, Average only). device_* are accepted and ignored: a
    tensor is reduced where it lives."""
    try:
        op = _reduce_op(op, average)
    except (NotImplementedError, ValueError) as exc:
        refuse_eagerly("Allreduce", "allreduce", name, process_set, exc)
        raise
    ps = check_process_set(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor * postscale_factor, ps)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(_allreduce_dense(wire, op, prescale_factor, postscale_factor, name, ps,
                                                   engine_compressor(compression)), ctx)


def _allreduce_dense(tensor, op, prescale, postscale, name, ps, compressor=None):
    """compressor: the engine's (Compression.int8 and the like) for the
    forward reduction; the gradient travels exact."""
    @tf.custom_gradient
    def _allreduce(x):
        label = collective_name("Allreduce", name, ps)
        y = _numpy_op(lambda a: _reduce_array(a, op, prescale, postscale, label, ps, compressor), [x], x.dtype,
                      x.shape, "RingAllreduce")

        def grad(dy):
            if op not in (Sum, Average):
                raise NotImplementedError(f"allreduce with op={op!r} has no gradient")
            return _allreduce_dense(dy, op, prescale, postscale, None, ps)
        return y, grad
    return _allreduce(tensor)


def _allreduce_sparse(slices: tf.IndexedSlices, op: str, scale: float, ps) -> tf.IndexedSlices:
    """Sparse gradients travel as their rows: every rank's values and indices,
    gathered (duplicates are summed when applied, as TF does). Average of
    integer values is Horovod's values / size: a float tensor (TF's truediv);
    scale (prescale * postscale) multiplies as scale_tensor does."""
    if op not in (Sum, Average):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports Sum and Average, not op={op!r}")
    values = allgather(slices.values, process_set=ps)
    if op == Average and values.dtype.is_integer:  # as Horovod: values / size, a float (TF's truediv)
        values, op = values / tf.cast(ps.size(), values.dtype), Sum
    values = scale_tensor(values, scale / ps.size() if op == Average else scale)
    return tf.IndexedSlices(values, allgather(slices.indices, process_set=ps), slices.dense_shape)


@raising_tf_errors
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """allreduce of each tensor of a list, in order; returns a list."""
    return [allreduce(t, average, device_dense, device_sparse, compression, op, prescale_factor, postscale_factor,
                      process_set=process_set) for t in tensors]


# --------------------------------------------------------------------------- allgather


@raising_tf_errors
def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's tensor along axis 0 (ranks may differ in dim 0).
    Gradient, as Horovod's: the incoming gradient averaged over ranks, this
    rank's rows of it."""
    ps = check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _allgather(x):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:])
        label = collective_name("Allgather", name, ps)
        y = _numpy_op(lambda a: _gather_array(a, label, ps), [x], x.dtype, shape, "RingAllgather")

        def grad(dy):
            rows = tf.shape(x, out_type=tf.int64)[:1]
            counts = allgather(rows, process_set=ps)
            start = tf.reduce_sum(counts[:ps.rank()])
            return _allreduce_dense(dy, Average, 1.0, 1.0, None, ps)[start:start + rows[0]]
        return y, grad
    return _allgather(tensor)


def _gather_array(a, name, ps):
    a = a.reshape(1) if a.ndim == 0 else a
    try:
        raw, undo = _as_bytes(a)
    except TypeError as exc:
        refuse(name, "allgather", ps, exc)
        raise
    return undo(run_collective(name, raw, "allgather", ps))


@raising_tf_errors
def grouped_allgather(tensors, process_set=global_process_set):
    return [allgather(t, process_set=process_set) for t in tensors]


# --------------------------------------------------------------------------- broadcast


@raising_tf_errors
def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Root's tensor on every rank (of the set: root_rank is a world rank,
    one of its members). Gradient, as Horovod's: the incoming gradient
    averaged over ranks, at the root; zeros elsewhere."""
    ps = check_process_set(process_set)
    if root_rank not in ps.ranks:
        problem = ValueError(f"root_rank {root_rank!r} is not a rank of {ps}")
        refuse_eagerly("Broadcast", "broadcast", name, ps, problem)
        raise problem
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _broadcast(x):
        label = collective_name("Broadcast", name, ps)
        y = _numpy_op(lambda a: _broadcast_array(a, root_rank, label, ps), [x], x.dtype, x.shape, "RingBroadcast")

        def grad(dy):
            averaged = _allreduce_dense(dy, Average, 1.0, 1.0, None, ps)
            if rr.rank() == root_rank:
                return averaged
            # The zeros wait for the allreduce: a TF1 Session runs only what a fetch
            # needs, and zeros of a known shape need nothing, so the root would wait alone.
            with tf.control_dependencies([averaged]):
                return tf.zeros_like(averaged)
        return y, grad
    return _broadcast(tensor)


def _broadcast_array(a, root, name, ps):
    shape = a.shape
    try:
        raw, undo = _as_bytes(a.reshape(1) if a.ndim == 0 else a)
    except TypeError as exc:
        refuse(name, "broadcast", ps, exc)
        raise
    return undo(run_collective(name, raw, "broadcast", ps, root=root)).reshape(shape)


@raising_tf_errors
def broadcast_(variables, root_rank=0, name=None, process_set=global_process_set):
    """In place, as Horovod's: assigns root's value to each variable (one, or
    a list) and returns the updated values, as tensors, in every mode (in a
    TF1 graph, evaluating one runs its assignment), so `a, b =
    hvd.broadcast_([a, b], 0)` works everywhere."""
    single = not isinstance(variables, (list, tuple))
    values = [tf.convert_to_tensor(a) for a in _assign_broadcast([variables] if single else variables, root_rank,
                                                                  process_set)]
    return values[0] if single else values


@raising_tf_errors
def broadcast_variables(variables, root_rank=0, process_set=global_process_set, inplace=False):
    """Assigns root's values to every variable, on every rank (in order);
    returns the variables. In a TF1 graph, as Horovod's, returns the op that
    does it (session.run it). inplace (Horovod's) changes nothing: it always is."""
    variables = list(variables)
    assigns = _assign_broadcast(variables, root_rank, process_set)
    if in_tf1_graph():  # a Session runs nothing it is not asked for
        return tf.group(*assigns, name="RingBroadcastVariables")
    return variables


def _assign_broadcast(variables, root_rank, process_set) -> list:
    """Root's value assigned to each variable; returns what each assign returns."""
    # Named by position in this call, not by variable path: ranks whose Keras
    # names differ (one built an extra layer first) still pair.
    base = collective_name("broadcast_variables", None, check_process_set(process_set))
    return [v.assign(broadcast(tf.convert_to_tensor(v), root_rank, name=f"{base}.{i}", process_set=process_set))
            for i, v in enumerate(variables)]


def broadcast_global_variables(root_rank=0):
    """In a TF1 graph, as Horovod's: the op that assigns root's value to every
    global variable. Elsewhere there is no such collection: RuntimeError."""
    if in_tf1_graph():
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
    raise RuntimeError("broadcast_global_variables() needs TF1's global variables, which eager TF2 code and "
                       "tf.function do not have: use broadcast_variables(model.variables + optimizer.variables, "
                       "root_rank) or BroadcastGlobalVariablesCallback(root_rank) instead")


def _path(v) -> str:
    return getattr(v, "path", None) or v.name


# --------------------------------------------------------------------------- reducescatter


def _rows_of(rows: int, n: int, i: int) -> tuple[int, int]:
    """Horovod's split of `rows` over n ranks: the first rows % n get one more."""
    base, extra = divmod(rows, n)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def _reduce_scatter_rows(h):
    """The engine kind "reducescatter_rows": reduces h.array over the set and
    returns this rank's block of rows. Each block is padded to the largest
    one, so the ring's equal chunks are exactly the blocks; the engine's key
    holds the unpadded shape, so ranks that differ in rows fail."""
    a = h.array
    ps = h.group or global_process_set
    n, me = ps.size(), ps.rank()
    rows = a.shape[0]
    most = -(-rows // n)
    if rows == most * n:
        blocks = a
    else:
        blocks = np.zeros((n * most,) + a.shape[1:], dtype=a.dtype)
        for i in range(n):
            lo, hi = _rows_of(rows, n, i)
            blocks[i * most:i * most + hi - lo] = a[lo:hi]
    chunk = rr.reduce_scatter(blocks, op=h.op, name=h.name, process_set=h.group)
    lo, hi = _rows_of(rows, n, me)
    return chunk.reshape((most,) + a.shape[1:])[:hi - lo]


register_kind("reducescatter_rows", _reduce_scatter_rows, reduces=True)


def _reducescatter_array(a, op, prescale, postscale, name, ps):
    if a.ndim == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension (it splits dimension 0)")
    integer_average = op == Average and a.dtype.kind in "iu"
    mine = run_collective(name, _scale(a, prescale), "reducescatter_rows", ps, op=Sum if integer_average else op)
    return _scale(mine, postscale / ps.size() if integer_average else postscale)


@raising_tf_errors
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces tensor over all ranks and returns this rank's block of rows
    (dimension 0 split as Horovod splits it: with r rows on n ranks, the first
    r % n ranks get one row more). Gradient, as Horovod defines it: the
    incoming gradients allgathered, times size for Sum."""
    try:
        op = _reduce_op(op, None)
    except (NotImplementedError, ValueError) as exc:
        refuse_eagerly("Reducescatter", "reducescatter_rows", name, process_set, exc)
        raise
    ps = check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(_reducescatter(wire, op, prescale_factor, postscale_factor, name, ps), ctx)


def _reducescatter(tensor, op, prescale, postscale, name, ps):
    @tf.custom_gradient
    def _scatter(x):
        shape = tf.TensorShape(None)
        if x.shape.rank:
            lo, hi = _rows_of(x.shape[0], ps.size(), ps.rank()) if x.shape[0] is not None else (0, None)
            shape = tf.TensorShape([None if hi is None else hi - lo]).concatenate(x.shape[1:])
        label = collective_name("Reducescatter", name, ps)
        y = _numpy_op(lambda a: _reducescatter_array(a, op, prescale, postscale, label, ps), [x], x.dtype, shape,
                      "RingReducescatter")

        def grad(dy):
            if op not in (Sum, Average):
                raise NotImplementedError(f"reducescatter with op={op!r} has no gradient")
            scale = prescale * postscale * (ps.size() if op == Sum else 1)
            return scale_tensor(allgather(dy, process_set=ps), scale)
        return y, grad
    return _scatter(tensor)


@raising_tf_errors
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, device_dense, compression, op, None, process_set, prescale_factor, postscale_factor)
            for t in tensors]


# --------------------------------------------------------------------------- join


def join(device=""):
    """Waits until every rank has joined (ringreduce.join, the engine's), and
    returns the last rank to join, as an int32 tensor."""
    if not hasattr(rr, "join"):
        raise NotImplementedError("join() needs ringreduce.join(), which this ringreduce does not have yet")
    return _numpy_op(lambda: np.int32(rr.join()), [], tf.int32, tf.TensorShape([]), "RingJoin")
