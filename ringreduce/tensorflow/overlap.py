"""Hands gradients to the background engine the moment backprop makes them.

Inside a compiled train step, TensorFlow chains stateful ops in program order
(automatic control dependencies): a stateful hand-over would wait for every
stateful op created before it, and for the gradient of whichever variable
comes first, which backprop may make last (see shared/notes/tf-overlap.md).
So each hand-over is stateless and runs the moment its own gradient exists,
in whatever order backprop makes them (the engine negotiates the order across
ranks). The waits that follow are stateful, so TensorFlow can neither prune
nor reorder the hand-overs away from them; they are created last-layer-first,
the order gradients become ready. RINGREDUCE_OVERLAP=0 instead reduces
everything in one op after the whole backward pass, for comparison.
"""
from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import tensorflow as tf

import ringreduce as rr
from ..engine import engine
from .errors import as_tf_error
from .compression import Compression, engine_compressor
from .basics import global_process_set, overlap_enabled  # noqa: F401  (overlap_enabled: read here too)
from .naming import collective_name
from .ops import allreduce

# Handles between hand-over and wait. Each run of a reduce_gradients (each
# step) draws a run id first (_begin_run, an input of all its hand-overs), and
# its handles are kept by run. A run that fails on one collective (a
# MismatchError) raises from that wait, which withdraws from the engine what
# the run handed over and will never wait for; a hand-over of that run that
# still comes after (TensorFlow lets the ops already running finish, and a
# slow gradient may hand over late) hands nothing over. So the next run's
# names are free. And since a rank whose run failed early may start the next
# run while another rank's failed run still hands over, every failure of a
# call site (one reduce_gradients in one traced step) moves it to a new epoch
# whose names (name~epoch) no earlier run's tensors carry: every rank sees
# the same failures (a MismatchError fails on every rank), so all count alike.
_handles: dict[int, object] = {}  # key -> engine handle
_runs: dict[int, dict[bytes, int]] = {}  # run -> {name: key}, handed over and not yet waited for
_owner: dict[int, tuple] = {}  # key -> (run, call site, name)
_failed: set[int] = set()  # runs that failed: their late hand-overs are refused
_epochs: dict[int, int] = {}  # call site -> how many of its runs failed
_calls = itertools.count(1)
_ids = itertools.count(1)
_run_ids = itertools.count(1)
_lock = threading.Lock()


_EAGER_COUNT = re.compile(r"^grad\.\d+\.")  # naming.py's eager names count up every step
_EPOCH = re.compile(r"~\d+$")  # a call site's epoch after a failed step (see above)


def _submit(name: str, op: str, array: np.ndarray, process_set=None, compression=None):
    if compression is None:
        return engine().enqueue(name, array, op, process_set=process_set)
    # A compressor's state (error feedback, warm start) is the variable's, whatever the step's name.
    return engine().enqueue(name, array, op, process_set=process_set, compression=compression,
                            compression_key=_EPOCH.sub("", _EAGER_COUNT.sub("grad.", name)))


def _enqueue(name: bytes, op: bytes, array: np.ndarray, process_set=None, compression=None) -> np.int64:
    h = _submit(name.decode(), op.decode(), array, process_set, compression)
    with _lock:
        key = next(_ids)
        _handles[key] = h
    return np.int64(key)


def _begin_run(call, _nonce) -> np.ndarray:
    """[run id, epoch, call] for a new run of call site `call`."""
    with _lock:
        return np.array([next(_run_ids), _epochs.get(call, 0), call], dtype=np.int64)


def _enqueue_all(run, names, op: bytes, arrays, process_set=None, compression=None) -> np.ndarray:
    run, epoch, call = (int(v) for v in run)
    more = () if compression is None else (compression,)  # uncompressed: _enqueue's four arguments, as ever
    keys = []
    for n, a in zip(names, arrays):
        with _lock:
            if run in _failed:  # a late hand-over of a failed run: nobody will wait for it
                keys.append(0)
                continue
        key = int(_enqueue(n + b"~%d" % epoch if epoch else n, op, a, process_set, *more))
        with _lock:
            _runs.setdefault(run, {})[n] = key
            _owner[key] = (run, call, n)
            late = run in _failed  # failed while this one was handed over
        if late:
            _withdraw_run(run)
        keys.append(key)
    return np.array(keys, dtype=np.int64)


def _wait(key: np.int64) -> np.ndarray:
    with _lock:
        h = _handles.pop(int(key), None)
        if h is None:  # refused: its run had failed (only a wait TensorFlow runs anyway gets here)
            raise rr.WithdrawnError("this step failed on another collective before this gradient was handed over")
        run, call, name = _owner.pop(int(key), (None, None, None))
        if run is not None:
            _runs[run].pop(name, None)
            if not _runs[run]:
                del _runs[run]
    try:
        return engine().wait(h)
    except BaseException as e:
        if run is not None:
            _withdraw_run(run, failed_call=call)
        if isinstance(e, rr.MismatchError):
            raise as_tf_error(e) from None
        raise


def _withdraw_run(run: int, failed_call: int | None = None) -> None:
    """The run failed (one of call site failed_call's, when first told): what
    it handed over and still holds is withdrawn."""
    with _lock:
        if failed_call is not None and run not in _failed:
            _failed.add(run)
            _epochs[failed_call] = _epochs.get(failed_call, 0) + 1
        keys = list(_runs.pop(run, {}).values())
        for k in keys:
            _owner.pop(k, None)
        rest = [_handles.pop(k) for k in keys if k in _handles]
    for h in rest:
        engine().withdraw(h)


_nonce_variable = None


def _nonce():
    """A value TensorFlow cannot know before the step runs (a variable read):
    as an input, it keeps a stateless op from being constant-folded, and it
    orders nothing (nobody writes the variable)."""
    global _nonce_variable
    if _nonce_variable is None:
        with tf.init_scope():
            _nonce_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="ringreduce_nonce")
    return _nonce_variable.read_value()


def _set_of(process_set):
    return global_process_set if process_set is None else process_set


def reduce_gradients(grads, variables, op: str = "avg", compression=Compression.none,
                     sparse_as_dense: bool = False, groups=None, process_set=None):
    """Every rank's gradients (of process_set, None: the world) reduced, in
    the order given. None stays None. groups: lists of positions in grads
    whose dense gradients are handed over together, once the last of them
    exists, so they travel fused."""
    items = []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and sparse_as_dense:
            g = tf.convert_to_tensor(g)
        # Named at trace time (naming.py), unique in the graph: two tapes, or a
        # tape used twice, in one step never share a name; the path is for people.
        items.append((i, g, f"{collective_name('grad', None, _set_of(process_set))}.{getattr(v, 'path', None) or v.name}"))
    out = list(grads)
    dense = [(i, g, n) for i, g, n in items if not isinstance(g, tf.IndexedSlices)]
    if dense and overlap_enabled():
        _hand_over_as_ready(dense, out, op, compression, groups or [], process_set)
    elif dense:
        _reduce_all_at_once(dense, out, op, compression, process_set)
    # Sparse gradients are allgathered directly, so only once the engine is idle
    # on every rank: after the waits above (stateful ops run in program order).
    for i, g, _ in items:
        if isinstance(g, tf.IndexedSlices):
            out[i] = allreduce(g, op=op, process_set=process_set)
    return out


def _hand_over_as_ready(dense, out, op, compression, groups, process_set):
    by_position = {i: (i, g, name) for i, g, name in dense}
    units, grouped = [], set()
    for group in groups:
        unit = [by_position[i] for i in group if i in by_position]
        grouped.update(i for i, _, _ in unit)
        if unit:
            units.append(unit)
    units += [[item] for item in dense if item[0] not in grouped]
    handles = []
    # Stateless, so it orders nothing; the nonce keeps it from being folded: one per run.
    call = next(_calls)
    run = tf.numpy_function(lambda nonce: _begin_run(call, nonce), [_nonce()], tf.int64, stateful=False,
                            name="RingBeginRun")
    for unit in sorted(units, key=lambda u: -max(i for i, _, _ in u)):  # backprop's order: last layer first
        wires = [compression.compress(g) for _, g, _ in unit]
        names = [name.encode() for _, _, name in unit]
        # The run id (from the nonce read) keeps the hand-over from being folded
        # when its inputs are constants (a gradient that does not depend on the
        # data): run once at optimisation time, it would hand over only the first step.
        keys = tf.numpy_function(lambda *arrays, ns=names, o=op.encode():
                                 _enqueue_all(arrays[-1], ns, o, arrays[:-1], process_set,
                                              engine_compressor(compression)),
                                 [w for w, _ in wires] + [run], tf.int64, stateful=False, name="RingHandOver")
        for j, ((i, g, _), (wire, ctx)) in enumerate(zip(unit, wires)):
            handles.append((i, g, keys[j], wire.dtype, ctx))
    for i, g, key, wire_dtype, ctx in handles:
        reduced = tf.numpy_function(_wait, [key], wire_dtype, stateful=True, name="RingWait")
        reduced.set_shape(g.shape)
        out[i] = compression.decompress(reduced, ctx)


def _reduce_all_at_once(dense, out, op, compression, process_set):
    wires = [compression.compress(g) for _, g, _ in dense]

    def run(*arrays):
        handles = [_submit(n, op, a, process_set, engine_compressor(compression)) for (_, _, n), a in zip(dense, arrays)]
        try:
            return [engine().wait(h) for h in handles]
        except BaseException:  # one failed: the rest are withdrawn, so the next step's names are free
            for h in handles:
                engine().withdraw(h)
            raise
    reduced = tf.numpy_function(run, [w for w, _ in wires], [w.dtype for w, _ in wires], stateful=True,
                                name="RingAllAtOnce")
    for (i, g, _), r, (_, ctx) in zip(dense, reduced, wires):
        r.set_shape(g.shape)
        out[i] = compression.decompress(r, ctx)
