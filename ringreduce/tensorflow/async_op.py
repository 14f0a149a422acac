"""Collectives in TF1 graphs (a tf.compat.v1 Session): an asynchronous op.

The same library holds RingreduceStatus, which a tf.function's collective
(a numpy_function, which TensorFlow would fail with UnknownError whatever
the Python exception) uses to fail with the code of its error instead: a
mismatch FAILED_PRECONDITION, a refused argument INVALID_ARGUMENT
(stateful_call; without a compiler, a bare numpy_function, warned once).

A collective in a TF1 graph must not block the thread it runs on. The
Session runs independent ops on a few inter-op threads in no fixed order; a
blocking hand-over (numpy_function waiting for its partner) holds a thread,
and ranks that start several collectives in different orders each hold every
thread waiting on names the other has not started: deadlock (6 independent
allreduces on 2 ranks do it). So there the ops are RingreduceAsyncCall
(csrc/tf/async_call.cc, Horovod's AsyncOpKernel pattern): its kernel hands
the inputs to Python and returns at once; the Python function runs on a
thread of our own (one per collective in flight: none waits for another),
pairs its collective by name through the background engine as every op
does, and completes the op, which sets its outputs and status and calls
TensorFlow's done().

    outs = async_call(fn, [x], [x.dtype], name="RingAllreduce")  # fn(numpy...) -> numpy

The kernel is compiled on first use, against the TensorFlow that is
installed (tf.sysconfig's flags, the system C++ compiler: $CXX, else c++),
into a cache directory ($RINGREDUCE_TF_OPS_DIR, else
~/.cache/ringreduce/tf_ops), one file per TensorFlow version, source and
flags; ranks starting at once build it once (a file lock). `python -m
ringreduce.tensorflow.async_op` builds it ahead (for a read-only image). A
wheel cannot ship it prebuilt: TensorFlow is not importable in pip's
isolated build, and the library is tied to the exact TensorFlow version.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import itertools
import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

import ringreduce as rr

PACKAGE = Path(__file__).resolve().parent.parent
SOURCE_NAME = "async_call.cc"
SOURCE_DIRS = [PACKAGE / "csrc" / "tf", PACKAGE.parent / "csrc" / "tf"]  # a wheel's copy (setup.py), then the tree
# TensorFlow's headers warn about themselves; our own warnings stay on.
CXXFLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wno-deprecated-declarations", "-Wno-sign-compare",
            "-Wno-interference-size"]


# --------------------------------------------------------------------------- building


def source() -> Path:
    for d in SOURCE_DIRS:
        if (d / SOURCE_NAME).exists():
            return d / SOURCE_NAME
    raise rr.RingReduceError(f"csrc/tf/{SOURCE_NAME} not found next to ringreduce: reinstall ringreduce")


def compiler() -> list[str]:
    """The compiler's command: $CXX split as a shell would ("ccache g++"), else c++ or g++."""
    cxx = shlex.split(os.environ.get("CXX", "")) or [shutil.which("c++") or shutil.which("g++") or ""]
    if not cxx[0] or not shutil.which(cxx[0]):
        raise rr.RingReduceError(
            "collectives in TF1 graphs (tf.compat.v1 Session) need ringreduce's TensorFlow op, which is compiled "
            "on first use: no C++ compiler found (install g++, or set CXX=/path/to/c++). Eager code and "
            "tf.function need none.")
    return cxx


def build_command(out: Path) -> list[str]:
    return (compiler() + CXXFLAGS + [str(source()), "-o", str(out)] + tf.sysconfig.get_compile_flags()
            + tf.sysconfig.get_link_flags())


def library_path() -> Path:
    """Where the op library for this TensorFlow, source and flags lives."""
    digest = hashlib.sha256(source().read_bytes())
    digest.update(" ".join(CXXFLAGS + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()).encode())
    base = os.environ.get("RINGREDUCE_TF_OPS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringreduce", "tf_ops")
    return Path(base) / f"async_call-tf{tf.__version__}-{digest.hexdigest()[:16]}.so"


def _is(path: Path, st: os.stat_result | None) -> bool:
    return st is not None and path.exists() and (path.stat().st_ino, path.stat().st_mtime_ns) == (st.st_ino,
                                                                                                 st.st_mtime_ns)


def build(damaged: os.stat_result | None = None) -> Path:
    """The op library, compiled unless it is there already (and not the
    file `damaged`, which failed to load)."""
    path = library_path()
    if path.exists() and not _is(path, damaged):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(f"{path}.lock", "w")
    except OSError as e:
        raise rr.RingReduceError(
            f"ringreduce's TensorFlow op for TF1 graphs is compiled on first use, but its cache {path.parent} is not "
            f"writable ({e}): set RINGREDUCE_TF_OPS_DIR to a writable directory, or build it ahead where it is "
            "(python -m ringreduce.tensorflow.async_op)") from e
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together: one compiles, the others wait for it
        except OSError:  # a filesystem without locks (some NFS): ranks may compile twice, each renaming its own
            pass
        if path.exists() and not _is(path, damaged):  # another rank built it meanwhile
            return path
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        cmd = build_command(tmp)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise rr.RingReduceError(f"building ringreduce's TensorFlow op failed ({out.returncode}):\n"
                                     f"{shlex.join(cmd)}\n{out.stderr[-4000:]}")
        os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- the calls


@dataclass
class _Call:
    fn: object
    out_dtypes: list  # numpy dtypes the results must have


_calls: dict[str, _Call] = {}  # token -> what the op runs; dropped with its graph
_tokens = itertools.count(1)
_NUMPY_OF = {}  # TF DataType enum -> numpy dtype


def _numpy_dtype(enum: int) -> np.dtype:
    dt = _NUMPY_OF.get(enum)
    if dt is None:
        dt = _NUMPY_OF[enum] = np.dtype(tf.as_dtype(enum).as_numpy_dtype)
    return dt


class _Workers:
    """Daemon threads that run the calls: a new one whenever none is idle,
    so no collective ever waits for another to free a thread (that would be
    the deadlock again), and a call blocked for good never holds up exit."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="ringreduce-tf-call", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_workers = _Workers()

# TensorFlow's error codes (tensorflow/core/protobuf/error_codes.proto).
_UNKNOWN, _INVALID_ARGUMENT, _FAILED_PRECONDITION, _UNIMPLEMENTED, _INTERNAL = 2, 3, 9, 12, 13


def _status(exc: BaseException) -> tuple[int, str]:
    """The TF error code and message a Python exception becomes: a mismatch
    FAILED_PRECONDITION, its message starting `ringreduce.MismatchError: `
    (errors.is_mismatch reads it); a refused argument (ValueError, TypeError)
    INVALID_ARGUMENT; a TensorFlow error its own code."""
    if isinstance(exc, rr.MismatchError):
        return _FAILED_PRECONDITION, f"ringreduce.MismatchError: {exc}"
    if isinstance(exc, tf.errors.OpError):
        return exc.error_code, exc.message
    code = (_INVALID_ARGUMENT if isinstance(exc, (ValueError, TypeError)) else
            _UNIMPLEMENTED if isinstance(exc, NotImplementedError) else _UNKNOWN)
    return code, f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def _finish(call: int, results=None, exc: BaseException | None = None) -> None:
    """Completes the op `call` (the kernel's handle) with results or exc,
    exactly once. Never raises: the op's done() must be called whatever
    happens, or session.run would wait for ever."""
    if exc is None:
        try:
            n = len(results)
            dims = [d for r in results for d in r.shape]
            args = (n, (ctypes.c_int * n)(*[tf.as_dtype(r.dtype).as_datatype_enum for r in results]),
                    (ctypes.c_int * n)(*[r.ndim for r in results]), (ctypes.c_int64 * max(1, len(dims)))(*dims),
                    (ctypes.c_void_p * n)(*[r.ctypes.data for r in results]))
        except BaseException as e:  # noqa: BLE001 - reported through the op below
            exc = e
        else:
            if _lib.ringreduce_tf_complete(ctypes.c_void_p(call), 0, None, *args) != 0:
                print("ringreduce: a TF1 collective's results did not fit its outputs", file=sys.stderr)
            return
    try:
        code, message = _status(exc)
    except BaseException:  # noqa: BLE001 - an exception whose str() fails
        code, message = _INTERNAL, f"ringreduce: the op failed with {type(exc).__name__}"
    _lib.ringreduce_tf_complete(ctypes.c_void_p(call), code, message.encode(errors="replace"), 0, None, None, None,
                                None)


def _run(entry: _Call, call: int, arrays: list) -> None:
    try:
        results = entry.fn(*arrays)
        if len(entry.out_dtypes) == 1 and not isinstance(results, (list, tuple)):  # one array for one output
            results = [results]
        results = [np.require(np.asarray(r), requirements="C") for r in results]  # 0-d stays 0-d
        for i, (r, dt) in enumerate(zip(results, entry.out_dtypes)):
            if r.dtype != dt:
                raise TypeError(f"result {i} is {r.dtype}, the op expects {dt}")
        if len(results) != len(entry.out_dtypes):
            raise TypeError(f"{len(results)} results for {len(entry.out_dtypes)} outputs")
    except BaseException as exc:  # noqa: BLE001 - every error reaches the caller's session.run
        _finish(call, exc=exc)
        return
    _finish(call, results)


def _start(token: bytes, call: int, n: int, dtypes, ndims, dims, data) -> None:
    """The kernel's ComputeAsync, on TensorFlow's thread: copies the inputs
    (valid only during this call) and queues the work."""
    try:
        entry = _calls[token.decode()]
        arrays, at = [], 0
        for i in range(n):
            shape = tuple(dims[at:at + ndims[i]]) if ndims[i] else ()
            at += ndims[i]
            a = np.empty(shape, _numpy_dtype(dtypes[i]))
            if a.nbytes:
                ctypes.memmove(a.ctypes.data, data[i], a.nbytes)
            arrays.append(a)
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyError):
            exc = RuntimeError(f"no ringreduce call {token!r} in this process: the graph was built elsewhere")
        _finish(call, exc=exc)
        return
    _workers.submit(lambda: _run(entry, call, arrays))


if __name__ != "__main__":  # run as a script, the package has imported (and registered) this module already
    tf.no_gradient("RingreduceAsyncCall")  # the TF ops define their gradients with tf.custom_gradient
_START = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                          ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64),
                          ctypes.POINTER(ctypes.c_void_p))
_start_c = _START(_start)  # kept alive for as long as the library may call it
_lib = None
_ops = None
_load_lock = threading.Lock()


@tf.autograph.experimental.do_not_convert  # autograph would lose the global assignments
def load():
    """The op module (tf.load_op_library), built and wired on first use."""
    global _lib, _ops
    with _load_lock:
        if _ops is None:
            path = build()
            try:
                ops = tf.load_op_library(str(path))
            except tf.errors.OpError:  # a damaged file under our name (a full disk, a bad copy): build it again
                path = build(damaged=path.stat())
                ops = tf.load_op_library(str(path))
            path = str(path)
            lib = ctypes.CDLL(path)  # the same loaded library (dlopen of one path), for the C entry points
            lib.ringreduce_tf_set_start.argtypes = [_START]
            lib.ringreduce_tf_complete.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.ringreduce_tf_complete.restype = ctypes.c_int
            lib.ringreduce_tf_set_start(_start_c)
            _lib, _ops = lib, ops
    return _ops


def _forget(tokens: list) -> None:
    for t in tokens:
        _calls.pop(t, None)


_graph_tokens: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@tf.autograph.experimental.do_not_convert
def async_call(fn, inputs, out_dtypes, name: str | None = None) -> list:
    """Graph tensors: fn(*numpy inputs) run without holding a TensorFlow
    thread; it returns one array (one output) or a sequence of them, of
    exactly out_dtypes (one output: the array, or a sequence of one). Shapes
    are unknown: set them on the outputs."""
    ops = load()
    token = f"ringreduce-call-{next(_tokens)}"
    out_dtypes = [tf.as_dtype(d) for d in out_dtypes]
    _calls[token] = _Call(fn, [np.dtype(d.as_numpy_dtype) for d in out_dtypes])
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:  # a tf.cond branch's or tf.function's graph lives
        graph = graph.outer_graph                            # in the outermost one, which the Session runs
    tokens = _graph_tokens.get(graph)
    if tokens is None:
        tokens = _graph_tokens[graph] = []
        weakref.finalize(graph, _forget, tokens)
    tokens.append(token)
    return ops.ringreduce_async_call(inputs=inputs, Tout=out_dtypes, token=token, name=name)


_unavailable: list = []  # why the op could not be loaded, once known


def available() -> bool:
    """Whether the op library can be used here: built (or buildable) and
    loaded. Where it cannot (no C++ compiler), a tf.function's collectives
    are bare numpy_functions, warned once; TF1 graphs need the op."""
    if _ops is not None:
        return True
    if _unavailable:
        return False
    try:
        load()
        return True
    except rr.RingReduceError as e:
        _unavailable.append(str(e))
        warnings.warn("ringreduce's TensorFlow ops are not available, so collectives in a tf.function fail as "
                      "numpy_functions do: a mismatch between ranks there arrives as tf.errors.UnknownError "
                      f"(hvd.is_mismatch(e) recognises it). Why: {e}", RuntimeWarning, stacklevel=3)
        return False


@tf.autograph.experimental.do_not_convert
def stateful_call(fn, inputs, out_dtypes, name: str | None = None) -> list:
    """fn(*numpy inputs) as a stateful op of the graph being built, whose
    failure is a real status with its error's code (_status: a mismatch
    FAILED_PRECONDITION, ValueError/TypeError INVALID_ARGUMENT). In a TF1
    graph, the asynchronous op. In a tf.function, a blocking numpy_function
    (cheaper there, docs/performance.md) that returns its error instead of
    raising it, then RingreduceStatus, which passes the results on or fails
    with that error; where the op library is not available, the
    numpy_function alone (its errors then UnknownError). Returns a list of
    outputs."""
    if in_tf1_graph():
        return async_call(fn, inputs, out_dtypes, name=name)
    out_dtypes = [tf.as_dtype(d) for d in out_dtypes]
    if not available():
        out = tf.numpy_function(fn, inputs, out_dtypes, stateful=True, name=name)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    empty = [np.zeros(0, d.as_numpy_dtype) for d in out_dtypes]

    def run(*arrays):
        try:
            results = fn(*arrays)
            results = [results] if len(out_dtypes) == 1 and not isinstance(results, (list, tuple)) else list(results)
            return [np.int32(0), np.array(b"", dtype=object)] + results
        except Exception as exc:  # noqa: BLE001 - it becomes the op's status
            try:
                code, message = _status(exc)
            except Exception:  # noqa: BLE001 - an exception whose str() fails
                code, message = _INTERNAL, f"ringreduce: the op failed with {type(exc).__name__}"
            return [np.int32(code), np.array(message.encode(errors="replace"), dtype=object)] + empty

    outs = tf.numpy_function(run, inputs, [tf.int32, tf.string] + out_dtypes, stateful=True, name=name)
    return list(_ops.ringreduce_status(code=outs[0], message=outs[1], values=list(outs[2:]),
                                       name=f"{name or 'Ring'}Status"))


def in_tf1_graph() -> bool:
    """Whether ops built now go into a TF1 graph (outside any tf.function)."""
    return not tf.compat.v1.executing_eagerly_outside_functions()


if __name__ == "__main__":
    print(build())
