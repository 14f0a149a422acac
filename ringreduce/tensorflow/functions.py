"""Python objects between ranks, as Horovod's functions.py offers them:
pickled to bytes, then moved by ringreduce's uint8 collectives (the length
first, so every rank knows how many bytes to expect). Eager code only: an
object is not a tensor."""
from __future__ import annotations

import pickle

import numpy as np

import ringreduce as rr

from .basics import check_process_set, global_process_set
from .errors import raising_tf_errors


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


@raising_tf_errors
def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Root's obj on every rank (any picklable object; the others' obj is ignored)."""
    check_process_set(process_set)
    label = name or "broadcast_object"
    data = _dumps(obj) if rr.rank() == root_rank else np.zeros(0, dtype=np.uint8)
    length = rr.broadcast(np.array([data.size], dtype=np.int64), root=root_rank, name=f"{label}.length")
    if rr.rank() != root_rank:
        data = np.zeros(int(length[0]), dtype=np.uint8)
    return pickle.loads(rr.broadcast(data, root=root_rank, name=label).tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function obj -> broadcast_object(obj, root_rank, ...)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@raising_tf_errors
def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's obj, as a list in rank order."""
    check_process_set(process_set)
    label = name or "allgather_object"
    data = _dumps(obj)
    lengths = rr.allgather(np.array([data.size], dtype=np.int64), name=f"{label}.lengths")
    gathered = rr.allgather(data, name=label).tobytes()
    ends = np.cumsum(lengths)
    return [pickle.loads(gathered[end - n:end]) for n, end in zip(lengths.tolist(), ends.tolist())]
