"""Python objects between ranks, as Horovod's functions.py offers them:
pickled to bytes, then moved by the background engine's uint8 collectives
(the length first, so every rank knows how many bytes to expect), on any
process set. Eager code only: an object is not a tensor."""
from __future__ import annotations

import pickle

import numpy as np

import ringreduce as rr

from .basics import check_process_set, global_process_set
from .errors import raising_tf_errors
from .naming import collective_name
from .ops import refuse, run_collective


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


@raising_tf_errors
def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Root's obj on every rank of the set (any picklable object; the others'
    obj is ignored). root_rank is a world rank, a member of the set."""
    ps = check_process_set(process_set)
    label = collective_name("broadcast_object", name, ps)  # first: a refusal below keeps the numbering in step
    try:
        if root_rank not in ps.ranks:
            raise ValueError(f"root_rank {root_rank!r} is not a rank of {ps}")
        data = _dumps(obj) if rr.rank() == root_rank else np.zeros(0, dtype=np.uint8)
    except Exception as exc:  # unpicklable too: the others meet a refusal, not RINGREDUCE_TIMEOUT
        refuse(f"{label}.length", "broadcast", ps, exc)
        raise
    length = run_collective(f"{label}.length", np.array([data.size], dtype=np.int64), "broadcast", ps,
                            root=root_rank)
    if rr.rank() != root_rank:
        data = np.zeros(int(length[0]), dtype=np.uint8)
    return pickle.loads(run_collective(label, data, "broadcast", ps, root=root_rank).tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function obj -> broadcast_object(obj, root_rank, ...)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@raising_tf_errors
def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's obj (of the set), as a list in rank order."""
    ps = check_process_set(process_set)
    label = collective_name("allgather_object", name, ps)
    try:
        data = _dumps(obj)
    except Exception as exc:  # an unpicklable object: the others meet a refusal, not RINGREDUCE_TIMEOUT
        refuse(f"{label}.lengths", "allgather", ps, exc)
        raise
    lengths = run_collective(f"{label}.lengths", np.array([data.size], dtype=np.int64), "allgather", ps)
    gathered = run_collective(label, data, "allgather", ps).tobytes()
    ends = np.cumsum(lengths)
    return [pickle.loads(gathered[end - n:end]) for n, end in zip(lengths.tolist(), ends.tolist())]
