"""The errors of ringreduce.tensorflow, as Horovod's callers catch them, in
eager code, tf.function and TF1 graphs, with nothing of TensorFlow patched.

A refused argument (alltoall splits, a root_rank outside the set, a dtype the
ring cannot move, an unknown op) raises hvd.InvalidArgumentError, which is
ValueError and tf.errors.InvalidArgumentError: eagerly, and when a graph op
is built; a refusal only the op's run finds in a graph is the op's
INVALID_ARGUMENT status (tf.errors.InvalidArgumentError). Ranks that
disagree: hvd.MismatchError eagerly, the op's FAILED_PRECONDITION status in
graphs (UnknownError where a tf.function falls back to numpy_functions),
and hvd.is_mismatch(e) says so for each. Every rank ends with the ring
usable."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

JOB = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce as rr
import ringreduce.tensorflow as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
bad = []

# Nothing of TensorFlow's is replaced: its error classes are made as TensorFlow makes them.
for cls in (tf.errors.UnknownError, tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError):
    if "__new__" in vars(cls):
        bad.append(f"{cls.__name__}.__new__ is patched")
if not (issubclass(hvd.InvalidArgumentError, ValueError)
        and issubclass(hvd.InvalidArgumentError, tf.errors.InvalidArgumentError)):
    bad.append(f"InvalidArgumentError's bases: {hvd.InvalidArgumentError.__mro__}")

def error_of(label, fn):
    try:
        fn()
    except Exception as e:
        return e
    bad.append(f"{label}: did not raise")

def ring_works(label):
    got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()
    if got.tolist() != [float(n)]:
        bad.append(f"the ring after {label}: {got}")

rows = lambda: tf.ones([4, 2])  # made in the graph of the call
# Each: (label, the op call, found when the op is built (else only when it runs)).
REFUSED = [
    ("alltoall splits sum", lambda: hvd.alltoall(rows(), splits=tf.constant([1] * (n - 1) + [2], tf.int32)), False),
    ("alltoall splits count", lambda: hvd.alltoall(rows(), splits=tf.constant([4] + [0] * n, tf.int32)), False),
    ("alltoall negative split", lambda: hvd.alltoall(rows(), splits=tf.constant([5] + [-1] + [0] * (n - 2), tf.int32)), False),
    ("alltoall splits dtype", lambda: hvd.alltoall(rows(), splits=tf.constant([2.0] * n)), True),
    ("alltoall rows not divisible", lambda: hvd.alltoall(tf.ones([n * 2 + 1, 2])), False),
    ("broadcast root outside", lambda: hvd.broadcast(tf.ones([2]), root_rank=n + 3), True),
    ("broadcast_ root outside", lambda: hvd.broadcast_([tf.Variable([1.0])], root_rank=-1), True),
    ("allreduce unknown op", lambda: hvd.allreduce(tf.ones([2]), op="median"), True),
    ("allreduce op and average", lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, average=True), True),
    ("reducescatter unknown op", lambda: hvd.reducescatter(tf.ones([2]), op="median"), True),
    ("allgather of strings", lambda: hvd.allgather(tf.constant(["a", "b"])), False),
    ("broadcast of strings", lambda: hvd.broadcast(tf.constant(["a"]), 0), False),
    ("allreduce of strings", lambda: hvd.allreduce(tf.constant(["a"])), False),
    ("reducescatter of a scalar", lambda: hvd.reducescatter(tf.constant(1.0)), False),
]

for label, call, at_build in REFUSED:
    e = error_of(f"{label} eager", call)
    if e is not None and not (isinstance(e, hvd.InvalidArgumentError) and isinstance(e, ValueError)
                              and isinstance(e, tf.errors.InvalidArgumentError)):
        bad.append(f"{label} eager: {type(e).__mro__}: {e}")
    ring_works(f"{label} eager")

    e = error_of(f"{label} tf.function", tf.function(call))
    if e is not None and not isinstance(e, tf.errors.InvalidArgumentError):
        bad.append(f"{label} tf.function: {type(e).__mro__}: {e}")
    if e is not None and at_build and not isinstance(e, hvd.InvalidArgumentError):
        bad.append(f"{label} tf.function, found at trace time: {type(e).__mro__}")
    ring_works(f"{label} tf.function")

    with tf.Graph().as_default():
        def build_and_run():
            out = call()
            with tf.compat.v1.Session() as s:
                s.run(tf.compat.v1.global_variables_initializer())
                s.run(out)
        e = error_of(f"{label} TF1 graph", build_and_run)
    if e is not None and not isinstance(e, tf.errors.InvalidArgumentError):
        bad.append(f"{label} TF1 graph: {type(e).__mro__}: {e}")
    if e is not None and at_build and not isinstance(e, hvd.InvalidArgumentError):
        bad.append(f"{label} TF1 graph, found when built: {type(e).__mro__}")
    ring_works(f"{label} TF1 graph")

# One rank's bad splits: it gets InvalidArgumentError, the others a mismatch naming it; nobody waits.
def one_bad():
    splits = [1] * (n - 1) + [2] if r == 1 else [4 // n] * n
    return hvd.alltoall(tf.ones([4, 2]), splits=tf.constant(splits, tf.int32))
if n == 2:
    e = error_of("one rank's bad splits", one_bad)
    if r == 1 and not isinstance(e, hvd.InvalidArgumentError):
        bad.append(f"the rank at fault: {type(e).__mro__}")
    if r != 1 and not (isinstance(e, tf.errors.OpError) and "rank 1" in str(e)):
        bad.append(f"the others: {type(e).__mro__}: {e}")
    ring_works("one rank's bad splits")

# Ranks that disagree.
def mismatch():
    return hvd.allreduce(tf.ones([3 + r]))
e = error_of("mismatch eager", mismatch)
if not (isinstance(e, hvd.MismatchError) and isinstance(e, tf.errors.FailedPreconditionError) and hvd.is_mismatch(e)):
    bad.append(f"mismatch eager: {type(e).__mro__}")
ring_works("mismatch eager")
e = error_of("mismatch tf.function", tf.function(mismatch))
if not (isinstance(e, tf.errors.FailedPreconditionError) and hvd.is_mismatch(e)):
    bad.append(f"mismatch tf.function: {type(e).__mro__}: {e}")
ring_works("mismatch tf.function")
with tf.Graph().as_default():
    out = mismatch()
    with tf.compat.v1.Session() as s:
        e = error_of("mismatch TF1", lambda: s.run(out))
if not (isinstance(e, tf.errors.FailedPreconditionError) and hvd.is_mismatch(e)):
    bad.append(f"mismatch TF1 graph: {type(e).__mro__}: {e}")
ring_works("mismatch TF1 graph")

# A tape's gradients, overlapped with backprop and reduced all at once (RINGREDUCE_OVERLAP=0),
# one or two of them: right, and a mismatch between ranks there is FailedPreconditionError.
for overlap in ("1", "0"):
    os.environ["RINGREDUCE_OVERLAP"] = overlap
    for case, shapes in enumerate(([[2]], [[2], [3]], [[2 + r]])):
        vs = [tf.Variable(tf.ones(s)) for s in shapes]
        def tape_step():
            with tf.GradientTape() as tape:
                loss = sum(tf.reduce_sum(v) * (r + 1.0) for v in vs)
            return hvd.DistributedGradientTape(tape).gradient(loss, vs)
        # Collectives in a tf.function are named after the function: each its own here.
        tape_step.__name__ = f"tape{case}overlap{overlap}step"
        if case == 2:  # the shapes differ between ranks
            e = error_of(f"tape mismatch, overlap {overlap}", tf.function(tape_step))
            if not (isinstance(e, tf.errors.FailedPreconditionError) and hvd.is_mismatch(e)):
                bad.append(f"tape mismatch, overlap {overlap}: {type(e).__mro__}: {e}")
            ring_works(f"tape mismatch, overlap {overlap}")
            continue
        got = [g.numpy().tolist() for g in tf.function(tape_step)()]
        if got != [[(n + 1) / 2] * s[0] for s in shapes]:
            bad.append(f"tape, overlap {overlap}, shapes {shapes}: {got}")
del os.environ["RINGREDUCE_OVERLAP"]

# Where the op cannot be built (no compiler), a tf.function's collectives are numpy_functions:
# they still work, and a mismatch arrives as TensorFlow's UnknownError, which is_mismatch recognises.
import warnings
from ringreduce.tensorflow import async_op
built = async_op.available
async_op.available = lambda: False
try:
    got = tf.function(lambda: hvd.allreduce(tf.constant([2.0]), op=hvd.Sum))().numpy()
    if got.tolist() != [2.0 * n]:
        bad.append(f"numpy_function fallback: {got}")
    e = error_of("mismatch, numpy_function fallback", tf.function(mismatch))
    if not (isinstance(e, tf.errors.UnknownError) and hvd.is_mismatch(e)):
        bad.append(f"mismatch, numpy_function fallback: {type(e).__mro__}: {e}")
finally:
    async_op.available = built
ring_works("mismatch, numpy_function fallback")

# Not a mismatch: is_mismatch says no.
for e in (tf.errors.UnknownError(None, None, "RuntimeError: not ringreduce"), ValueError("x"),
          tf.errors.FailedPreconditionError(None, None, "variable not initialised")):
    if hvd.is_mismatch(e):
        bad.append(f"is_mismatch({e!r})")
# Both classes travel through pickle (run_ranks' results, multiprocessing).
import pickle
for e in (hvd.InvalidArgumentError("splits"), hvd.MismatchError("x differs", 1)):
    back = pickle.loads(pickle.dumps(e))
    if type(back) is not type(e) or str(back) != str(e):
        bad.append(f"pickled {e!r}: {back!r}")
result = bad
"""


@pytest.mark.parametrize("n", [2])
def test_refused_arguments_and_mismatches_raise_horovods_error_classes_in_every_mode(tmp_path, n):
    ranks = run_ranks(n, JOB, tmp_path, timeout=400, init=False, env={"RINGREDUCE_TIMEOUT": "60"})
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result}"
