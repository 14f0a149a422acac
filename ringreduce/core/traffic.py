"""How many bytes this rank has sent, counted in C where every exchange
passes (csrc/transport/transport.h), so compression savings are measured, not worked
out on paper.

    rr.reset_stats()
    ... train a step ...
    rr.stats()  # {'bytes_sent': ..., 'ring': ..., 'blobs': ..., 'alltoall': ...}

bytes_sent is everything this rank sent to its ring neighbours, on the
world's ring and on every process set's it belongs to: 'ring' the data steps
of allreduce, reduce_scatter, allgather and broadcast; 'blobs' whole-frame
exchanges (the engine's negotiation and small allreduces); 'alltoall'.
Headers and framing are included; the control star's notices are not. A
removed process set's bytes keep counting until the next reset; shutdown()
starts afresh.
"""
from __future__ import annotations

import threading

from .communicator import current as _state

KINDS = ("ring", "blobs", "alltoall")  # the order of _core.Comm.bytes()

_lock = threading.Lock()
_baseline: dict[int, tuple[object, tuple]] = {}  # id(comm) -> (comm, its counts at the last reset)
# what removed process sets' rings sent since the last reset, and the world's
# communicator then: a new world (shutdown, init) starts afresh
_retired: dict = {"world": None, "counts": [0] * len(KINDS)}


def _comms() -> list:
    with _state.lock:
        comms = [_state.comm, *(ring.comm for ring in _state.sets.values())]
    return [comm for comm in comms if comm is not None]


def _since_reset(comm) -> tuple:
    now = comm.bytes()
    held = _baseline.get(id(comm))
    if held is None or held[0] is not comm:  # a communicator made since the last reset
        return now
    return tuple(max(0, a - b) for a, b in zip(now, held[1]))


def stats(reset: bool = False) -> dict:
    """Bytes this rank sent since init() or the last reset_stats(), by kind
    and in all ('bytes_sent'). reset=True starts counting afresh after reading."""
    comms = _comms()  # before _lock: remove_process_set holds the state's lock when it calls retire()
    with _lock:
        counts = [_since_reset(comm) for comm in comms]
        if comms and _retired["world"] is comms[0]:
            counts.append(tuple(_retired["counts"]))
        out = {kind: sum(c[i] for c in counts) for i, kind in enumerate(KINDS)}
        out["bytes_sent"] = sum(out.values())
        if reset:
            _reset(comms)
        return out


def reset_stats() -> None:
    """Start counting bytes sent afresh (what stats() reports)."""
    comms = _comms()
    with _lock:
        _reset(comms)


def retire(comm) -> None:
    """A process set's ring is about to close (remove_process_set): what it
    sent since the last reset keeps counting until the next one."""
    with _lock:
        world = _state.comm
        if _retired["world"] is not world:
            _retired.update(world=world, counts=[0] * len(KINDS))
        _retired["counts"] = [a + b for a, b in zip(_retired["counts"], _since_reset(comm))]
        _baseline.pop(id(comm), None)


def _reset(comms) -> None:
    _baseline.clear()
    _retired.update(world=None, counts=[0] * len(KINDS))
    for comm in comms:
        _baseline[id(comm)] = (comm, comm.bytes())
