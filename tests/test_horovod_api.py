"""Horovod's TensorFlow API under ringreduce.tensorflow (`import
ringreduce.tensorflow as hvd`), checked against numpy as Horovod's own tests
(test/parallel/test_tensorflow.py, test_tensorflow2_keras.py) check it: every
op eagerly and inside tf.function, several world sizes, gradients, errors.
TensorFlow is slow to import: each job checks many things, and reports the
ones that went wrong (an empty list passes)."""
import os

import numpy as np
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
import os, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
bad = []

def check(label, got, want, rtol=0.0):
    # Exact, or within rtol where 16-bit partial sums round at each rank.
    got, want = np.asarray(got), np.asarray(want)
    same = np.array_equal(got, want) if rtol == 0.0 else np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=rtol)
    if got.shape != want.shape or got.dtype != want.dtype or not same:
        bad.append(f"{label}: got {got.dtype}{got.shape} {got.ravel()[:6]}, want {want.dtype}{want.shape} {want.ravel()[:6]}")

def modes(fn, *args):
    # The same call eagerly and traced by tf.function (where each op runs as a TF op).
    return [("eager", fn(*args)), ("tf.function", tf.function(fn)(*args))]

def raises(label, exc, fn):
    try:
        fn()
    except exc as e:
        return e
    except Exception as e:
        bad.append(f"{label}: raised {type(e).__name__}: {e}")
        return None
    bad.append(f"{label}: did not raise {exc.__name__}")
"""

OPS = PRELUDE + """
rng = np.random.default_rng(1234)  # the same on every rank, as Horovod's tests seed it
def per_rank(dtype, shape):
    # Rank k's tensor: every rank can compute every other's, so numpy gives the answer.
    base = rng.uniform(-100, 100, size=shape)
    return [(base + 7 * k).astype(dtype) if np.dtype(dtype).kind == "f" else (base - 13 * k).astype(dtype)
            for k in range(n)]

SUM_RTOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}  # rounding order
ref = {"sum": lambda xs: np.sum(xs, axis=0), "min": lambda xs: np.min(xs, axis=0),
       "max": lambda xs: np.max(xs, axis=0), "prod": lambda xs: np.prod(xs, axis=0)}

for dtype in [np.int32, np.int64, np.float16, np.float32, np.float64]:
    for dim in [1, 2, 3]:
        xs = per_rank(dtype, [5] * dim)
        if np.dtype(dtype).kind == "i":
            xs = [np.clip(x, -30, 30).astype(dtype) for x in xs]  # products stay in range
        x = tf.constant(xs[r])
        for opname, op in [("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max)]:
            for mode, got in modes(lambda t: hvd.allreduce(t, op=op), x):
                want = ref[opname](np.stack(xs).astype(np.float64)).astype(dtype)
                check(f"allreduce {opname} {np.dtype(dtype)} dim {dim} {mode}", got.numpy(), want,
                      rtol=SUM_RTOL.get(np.dtype(dtype), 0.0) if opname == "sum" else 0.0)
        if dim == 1 and np.dtype(dtype).kind == "i":
            for mode, got in modes(lambda t: hvd.allreduce(t, op=hvd.Product), x):
                check(f"allreduce prod {np.dtype(dtype)} {mode}", got.numpy(), np.prod(np.stack(xs), axis=0).astype(dtype))
        # Average is the default op; integers: the sum * (1/size) in float64, truncated (Horovod's scaling).
        for mode, got in modes(lambda t: hvd.allreduce(t), x):
            s = np.stack(xs)
            if np.dtype(dtype).kind == "i":
                want = (s.sum(axis=0).astype(np.float64) * (1.0 / n)).astype(dtype)
            else:
                want = got.numpy()  # floats: checked against the mean below, within rounding
                np.testing.assert_allclose(want.astype(np.float64), s.astype(np.float64).mean(axis=0),
                                           rtol=1e-6, atol=0.07 if dtype == np.float16 else 1e-9)
            check(f"allreduce default(avg) {np.dtype(dtype)} dim {dim} {mode}", got.numpy(), want)

# pre/postscale: Horovod scales integers in float64 (then casts back), float16 in float32.
factor = 0.3725
for dtype in [np.int32, np.int64, np.float16, np.float32]:
    xs = per_rank(dtype, [17])
    wide = np.float64 if np.dtype(dtype).kind == "i" else np.float32 if dtype == np.float16 else dtype
    scaled = [(x.astype(wide) * wide(factor)).astype(dtype) for x in xs]
    want_pre = np.sum(np.stack(scaled).astype(np.float32 if dtype == np.float16 else dtype), axis=0).astype(dtype)
    summed = np.sum(np.stack(xs).astype(np.float32 if dtype == np.float16 else dtype), axis=0).astype(dtype)
    want_post = (summed.astype(wide) * wide(factor)).astype(dtype)
    tol = SUM_RTOL.get(np.dtype(dtype), 0.0)
    for mode, got in modes(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=factor), tf.constant(xs[r])):
        check(f"prescale {np.dtype(dtype)} {mode}", got.numpy(), want_pre, tol)
    for mode, got in modes(lambda t: hvd.allreduce(t, op=hvd.Sum, postscale_factor=factor), tf.constant(xs[r])):
        check(f"postscale {np.dtype(dtype)} {mode}", got.numpy(), want_post, tol)

# The deprecated average= form; op and average together; Adasum; an unknown op.
v = tf.constant(np.full(4, float(r + 1), np.float32))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check("average=True", hvd.allreduce(v, average=True).numpy(), np.full(4, (n + 1) / 2, np.float32))
    check("average=False", hvd.allreduce(v, average=False).numpy(), np.full(4, n * (n + 1) / 2, np.float32))
if not any(issubclass(w.category, DeprecationWarning) for w in caught):
    bad.append("average= gave no DeprecationWarning")
raises("op and average", ValueError, lambda: hvd.allreduce(v, average=True, op=hvd.Sum))
raises("Adasum", NotImplementedError, lambda: hvd.allreduce(v, op=hvd.Adasum))
raises("Adasum reducescatter", NotImplementedError, lambda: hvd.reducescatter(v, op=hvd.Adasum))
raises("unknown op", ValueError, lambda: hvd.allreduce(v, op="median"))

# grouped_allreduce: a list in, a list out, each reduced.
group = [tf.constant(np.full([3] * (i + 1), float(r * 10 + i), np.float64)) for i in range(3)]
for mode, got in modes(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum), group):
    for i, g in enumerate(got):
        check(f"grouped_allreduce {i} {mode}", g.numpy(), np.full([3] * (i + 1), sum(k * 10.0 + i for k in range(n))))

# allgather: ranks differ in dim 0; dtypes the ring has no code for travel as bytes.
sizes = [3, 2, 7, 4][:n]
for dtype in [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, bool]:
    mine = (np.ones([sizes[r], 4, 2]) * r).astype(dtype)
    want = np.concatenate([(np.ones([sizes[k], 4, 2]) * k).astype(dtype) for k in range(n)])
    for mode, got in modes(hvd.allgather, tf.constant(mine)):
        check(f"allgather {np.dtype(dtype)} {mode}", got.numpy(), want)
for mode, got in modes(lambda a, b: hvd.grouped_allgather([a, b]), tf.constant([r]), tf.constant([[r, r]] * (r + 1))):
    check(f"grouped_allgather 0 {mode}", got[0].numpy(), np.arange(n, dtype=np.int32))
    check(f"grouped_allgather 1 {mode}", got[1].numpy(),
          np.array([[k, k] for k in range(n) for _ in range(k + 1)], dtype=np.int32))

# broadcast from every root, any dtype; broadcast_ in place on variables.
for root in range(n):
    for dtype in [np.uint16, np.int32, np.float32, bool]:
        for mode, got in modes(lambda t: hvd.broadcast(t, root), tf.constant((np.ones([3, 2]) * (r % 2 if dtype is bool else r)).astype(dtype))):
            check(f"broadcast root {root} {np.dtype(dtype)} {mode}", got.numpy(),
                  (np.ones([3, 2]) * (root % 2 if dtype is bool else root)).astype(dtype))
    check(f"broadcast scalar root {root}", hvd.broadcast(tf.constant(float(r)), root).numpy(), np.float32(root))
    vs = [tf.Variable(np.full([2] * d, float(r), np.float32)) for d in (1, 2, 3)]
    out = hvd.broadcast_(vs, root)
    for d, (v_, o) in enumerate(zip(vs, out)):
        check(f"broadcast_ root {root} dim {d + 1}", v_.numpy(), np.full([2] * (d + 1), float(root), np.float32))
        check(f"broadcast_ returns the variables {d}", np.asarray(o), v_.numpy())
    single = tf.Variable([r, r + 1])
    hvd.broadcast_(single, root)
    check(f"broadcast_ one variable root {root}", single.numpy(), np.array([root, root + 1], np.int32))
    w = tf.Variable(np.full(3, float(r), np.float32))
    tf.function(lambda: hvd.broadcast_variables([w], root_rank=root))()
    check(f"broadcast_variables in tf.function root {root}", w.numpy(), np.full(3, float(root), np.float32))

# reducescatter: reduce, then rank i gets block i of dimension 0, the first rows % n blocks one row longer.
def blocks(rows):
    base, extra = divmod(rows, n)
    starts = [i * base + min(i, extra) for i in range(n + 1)]
    return starts[r], starts[r + 1]
for rows in [n * 4, n * 4 - 1, n * 4 + 1, 2]:
    for dtype in [np.int32, np.int64, np.float32, np.float64]:
        xs = per_rank(dtype, [rows, 3])
        lo, hi = blocks(rows)
        s = np.stack(xs)
        wants = {"sum": s.sum(axis=0).astype(dtype), "min": s.min(axis=0), "max": s.max(axis=0)}
        wants["avg"] = ((s.sum(axis=0).astype(np.float64) * (1.0 / n)).astype(dtype) if np.dtype(dtype).kind == "i"
                        else s.mean(axis=0).astype(dtype))
        for opname, op in [("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max), ("avg", hvd.Average)]:
            for mode, got in modes(lambda t: hvd.reducescatter(t, op=op), tf.constant(xs[r])):
                if opname == "avg" and np.dtype(dtype).kind == "f":
                    np.testing.assert_allclose(got.numpy(), wants["avg"][lo:hi], rtol=1e-5)
                    continue
                check(f"reducescatter {opname} {np.dtype(dtype)} rows {rows} {mode}", got.numpy(), wants[opname][lo:hi],
                      rtol=SUM_RTOL.get(np.dtype(dtype), 0.0) if opname == "sum" else 0.0)
    static = tf.function(hvd.reducescatter).get_concrete_function(tf.TensorSpec([rows, 3], tf.float32))
    if static.structured_outputs.shape.as_list() != [hi - lo, 3]:
        bad.append(f"reducescatter static shape {static.structured_outputs.shape} for rows {rows}")
check("reducescatter default op is Average", hvd.reducescatter(tf.constant(np.full([n, 2], float(r)))).numpy(),
      np.full([1, 2], (n - 1) / 2))
out = hvd.grouped_reducescatter([tf.constant(np.full([n * 2], r, np.int32)), tf.constant(np.full([n, 3], 1.0))], op=hvd.Sum)
check("grouped_reducescatter 0", out[0].numpy(), np.full([2], n * (n - 1) // 2, np.int32))
check("grouped_reducescatter 1", out[1].numpy(), np.full([1, 3], float(n)))
raises("reducescatter of a scalar", ValueError, lambda: hvd.reducescatter(tf.constant(1.0)))

result = bad
"""


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_ops_values_against_numpy_eager_and_in_tf_function(tmp_path, n):
    ranks = run_ranks(n, OPS, tmp_path, timeout=420, init=False)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}:\n" + "\n".join(r.result)


GRADIENTS_ERRORS_BASICS = PRELUDE + """
def grad_of(fn, x, dy=None):
    # d(fn(x))/dx with incoming gradient dy, eagerly and in tf.function.
    def g(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x, dy if dy is not None else tf.ones_like(y))
    return [(mode, out.numpy()) for mode, out in modes(g, x)]

for dtype in [np.float32, np.float64]:
    for dim in [1, 2, 3]:
        x = tf.constant(np.random.default_rng(r).uniform(-100, 100, [5] * dim).astype(dtype))
        ones = np.ones([5] * dim, dtype)
        for mode, g in grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x):
            check(f"allreduce sum grad {mode}", g, ones * n)
        for mode, g in grad_of(lambda t: hvd.allreduce(t, op=hvd.Average), x):
            check(f"allreduce avg grad {mode}", g, ones)
        for mode, g in grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), x):
            check(f"allreduce scaled grad {mode}", g, ones * n * 1.5)
        # allgather: the incoming gradient (the same on every rank, rows of rank k hold k) averaged: rank's rows.
        sizes = [3, 2, 7][:n]
        mine = tf.constant(np.ones([sizes[r]] + [4] * (dim - 1), dtype) * r)
        dy = tf.constant(np.concatenate([np.ones([sizes[k]] + [4] * (dim - 1), dtype) * k for k in range(n)]))
        for mode, g in grad_of(hvd.allgather, mine, dy):
            check(f"allgather grad {mode}", g, np.ones([sizes[r]] + [4] * (dim - 1), dtype) * r)
        # broadcast: ones averaged at the root, zeros elsewhere.
        for root in range(n):
            for mode, g in grad_of(lambda t: hvd.broadcast(t, root), x):
                check(f"broadcast grad root {root} {mode}", g, ones * (1 if r == root else 0))
        # reducescatter, as Horovod defines it: allgathered, times size for Sum.
        rs = tf.constant(np.ones([n * 4] * dim, dtype))
        for mode, g in grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum), rs):
            check(f"reducescatter sum grad {mode}", g, np.ones([n * 4] * dim, dtype) * n)
        for mode, g in grad_of(lambda t: hvd.reducescatter(t, op=hvd.Average), rs):
            check(f"reducescatter avg grad {mode}", g, np.ones([n * 4] * dim, dtype))
x = tf.constant(np.ones(3, np.float32))
raises("min has no gradient", NotImplementedError, lambda: grad_of(lambda t: hvd.allreduce(t, op=hvd.Min), x))
slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([r]), tf.constant([n, 2]))
for op in (hvd.Min, hvd.Max, hvd.Product):
    raises(f"IndexedSlices {op}", NotImplementedError, lambda: hvd.allreduce(slices, op=op))
dense = tf.convert_to_tensor(hvd.allreduce(slices, op=hvd.Sum, postscale_factor=2.0)).numpy()
check("IndexedSlices sum, postscaled", dense, np.array([[2.0, 4.0]] * n, np.float32))

# Ranks that disagree: FailedPreconditionError (and MismatchError) on every rank, eagerly and in
# tf.function; the ring goes on working after each.
import ringreduce as rr
bad_shape = tf.ones([17 + r] * 3)
other_rank = tf.ones([17, 23 * 57] if r == 0 else [17, 23, 57])
other_type = tf.ones([17] * 3, dtype=tf.int32 if r % 2 == 0 else tf.float32)
cases = [("allreduce shape", lambda: hvd.allreduce(bad_shape)),
         ("allreduce rank of shape", lambda: hvd.allreduce(other_rank)),
         ("allreduce dtype", lambda: hvd.allreduce(other_type)),
         ("allgather trailing shape", lambda: hvd.allgather(tf.ones([4, 10 * (r + 1)]))),
         ("allgather dtype", lambda: hvd.allgather(other_type)),
         ("broadcast shape", lambda: hvd.broadcast(tf.ones([3, 10 * (r + 1)]), 0)),
         ("broadcast root", lambda: hvd.broadcast(tf.ones([3]), r)),
         ("reducescatter rows", lambda: hvd.reducescatter(tf.ones([n * 2 + r, 2]))),
         ("allreduce op", lambda: hvd.allreduce(tf.ones([3]), op=hvd.Sum if r == 0 else hvd.Max))]
for label, fn in cases:
    for mode, call in [("eager", fn), ("tf.function", tf.function(fn))]:
        e = raises(f"{label} {mode}", tf.errors.FailedPreconditionError, call)
        # Eagerly the op raises hvd.MismatchError itself; in a tf.function TensorFlow raises its own
        # FailedPreconditionError for the op's status, which hvd.is_mismatch recognises.
        if e is not None and mode == "eager" and not (isinstance(e, rr.MismatchError) and isinstance(e, hvd.MismatchError)):
            bad.append(f"{label} {mode}: {type(e).__mro__} is not also a MismatchError")
        if e is not None and not hvd.is_mismatch(e):
            bad.append(f"{label} {mode}: is_mismatch does not recognise {type(e).__name__}: {e}")
        if e is not None and mode == "eager" and "differs between ranks" not in str(e):  # the engine's verdict
            bad.append(f"{label}: message {e}")
        check(f"the ring works after {label} {mode}", hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(),
              np.array([float(n)], np.float32))
# Other errors inside tf.function stay what TensorFlow makes them.
def boom(a):
    raise RuntimeError("not ringreduce")
e = raises("other errors", tf.errors.UnknownError,
           tf.function(lambda: tf.numpy_function(boom, [tf.constant(1.0)], tf.float32)))
if isinstance(e, tf.errors.FailedPreconditionError) or hvd.is_mismatch(e):
    bad.append("an unrelated UnknownError became FailedPreconditionError")

# Python objects.
obj = {"rank": r, "weights": np.arange(r + 3), "text": "x" * (100 * r)}
for root in range(n):
    got = hvd.broadcast_object(obj, root_rank=root)
    if got["rank"] != root or not np.array_equal(got["weights"], np.arange(root + 3)) or got["text"] != "x" * (100 * root):
        bad.append(f"broadcast_object root {root}: {got}")
    if hvd.broadcast_object_fn(root_rank=root)([r, "a"]) != [root, "a"]:
        bad.append(f"broadcast_object_fn root {root}")
gathered = hvd.allgather_object({"rank": r, "items": list(range(r * 50))})
if gathered != [{"rank": k, "items": list(range(k * 50))} for k in range(n)]:
    bad.append(f"allgather_object: {gathered}")
raises("allgather_object, not a process set", TypeError,
       lambda: hvd.allgather_object(1, process_set=object()))

# Process sets: the global set is the default everywhere; what is not a set is refused clearly
# (sets themselves: test_ops_on_process_sets_against_numpy_eager_and_in_tf_function).
if hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, process_set=hvd.global_process_set).numpy()[0] != n:
    bad.append("process_set=global_process_set")
for name, call in [("allreduce", lambda ps: hvd.allreduce(tf.ones(2), process_set=ps)),
                   ("allgather", lambda ps: hvd.allgather(tf.ones(2), process_set=ps)),
                   ("broadcast", lambda ps: hvd.broadcast(tf.ones(2), 0, process_set=ps)),
                   ("reducescatter", lambda ps: hvd.reducescatter(tf.ones(2), process_set=ps)),
                   ("broadcast_object", lambda ps: hvd.broadcast_object(1, process_set=ps))]:
    raises(f"{name} on what is not a process set", TypeError, lambda: call(object()))
    raises(f"{name} on an unregistered set", ValueError, lambda: call(hvd.ProcessSet([0])))

# Basics: tensors eagerly and in tf.function; the layout across hosts (set per rank below).
for label, op, want in [("rank_op", hvd.rank_op, r), ("size_op", hvd.size_op, n),
                        ("local_rank_op", hvd.local_rank_op, hvd.local_rank()),
                        ("local_size_op", hvd.local_size_op, hvd.local_size())]:
    for mode, got in modes(op):
        check(f"{label} {mode}", got.numpy(), np.int32(want))
flags = {f: getattr(hvd, f)() for f in ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built",
                                        "ddl_built", "ccl_built", "rocm_built", "cuda_built", "is_initialized"]}
raises("mpi_threads_supported without MPI", ValueError, hvd.mpi_threads_supported)
if hasattr(rr, "join"):  # the engine's join: every rank joins; the last to join is a rank
    last = hvd.join()
    if last.dtype != tf.int32 or not 0 <= int(last.numpy()) < n:
        bad.append(f"join returned {last}")
    check("the ring works after join", hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(), np.array([float(n)], np.float32))
else:
    raises("join without ringreduce.join", NotImplementedError, hvd.join)
result = {"bad": bad, "flags": flags, "layout": (hvd.local_rank(), hvd.cross_rank(), hvd.cross_size(),
                                                   hvd.is_homogeneous())}
"""

# Two "hosts": ranks 0 and 2 on the first (local ranks 0, 1), rank 1 alone on the second.
LAYOUT = """
import os
_r = int(os.environ["RINGREDUCE_RANK"])
os.environ["RINGREDUCE_LOCAL_RANK"], os.environ["RINGREDUCE_LOCAL_SIZE"] = [("0", "2"), ("0", "1"), ("1", "2")][_r]
"""


@pytest.mark.slow
def test_gradients_errors_objects_and_basics_on_three_ranks(tmp_path):
    ranks = run_ranks(3, LAYOUT + GRADIENTS_ERRORS_BASICS, tmp_path, timeout=420, init=False)
    for r in ranks:
        assert r.result["bad"] == [], f"rank {r.rank}:\n" + "\n".join(r.result["bad"])
        flags = r.result["flags"]
        assert flags["is_initialized"] is True
        assert not any(flags[f] for f in ["mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
                                          "ccl_built", "rocm_built"]), flags
    # local rank, cross rank (position among the ranks with that local rank), cross size, homogeneous
    assert [r.result["layout"] for r in ranks] == [(0, 0, 2, False), (0, 1, 2, False), (1, 0, 1, False)]


@pytest.mark.slow
def test_two_ranks_gradients_and_errors(tmp_path):
    ranks = run_ranks(2, GRADIENTS_ERRORS_BASICS, tmp_path, timeout=420, init=False)
    for r in ranks:
        assert r.result["bad"] == [], f"rank {r.rank}:\n" + "\n".join(r.result["bad"])
        assert r.result["layout"] == (r.rank, 0, 1, True)


KERAS = """
import os, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
import ringreduce.tensorflow.keras as hvd
from ringreduce.tensorflow.keras.callbacks import LearningRateWarmupCallback
hvd.init()
r, n = hvd.rank(), hvd.size()
bad = []

# The names a Horovod Keras script uses resolve from the one module.
names = ["init", "shutdown", "size", "local_size", "rank", "local_rank", "cross_rank", "cross_size",
         "is_initialized", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
         "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "Average", "Sum", "Adasum",
         "Compression", "DistributedOptimizer", "DistributedGradientTape", "broadcast_global_variables",
         "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_object", "allgather_object",
         "load_model", "callbacks", "global_process_set"]
bad += [f"missing {x}" for x in names if not hasattr(hvd, x)]
bad += [f"missing callbacks.{x}" for x in ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
        "LearningRateScheduleCallback", "LearningRateWarmupCallback"] if not hasattr(hvd.callbacks, x)]

# Keras-level collectives take and return numpy values.
out = {"allreduce": hvd.allreduce(np.array([r + 1.0])), "allgather": hvd.allgather(np.array([[r]])),
       "broadcast": hvd.broadcast(np.array([r, r]), 1), "reducescatter": hvd.reducescatter(np.ones((2 * n, 2)), op=hvd.Sum)}
bad += [f"{k} returned {type(v)}" for k, v in out.items() if type(v) is not np.ndarray]
try:
    hvd.broadcast_global_variables(0)
    bad.append("broadcast_global_variables did not raise")
except RuntimeError as e:
    out["bgv"] = str(e)

def model_and_data(seed, lr=0.1, momentum=0.0):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, bias_initializer="random_normal")])
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum)), loss="mse")
    rng = np.random.default_rng(seed)
    return m, rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)

class Rates(keras.callbacks.Callback):
    # The rate each batch runs with: placed after the schedule, which sets it at batch begin.
    def __init__(self):
        super().__init__()
        self.rates = []
    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))

# Warm-up: initial_lr / n -> initial_lr over 2 epochs of 4 steps, batch by batch; then left alone.
m, x, y = model_and_data(0)
rates = Rates()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hist = m.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[
        LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, momentum_correction=False), rates])
out["warmup"] = rates.rates
out["warmup logged lr"] = hist.history.get("lr")
bad += [f"warning: {w.message}" for w in caught if "momentum" in str(w.message)]

# Schedule, staircase: initial_lr * 0.5**epoch on epochs 1 and 2 only; a constant multiplier from epoch 3.
m, x, y = model_and_data(0, lr=0.2)
rates = Rates()
m.fit(x, y, batch_size=8, epochs=5, verbose=0, callbacks=[
    hvd.callbacks.LearningRateScheduleCallback(0.1, lambda e: 0.5 ** e, start_epoch=1, end_epoch=3),
    hvd.callbacks.LearningRateScheduleCallback(0.1, 0.3, start_epoch=3), rates])
out["schedule"] = rates.rates

# Momentum correction cannot reach Keras 3's SGD (a float read at trace time): a warning says so.
m, x, y = model_and_data(0, momentum=0.9)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, 1)])
out["momentum warning"] = any("momentum_correction" in str(w.message) for w in caught)

# Broadcast at the start, except the variables named local: with rate 0 nothing moves afterwards.
m, x, y = model_and_data(10 + r, lr=0.0)
own_bias = m.layers[0].bias.numpy().copy()
m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(1, local_variables=[m.layers[0].bias]),
    hvd.callbacks.MetricAverageCallback()])
out["kernel"], out["bias"], out["own bias"] = m.layers[0].kernel.numpy(), m.layers[0].bias.numpy(), own_bias

# load_model: a model saved mid-training with a DistributedOptimizer comes back with its optimizer
# distributed again and its state (iterations, Adam's moments) kept.
path = os.path.join(os.path.dirname(os.environ["RR_TEST_RESULT"]), "model.keras")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
rng = np.random.default_rng(r)  # each rank its own data
x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.normal(size=(32, 1)).astype(np.float32)
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
state = [v.numpy().copy() for v in model.optimizer.variables]
if r == 0:
    model.save(path)
hvd.broadcast_object(None)  # everyone waits for the file
loaded = hvd.load_model(path)
opt = loaded.optimizer
out["loaded class"] = type(opt).__name__
out["loaded state"] = [v.numpy().copy() for v in opt.variables]
out["saved state"] = state
loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # different data per rank: averaged gradients keep them equal
out["iterations after"] = int(opt.iterations.numpy())
out["weights after"] = [w.copy() for w in loaded.get_weights()]

# An optimizer class of the script's own, found by name through custom_optimizers.
class TestOptimizer(keras.optimizers.RMSprop):
    pass
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.RepeatVector(3),
                          keras.layers.TimeDistributed(keras.layers.Dense(3))])
model.compile(optimizer=hvd.DistributedOptimizer(TestOptimizer(learning_rate=1e-4)), loss="mse")
model.train_on_batch(np.ones((1, 3), np.float32), np.ones((1, 3, 3), np.float32))
path = path.replace("model.keras", "custom.keras")
if r == 0:
    model.save(path)
hvd.broadcast_object(None)
custom = hvd.load_model(path, custom_optimizers=[TestOptimizer]).optimizer
out["custom"] = (type(custom).__name__, isinstance(custom, TestOptimizer), float(np.asarray(custom.learning_rate)),
                 all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(custom.variables, model.optimizer.variables)),
                 len(custom.variables) == len(model.optimizer.variables))
result = {"bad": bad, "out": out}
"""


def test_keras_module_callbacks_and_load_model(tmp_path):
    ranks = run_ranks(2, KERAS, tmp_path, timeout=420, init=False)
    n = 2
    for r in ranks:
        assert r.result["bad"] == [], f"rank {r.rank}: {r.result['bad']}"
        out = r.result["out"]
        np.testing.assert_array_equal(out["allreduce"], [1.5])
        np.testing.assert_array_equal(out["allgather"], [[0], [1]])
        np.testing.assert_array_equal(out["broadcast"], [1, 1])
        np.testing.assert_array_equal(out["reducescatter"], np.full((2, 2), 2.0))
        assert "broadcast_variables" in out["bgv"]
        # Horovod's warm-up: lr/n * ((epoch + batch/steps + 1/steps) * (n-1)/warmup + 1), ending on lr.
        want = [0.1 / n * ((e + b / 4 + 1 / 4) * (n - 1) / 2 + 1) for e in range(2) for b in range(4)]
        np.testing.assert_allclose(out["warmup"], want + [0.1] * 4, rtol=1e-6)
        np.testing.assert_allclose(out["warmup logged lr"], [want[3], 0.1, 0.1], rtol=1e-6)
        np.testing.assert_allclose(out["schedule"], [0.2, 0.2, 0.05, 0.05, 0.025, 0.025, 0.03, 0.03, 0.03, 0.03],
                                   rtol=1e-6)
        assert out["momentum warning"]
        assert out["loaded class"] == "Adam"
        assert len(out["loaded state"]) == len(out["saved state"]) > 2
        for got, want in zip(out["loaded state"], out["saved state"]):
            np.testing.assert_array_equal(got, want)
        assert out["iterations after"] == 8
        assert out["custom"] == ("TestOptimizer", True, pytest.approx(1e-4), True, True), out["custom"]
    a, b = ranks[0].result["out"], ranks[1].result["out"]
    np.testing.assert_array_equal(a["kernel"], b["kernel"])  # rank 1's kernel everywhere
    np.testing.assert_array_equal(b["bias"], b["own bias"])
    np.testing.assert_array_equal(a["bias"], a["own bias"])  # local: not broadcast
    assert not np.array_equal(a["bias"], b["bias"])
    for wa, wb in zip(a["weights after"], b["weights after"]):
        np.testing.assert_array_equal(wa, wb)


MPI_FLAGS = """
import os, pickle, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
hvd.init()  # under mpirun: the ring runs over MPI
from mpi4py import MPI
out = {"mpi_built": hvd.mpi_built(), "mpi_enabled": hvd.mpi_enabled(), "threads": hvd.mpi_threads_supported(),
       "thread level": MPI.Query_thread(), "multiple": MPI.THREAD_MULTIPLE,
       "sum": hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()}
with open(f"{sys.argv[1]}.rank{hvd.rank()}.pkl", "wb") as f:
    pickle.dump(out, f)
"""


def test_mpi_flags_under_mpirun(tmp_path):
    import os
    import pickle
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from ranks import REPO
    mpirun = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")
    try:
        from ringreduce import _mpi  # noqa: F401
    except ImportError:
        pytest.skip("the MPI transport is not built (MPICC=... pip install -e '.[mpi]')")
    script = tmp_path / "flags.py"
    script.write_text(MPI_FLAGS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGREDUCE_")}
    proc = subprocess.run([mpirun, "-np", "2", sys.executable, str(script), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=240, env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        out = pickle.loads((tmp_path / f"out.rank{r}.pkl").read_bytes())
        assert out["mpi_built"] is True and out["mpi_enabled"] is True, out
        assert out["threads"] is (out["thread level"] == out["multiple"]), out
        assert out["sum"] == [2.0]


PROCESS_SETS = PRELUDE + """
import threading
sets = [hvd.add_process_set(s) for s in ([0, 2], [1, 2, 3] if n == 4 else [1, 2])]
rng = np.random.default_rng(7)
base = {k: rng.uniform(-50, 50, size=(7, 3)).astype(np.float32) for k in range(n)}
def x_of(k, i):  # rank k's tensor for check i
    return base[k] + i
for step in range(2):  # sets interleaved with global ops, twice
    for ps in [hvd.global_process_set] + sets:
        m = list(range(n)) if ps is hvd.global_process_set else ps.ranks
        if r not in m:
            continue
        me, k = m.index(r), len(m)
        tag = f"set {m} step {step}"
        xs = np.stack([x_of(j, step) for j in m]).astype(np.float64)
        x = tf.constant(x_of(r, step))
        for mode, got in modes(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=ps), x):
            check(f"{tag} allreduce sum {mode}", got.numpy(), xs.sum(0).astype(np.float32), rtol=1e-5)
        for mode, got in modes(lambda t: hvd.allreduce(t, process_set=ps), x):
            check(f"{tag} allreduce avg {mode}", got.numpy(), (xs.sum(0) / k).astype(np.float32), rtol=1e-5)
        xi = tf.constant(np.arange(6, dtype=np.int32) * (r + 1))
        for mode, got in modes(lambda t: hvd.allreduce(t, process_set=ps), xi):
            check(f"{tag} allreduce int avg {mode}", got.numpy(),
                  (np.arange(6) * sum(j + 1 for j in m) * (1.0 / k)).astype(np.int32))
        for mode, got in modes(lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum, process_set=ps), x):
            check(f"{tag} grouped_allreduce {mode}", got[1].numpy(), (2 * xs.sum(0)).astype(np.float32), rtol=1e-5)
        rows = tf.constant(x_of(r, step)[:me + 1])
        for mode, got in modes(lambda t: hvd.allgather(t, process_set=ps), rows):
            check(f"{tag} allgather {mode}", got.numpy(), np.concatenate([x_of(j, step)[:i + 1] for i, j in enumerate(m)]))
        for mode, got in modes(lambda t: hvd.grouped_allgather([t], process_set=ps), rows):
            check(f"{tag} grouped_allgather {mode}", got[0].numpy(), np.concatenate([x_of(j, step)[:i + 1] for i, j in enumerate(m)]))
        root = m[-1]
        for mode, got in modes(lambda t: hvd.broadcast(t, root, process_set=ps), x):
            check(f"{tag} broadcast {mode}", got.numpy(), x_of(root, step))
        for mode, got in modes(lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=ps), x):
            lo = me * (7 // k) + min(me, 7 % k); hi = lo + 7 // k + (1 if me < 7 % k else 0)
            check(f"{tag} reducescatter {mode}", got.numpy(), xs.sum(0)[lo:hi].astype(np.float32), rtol=1e-5)
        for mode, got in modes(lambda t: hvd.grouped_reducescatter([t], op=hvd.Average, process_set=ps), x):
            check(f"{tag} grouped_reducescatter avg {mode}", got[0].numpy(), (xs.sum(0) / k)[lo:hi].astype(np.float32), rtol=1e-5)
        a2a = tf.constant(np.repeat(np.arange(k, dtype=np.float32)[:, None] + 10 * r, 2, axis=1))
        for mode, got in modes(lambda t: hvd.alltoall(t, process_set=ps), a2a):
            check(f"{tag} alltoall {mode}", got.numpy(), np.array([[me + 10 * j] * 2 for j in m], dtype=np.float32))
        # gradients use the set's size and rank
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, process_set=ps))
        check(f"{tag} allreduce grad", tape.gradient(loss, x).numpy(), np.full((7, 3), k, np.float32))
        with tf.GradientTape() as tape:
            tape.watch(rows)
            loss = tf.reduce_sum(hvd.allgather(rows, process_set=ps) * 2.0)
        check(f"{tag} allgather grad", tape.gradient(loss, rows).numpy(), np.full((me + 1, 3), 2.0, np.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, process_set=ps))
        check(f"{tag} reducescatter grad", tape.gradient(loss, x).numpy(), np.full((7, 3), k, np.float32))
        v = tf.Variable(x_of(r, step) * 0 + r)
        hvd.broadcast_variables([v], root_rank=root, process_set=ps)
        check(f"{tag} broadcast_variables", v.numpy(), np.full((7, 3), root, np.float32))
        check(f"{tag} broadcast_", hvd.broadcast_(tf.Variable([float(r)]), root, process_set=ps).numpy(), np.array([float(root)], np.float32))
        if hvd.broadcast_object({"r": r}, root_rank=root, process_set=ps) != {"r": root}:
            bad.append(f"{tag} broadcast_object")
        if hvd.allgather_object(r, process_set=ps) != m:
            bad.append(f"{tag} allgather_object")
        if int(hvd.rank_op(ps.process_set_id)) != me or int(hvd.size_op(ps.process_set_id)) != k:
            bad.append(f"{tag} rank_op/size_op")
# non-members get a clear error, before anything moves
for ps in sets:
    if r not in ps.ranks:
        for label, call in [("allreduce", lambda: hvd.allreduce(tf.ones(2), process_set=ps)),
                            ("allgather", lambda: hvd.allgather(tf.ones(2), process_set=ps)),
                            ("broadcast", lambda: hvd.broadcast(tf.ones(2), ps.ranks[0], process_set=ps)),
                            ("reducescatter", lambda: hvd.reducescatter(tf.ones(2), process_set=ps)),
                            ("alltoall", lambda: hvd.alltoall(tf.ones(2), process_set=ps)),
                            ("broadcast_object", lambda: hvd.broadcast_object(1, ps.ranks[0], process_set=ps)),
                            ("rank_op", lambda: hvd.rank_op(ps.process_set_id))]:
            e = raises(f"non-member {label}", ValueError, call)
            if e is not None and "not a member" not in str(e):
                bad.append(f"non-member {label}: {e}")
    else:
        outside = [q for q in range(n) if q not in ps.ranks][0]
        raises("root outside the set", ValueError, lambda: hvd.broadcast(tf.ones(2), outside, process_set=ps))
raises("not a ProcessSet", TypeError, lambda: hvd.allreduce(tf.ones(2), process_set=object()))
# every rank stays until every set's work is done: negotiation needs every rank
if hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy() != n:
    bad.append("final global allreduce")
result = bad
"""


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 4])
def test_ops_on_process_sets_against_numpy_eager_and_in_tf_function(tmp_path, n):
    ranks = run_ranks(n, PROCESS_SETS, tmp_path, timeout=600, init=False)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result[:10]}"


# hvd.broadcast / allgather of a tf.string tensor: a TypeError naming
# ringreduce and what to use instead (broadcast_object), not numpy's error.
@pytest.mark.parametrize("op", ["broadcast(t, 0)", "allgather(t)"])
def test_a_string_tensor_is_refused_saying_what_to_use(op):
    pytest.importorskip("tensorflow")
    import subprocess
    import sys
    from ranks import REPO
    code = ("import tensorflow as tf, ringreduce.tensorflow as hvd\nhvd.init()\nt = tf.constant(['a', 'bc'])\n"
            f"try:\n    hvd.{op}\nexcept TypeError as e:\n    print('TypeError:', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGREDUCE_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TypeError: ringreduce cannot move tf.string" in out.stdout and "broadcast_object" in out.stdout, out
