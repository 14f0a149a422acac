"""The errors the TensorFlow ops raise, as Horovod's callers expect them.

Two classes, each both a Python and a TensorFlow error, raised by the ops
themselves (nothing of TensorFlow's is patched):

- MismatchError: ranks called a collective with different shape, dtype, op,
  root or name. It is rr.MismatchError and tf.errors.FailedPreconditionError
  (Horovod's error for it). Found before any data moves: the communicator
  stays usable.
- InvalidArgumentError: this rank's own bad argument (alltoall splits, a
  root_rank outside the set, a dtype the ring cannot move, an unknown op, a
  process set it may not use). It is ValueError (and TypeError, which some
  of these were) and tf.errors.InvalidArgumentError, what Horovod's callers
  catch.

Both are raised as such eagerly, and, for what is checked when an op is
built, at trace time in a tf.function and at graph-building time in a TF1
graph. What only the op's run can find out inside a graph (splits' values, a
mismatch with the other ranks) becomes the op's error status, which
TensorFlow raises as its own class for that status:
tf.errors.InvalidArgumentError and tf.errors.FailedPreconditionError, the
same codes. On hosts with a GPU the ops in a tf.function are py_functions,
whose Python errors TensorFlow reports as UnknownError. is_mismatch(e) tells
a ringreduce mismatch apart however it arrived.
"""
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


class InvalidArgumentError(ValueError, TypeError, tf.errors.InvalidArgumentError):
    """An argument this rank gave a collective that it refuses (before any
    data moves; the other ranks of the collective fail with a MismatchError
    naming this rank instead of waiting for it)."""

    def __init__(self, node_def, op=None, message=None, *args):
        """InvalidArgumentError(message), or TensorFlow's (node_def, op,
        message): autograph re-creates an error raised while a tf.function
        is traced from those three, and keeps its class only if it can."""
        if message is None and isinstance(node_def, str):
            node_def, message = None, node_def
        tf.errors.OpError.__init__(self, node_def, op, message, tf.errors.INVALID_ARGUMENT)
        self.args = (message,)

    def __str__(self):
        return self.message

    def __reduce__(self):
        return type(self), (None, None, self.message)


def as_tf_error(error: BaseException) -> BaseException:
    """The TF-facing class for a ringreduce error: MismatchError for a
    mismatch, InvalidArgumentError for a refused argument (ValueError,
    TypeError); anything else as it is."""
    if isinstance(error, (MismatchError, InvalidArgumentError)):
        return error
    if isinstance(error, rr.MismatchError):
        return MismatchError(str(error), error.rank)
    if isinstance(error, (ValueError, TypeError)) and not isinstance(error, tf.errors.OpError):
        return InvalidArgumentError(str(error))
    return error


def raising_tf_errors(fn):
    """fn, with ringreduce's mismatches and refused arguments re-raised as
    MismatchError and InvalidArgumentError (as_tf_error)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (rr.MismatchError, ValueError, TypeError) as e:
            converted = as_tf_error(e)
            if converted is e:
                raise
            raise converted from e
    return wrapper


# How a ringreduce mismatch reads in the message of an error TensorFlow made
# from an op's status: the asynchronous op's status text starts
# `ringreduce.MismatchError: ` (async_op.py); a py_function's UnknownError
# carries the Python traceback, `ringreduce.tensorflow.errors.MismatchError: ...`.
_MISMATCH_TEXT = re.compile(r"(?:^|\n|\s)ringreduce\.[\w.]*MismatchError: ")


def is_mismatch(error: BaseException) -> bool:
    """Whether error is ringreduce's verdict that ranks disagreed on a
    collective: a MismatchError raised eagerly, or the error TensorFlow
    raised for an op that failed with one inside a tf.function or TF1 graph
    (FailedPreconditionError; UnknownError on GPU hosts, where the ops are
    py_functions)."""
    if isinstance(error, rr.MismatchError):
        return True
    return isinstance(error, tf.errors.OpError) and bool(_MISMATCH_TEXT.search(error.message or ""))
