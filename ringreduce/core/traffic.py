"""How many bytes this rank has sent and received, counted in C where every
exchange passes (csrc/transport/transport.h), so compression savings are
measured, not worked out on paper.

    rr.reset_stats()
    ... train a step ...
    rr.stats()  # {'bytes_sent': ..., 'ring': ..., 'blobs': ..., 'alltoall': ...,
                #  'tcp': ..., 'shm': ..., 'cma': ..., 'arena': ..., 'mpi': ...,
                #  'bytes_received': ..., 'received_tcp': ..., ..., 'received_mpi': ...}

bytes_sent is everything this rank sent, on the world's ring and on every
process set's it belongs to, counted twice over: by what it was for, 'ring'
the data steps of allreduce, reduce_scatter, allgather and broadcast, 'blobs'
whole-frame exchanges (headers, the engine's negotiation, small allreduces),
'alltoall'; and by how it went, 'tcp' (a socket to the next rank), 'shm' (a
shared-memory link to the next rank, on one host), 'cma' (read by the next
rank straight out of this process, Cross Memory Attach, on one host), 'arena'
(written once into this rank's slot of the host arena, for every rank of the
host to read: on one host, headers and small allreduces), 'mpi' (MPI
point-to-point). Each set of keys sums to bytes_sent. bytes_received is
the others' data this rank took in, by the same ways ('received_tcp' ...):
on the ring what prev sent it (so over a job received sums to sent, rank by
rank), except the host arena, where one slot written (sent once) is read by
every other rank of the host (received by each). Headers and framing
are included; the control star's notices and the CMA path's tokens (a
64-byte control record per ring step) are not. A removed process set's bytes
keep counting until the next reset; shutdown() starts afresh.
"""
from __future__ import annotations

import threading

from .communicator import current as _state

KINDS = ("ring", "blobs", "alltoall")  # the order of _core.Comm.bytes()
VIAS = ("tcp", "shm", "cma", "arena", "mpi")  # the order of _core.Comm.bytes_via() and .bytes_received()
RECEIVED = tuple(f"received_{via}" for via in VIAS)
WIDTH = len(KINDS) + len(VIAS) + len(RECEIVED)  # the counts _counts() reads of one communicator

_lock = threading.Lock()
_baseline: dict[int, tuple[object, tuple]] = {}  # id(comm) -> (comm, its counts at the last reset)
# what removed process sets' rings sent since the last reset, and the world's
# communicator then: a new world (shutdown, init) starts afresh
_retired: dict = {"world": None, "counts": [0] * WIDTH}


def _comms(locked: bool = True) -> list:
    if locked:
        with _state.lock:
            return _state.comms()
    return _state.comms()  # the fields as they are now (it reads the sets in one tuple(), one step under the GIL)


def _counts(comm) -> tuple:
    """KINDS then VIAS (sent), then RECEIVED: what comm's transport has moved so far."""
    return tuple(comm.bytes()) + tuple(comm.bytes_via()) + tuple(comm.bytes_received())


def _since_reset(comm) -> tuple:
    now = _counts(comm)
    held = _baseline.get(id(comm))
    if held is None or held[0] is not comm:  # a communicator made since the last reset
        return now
    return tuple(max(0, a - b) for a, b in zip(now, held[1]))


def stats(reset: bool = False) -> dict:
    """Bytes this rank sent since init() or the last reset_stats(), by kind,
    by way (tcp, shm, cma, arena, mpi) and in all ('bytes_sent'); and
    received, by way ('received_tcp' ...) and in all ('bytes_received').
    reset=True starts counting afresh after reading."""
    return _stats(reset, _comms())  # before _lock: remove_process_set holds the state's lock when it calls retire()


def stats_now() -> dict:
    """stats() for an observer that must not wait (ringreduce.metrics' scrape):
    the communicator's lock is held for as long as init() connects or the
    engine's negotiation pass waits for a late peer, so the rings are listed
    without it. A process set added or removed at that very moment may be
    missed or counted twice in that one reading."""
    return _stats(False, _comms(locked=False))


def _stats(reset: bool, comms: list) -> dict:
    with _lock:
        counts = [_since_reset(comm) for comm in comms]
        if comms and _retired["world"] is comms[0]:
            counts.append(tuple(_retired["counts"]))
        out = {kind: sum(c[i] for c in counts) for i, kind in enumerate(KINDS)}
        out["bytes_sent"] = sum(out.values())
        out.update({via: sum(c[len(KINDS) + i] for c in counts) for i, via in enumerate(VIAS)})
        received = {key: sum(c[len(KINDS) + len(VIAS) + i] for c in counts) for i, key in enumerate(RECEIVED)}
        out["bytes_received"] = sum(received.values())
        out.update(received)
        if reset:
            _reset(comms)
        return out


def reset_stats() -> None:
    """Start counting bytes sent and received afresh (what stats() reports)."""
    comms = _comms()
    with _lock:
        _reset(comms)


def retire(comm) -> None:
    """A process set's ring is about to close (remove_process_set): what it
    sent since the last reset keeps counting until the next one."""
    with _lock:
        world = _state.comm
        if _retired["world"] is not world:
            _retired.update(world=world, counts=[0] * WIDTH)
        _retired["counts"] = [a + b for a, b in zip(_retired["counts"], _since_reset(comm))]
        _baseline.pop(id(comm), None)


def _reset(comms) -> None:
    _baseline.clear()
    _retired.update(world=None, counts=[0] * WIDTH)
    for comm in comms:
        _baseline[id(comm)] = (comm, _counts(comm))
