"""The errors the TensorFlow ops raise, as Horovod's callers expect them.

Horovod reports ranks that disagree (shape, dtype, root, op) as
tf.errors.FailedPreconditionError; ringreduce raises rr.MismatchError. The
TF ops raise MismatchError below, which is both, so `except
tf.errors.FailedPreconditionError` and `except rr.MismatchError` catch it
alike. It is found before any data moves: the communicator stays usable."""
from __future__ import annotations

import functools
import re

import tensorflow as tf

import ringreduce as rr


class MismatchError(rr.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks called a collective with different shape, dtype, op, root or name."""

    def __init__(self, message: str, rank: int | None = None):
        # Two unrelated __init__ chains: each is run once, explicitly.
        tf.errors.OpError.__init__(self, None, None, message, tf.errors.FAILED_PRECONDITION)
        rr.MismatchError.__init__(self, message, rank)

    def __reduce__(self):  # OpError's pickling needs node_def/op; ours needs the message alone
        return type(self), (self.message, self.rank)


def as_tf_error(error: rr.MismatchError) -> MismatchError:
    return error if isinstance(error, MismatchError) else MismatchError(str(error), error.rank)


def raising_tf_errors(fn):
    """fn, with rr.MismatchError re-raised as the TF-facing MismatchError."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except rr.MismatchError as e:
            if isinstance(e, MismatchError):
                raise
            raise as_tf_error(e) from e
    return wrapper


# Inside tf.function the ops run as numpy_/py_functions, and TensorFlow turns
# any Python exception there into UnknownError (py_func.cc maps only ValueError,
# TypeError, StopIteration, MemoryError and NotImplementedError), keeping the
# exception's text. The C++ runtime makes that exception by calling the
# UnknownError class it registered at import (the registry cannot be set
# twice), and Python insists on an UnknownError instance. So the hook is
# UnknownError.__new__: when the text says a ringreduce mismatch caused it (an
# op's, or the background engine's), the caller gets MismatchInFunctionError,
# which is a MismatchError (so a FailedPreconditionError, as with Horovod) and
# still an UnknownError. Every other UnknownError is made as before.
_MISMATCH_TRACE = re.compile(r"\nringreduce\.[\w.]*MismatchError: ")


class MismatchInFunctionError(MismatchError, tf.errors.UnknownError):
    """A MismatchError raised inside a tf.function; its message is TensorFlow's
    (the op, then ringreduce's own text)."""

    def __init__(self, node_def=None, op=None, message="", *args):
        tf.errors.OpError.__init__(self, node_def, op, message, tf.errors.FAILED_PRECONDITION)
        rr.MismatchError.__init__(self, message)

    def __reduce__(self):  # pickled and copied with its message where __init__ expects it
        return type(self), (None, None, self.message)


def _unknown_error_or_mismatch(cls, node_def=None, op=None, message="", *args, **kwargs):
    if cls is tf.errors.UnknownError and isinstance(message, str) and _MISMATCH_TRACE.search(message):
        cls = MismatchInFunctionError  # Python then runs its __init__ with the same arguments
    return Exception.__new__(cls, node_def, op, message, *args, **kwargs)


def _surface_mismatches_from_tf_functions() -> None:
    if "__new__" not in vars(tf.errors.UnknownError):
        tf.errors.UnknownError.__new__ = _unknown_error_or_mismatch


_surface_mismatches_from_tf_functions()


# In a TF1 graph (async_op.py) a mismatch fails the op with FAILED_PRECONDITION
# and a message that starts `ringreduce.MismatchError: `; session.run raises
# TensorFlow's FailedPreconditionError for it, made, as above, through the
# class TensorFlow registered. The same hook on its __new__ makes it a
# MismatchInGraphError: still that FailedPreconditionError, and a MismatchError.
_MISMATCH_STATUS = re.compile(r"(?:^|\n)ringreduce\.MismatchError: ")


class MismatchInGraphError(MismatchError):
    """A MismatchError raised by session.run in a TF1 graph; its message is
    TensorFlow's (ringreduce's own text, then the node)."""

    def __init__(self, node_def=None, op=None, message="", *args):
        tf.errors.OpError.__init__(self, node_def, op, message, tf.errors.FAILED_PRECONDITION)
        rr.MismatchError.__init__(self, message)

    def __reduce__(self):
        return type(self), (None, None, self.message)


def _failed_precondition_or_mismatch(cls, *args, **kwargs):
    message = args[2] if len(args) > 2 else kwargs.get("message")
    if cls is tf.errors.FailedPreconditionError and isinstance(message, str) and _MISMATCH_STATUS.search(message):
        cls = MismatchInGraphError
    return Exception.__new__(cls, *args, **kwargs)


def _surface_mismatches_from_tf1_graphs() -> None:
    if "__new__" not in vars(tf.errors.FailedPreconditionError):
        tf.errors.FailedPreconditionError.__new__ = _failed_precondition_or_mismatch


_surface_mismatches_from_tf1_graphs()
