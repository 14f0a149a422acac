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
import weakref

import numpy as np
import tensorflow as tf

import ringreduce as rr
from ..engine import engine
from .async_op import stateful_call
from .errors import as_tf_error, raising_tf_errors
from .compression import Compression, engine_compressor
from .basics import global_process_set, overlap_enabled  # noqa: F401  (overlap_enabled: read here too)
from .naming import collective_name
from .ops import allreduce, waiting

_calls = itertools.count(1)  # call sites (one reduce_gradients in one traced step), numbered at trace time
_EAGER_COUNT = re.compile(r"^grad\.\d+\.")  # naming.py's eager names count up every step
_EPOCH = re.compile(r"~\d+$")  # a call site's epoch after a failed step (see HandOvers)


class HandOvers:
    """The gradients handed to one engine and not yet waited for.

    Each run of a reduce_gradients (each step) draws a run id first
    (begin_run, an input of all its hand-overs), and its handles are kept by
    run. A run that fails on one collective (a MismatchError) raises from
    that wait, which withdraws from the engine what the run handed over and
    will never wait for; a hand-over of that run that still comes after
    (TensorFlow lets the ops already running finish, and a slow gradient may
    hand over late) hands nothing over. So the next run's names are free.
    And since a rank whose run failed early may start the next run while
    another rank's failed run still hands over, every failure of a call
    site moves it to a new epoch whose names (name~epoch) no earlier run's
    tensors carry: every rank sees the same failures (a MismatchError fails
    on every rank), so all count alike.

    Owned by its engine (hand_overs()): made with the engine's first
    hand-over, dropped with the engine, so a new engine (ringreduce.elastic
    resets it) starts with nothing in flight and every call site at epoch 0,
    on every rank alike. Thread-safe: the ops of one step run on
    TensorFlow's threads at once."""

    def __init__(self, eng):
        self._engine = weakref.ref(eng)
        self._handles: dict[int, object] = {}  # key -> engine handle
        self._runs: dict[int, dict[bytes, int]] = {}  # run -> {name: key}, handed over and not yet waited for
        self._owner: dict[int, tuple] = {}  # key -> (run, call site, name)
        self._failed: set[int] = set()  # runs that failed: their late hand-overs are refused
        self._epochs: dict[int, int] = {}  # call site -> how many of its runs failed
        self._ids = itertools.count(1)
        self._run_ids = itertools.count(1)
        self._lock = threading.Lock()

    def engine(self):
        eng = self._engine()
        if eng is None:
            raise rr.WithdrawnError("the engine these gradients were handed to is gone (the ring was reset)")
        return eng

    def submit(self, name: str, op: str, array: np.ndarray, process_set=None, compression=None):
        if compression is None:
            return self.engine().enqueue(name, array, op, process_set=process_set)
        # A compressor's state (error feedback, warm start) is the variable's, whatever the step's name.
        return self.engine().enqueue(name, array, op, process_set=process_set, compression=compression,
                                     compression_key=_EPOCH.sub("", _EAGER_COUNT.sub("grad.", name)))

    def begin_run(self, call: int) -> np.ndarray:
        """[run id, epoch, call] for a new run of call site `call`."""
        with self._lock:
            return np.array([next(self._run_ids), self._epochs.get(call, 0), call], dtype=np.int64)

    def enqueue_all(self, run, names, op: bytes, arrays, process_set=None, compression=None) -> np.ndarray:
        run, epoch, call = (int(v) for v in run)
        keys = []
        for n, a in zip(names, arrays):
            with self._lock:
                if run in self._failed:  # a late hand-over of a failed run: nobody will wait for it
                    keys.append(0)
                    continue
            h = self.submit((n + b"~%d" % epoch if epoch else n).decode(), op.decode(), a, process_set, compression)
            with self._lock:
                key = next(self._ids)
                self._handles[key] = h
                self._runs.setdefault(run, {})[n] = key
                self._owner[key] = (run, call, n)
                late = run in self._failed  # failed while this one was handed over
            if late:
                self.withdraw_run(run)
            keys.append(key)
        return np.array(keys, dtype=np.int64)

    def wait(self, key) -> np.ndarray:
        with self._lock:
            h = self._handles.pop(int(key), None)
            if h is None:  # refused: its run had failed (only a wait TensorFlow runs anyway gets here)
                raise rr.WithdrawnError("this step failed on another collective before this gradient was handed "
                                        "over")
            run, call, name = self._owner.pop(int(key), (None, None, None))
            if run is not None:
                self._runs[run].pop(name, None)
                if not self._runs[run]:
                    del self._runs[run]
        try:
            with waiting():
                return self.engine().wait(h)
        except BaseException as e:
            if run is not None:
                self.withdraw_run(run, failed_call=call)
            if isinstance(e, rr.MismatchError):
                raise as_tf_error(e) from None
            raise

    def withdraw_run(self, run: int, failed_call: int | None = None) -> None:
        """The run failed (one of call site failed_call's, when first told): what
        it handed over and still holds is withdrawn."""
        with self._lock:
            if failed_call is not None and run not in self._failed:
                self._failed.add(run)
                self._epochs[failed_call] = self._epochs.get(failed_call, 0) + 1
            keys = list(self._runs.pop(run, {}).values())
            for k in keys:
                self._owner.pop(k, None)
            rest = [self._handles.pop(k) for k in keys if k in self._handles]
        for h in rest:
            self.engine().withdraw(h)


_by_engine: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its HandOvers
_by_engine_lock = threading.Lock()


def hand_overs() -> HandOvers:
    """The current engine's HandOvers."""
    eng = engine()
    with _by_engine_lock:
        state = _by_engine.get(eng)
        if state is None:
            state = _by_engine[eng] = HandOvers(eng)
        return state


# One nonce variable per graph its reads are lifted into (init_scope: the
# eager context, or a TF1 graph), kept as long as that graph.
_nonces: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_eager_nonce: list = []


def _nonce():
    """A value TensorFlow cannot know before the step runs (a variable read):
    as an input, it keeps a stateless op from being constant-folded, and it
    orders nothing (nobody writes the variable). The variable is the graph's
    own: one made for a TF1 graph is out of scope in eager code and in any
    other graph."""
    with tf.init_scope():
        if tf.executing_eagerly():
            if not _eager_nonce:
                _eager_nonce.append(tf.Variable(0, dtype=tf.int64, trainable=False, name="ringreduce_nonce"))
            variable = _eager_nonce[0]
        else:
            graph = tf.compat.v1.get_default_graph()
            variable = _nonces.get(graph)
            if variable is None:
                variable = _nonces[graph] = tf.Variable(0, dtype=tf.int64, trainable=False, name="ringreduce_nonce")
    return variable.read_value()


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
    run = tf.numpy_function(lambda _nonce_value: hand_overs().begin_run(call), [_nonce()], tf.int64,
                            stateful=False, name="RingBeginRun")
    for unit in sorted(units, key=lambda u: -max(i for i, _, _ in u)):  # backprop's order: last layer first
        wires = [compression.compress(g) for _, g, _ in unit]
        names = [name.encode() for _, _, name in unit]
        # The run id (from the nonce read) keeps the hand-over from being folded
        # when its inputs are constants (a gradient that does not depend on the
        # data): run once at optimisation time, it would hand over only the first step.
        keys = tf.numpy_function(lambda *arrays, ns=names, o=op.encode():
                                 hand_overs().enqueue_all(arrays[-1], ns, o, arrays[:-1], process_set,
                                                          engine_compressor(compression)),
                                 [w for w, _ in wires] + [run], tf.int64, stateful=False, name="RingHandOver")
        for j, ((i, g, _), (wire, ctx)) in enumerate(zip(unit, wires)):
            handles.append((i, g, keys[j], wire.dtype, ctx))
    for i, g, key, wire_dtype, ctx in handles:
        # A failure is the op's status (a mismatch: FailedPreconditionError), async_op.stateful_call.
        (reduced,) = stateful_call(lambda k: hand_overs().wait(k), [key], [wire_dtype], name="RingWait")
        reduced.set_shape(g.shape)
        out[i] = compression.decompress(reduced, ctx)


def _reduce_all_at_once(dense, out, op, compression, process_set):
    wires = [compression.compress(g) for _, g, _ in dense]

    @raising_tf_errors
    def run(*arrays):
        state = hand_overs()
        handles = [state.submit(n, op, a, process_set, engine_compressor(compression))
                   for (_, _, n), a in zip(dense, arrays)]
        try:
            with waiting():
                return [state.engine().wait(h) for h in handles]
        except BaseException:  # one failed: the rest are withdrawn, so the next step's names are free
            for h in handles:
                state.engine().withdraw(h)
            raise
    reduced = stateful_call(run, [w for w, _ in wires], [w.dtype for w, _ in wires], name="RingAllAtOnce")
    for (i, g, _), r, (_, ctx) in zip(dense, reduced, wires):
        r.set_shape(g.shape)
        out[i] = compression.decompress(r, ctx)
