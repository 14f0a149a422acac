"""What an elastic job keeps across a reset, and how it is shared.

A State is committed (kept in memory) every few steps; on a lost peer every
survivor rolls back to its last commit; after the ring is re-formed, every
rank takes the state of a rank holding the NEWEST commit (each rank counts
its commits; the first rank with the highest count broadcasts), so a step
that some survivors committed is never lost, and every rank, newcomers
too, ends the reset with bit-identical state. Horovod's names
(horovod/common/elastic.py), so elastic Horovod scripts move over.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np

from .. import collectives as _c
from .. import engine as _engine
from .. import rendezvous as _rendezvous


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by commit() on every rank alike when workers wait to join: the
    state was just committed, so run() re-forms the ring without rolling back."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("workers are waiting to join: re-forming the ring")
        self.skip_sync = skip_sync


def broadcast_object(obj, root: int = 0, name: str = "elastic.object"):
    """root's obj on every rank (pickled, sent as bytes)."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if _c.rank() == root else np.zeros(0, np.uint8)
    n = int(_c.broadcast(np.array([data.size], np.int64), root=root, name=f"{name}.size")[0])
    buf = data if _c.rank() == root else np.zeros(n, np.uint8)
    return pickle.loads(_c.broadcast(buf, root=root, name=name).tobytes())


def newest_commit_root(commits: int) -> tuple[int, int]:
    """(rank, count): the first rank holding the highest commit count."""
    counts = _c.allgather(np.array([commits], np.int64), name="elastic.commits")
    return int(np.argmax(counts)), int(counts.max())


class State:
    """Subclasses say how to save, restore and sync their values."""

    def __init__(self):
        self._reset_callbacks: list = []
        self.commits = 0  # how many times this rank committed: the newest state wins a sync

    def register_reset_callbacks(self, callbacks) -> None:
        """Called after every reset, once the new world is up (e.g. to scale
        the learning rate by the new size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keeps the state as it is now; then raises HostsUpdatedInterrupt on
        every rank if workers wait to join (check_host_updates)."""
        self.save()
        self.commits += 1
        _rendezvous.commit_counter = self.commits
        client = _rendezvous.client()
        if client is not None:
            client.report_commit(self.commits)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank alike when ringrun said
        new workers wait. The ranks agree first (a one-number allreduce), as
        the news may reach them at different moments."""
        client = _rendezvous.client()
        if client is None or not _c.is_initialized():
            return
        flag = np.array([int(client.poll_update())], np.int32)
        if _engine._engine is not None:  # by name through the running engine: no pass of its can meet this one
            waiting = _engine.engine().wait(_engine.engine().enqueue("elastic.host_updates", flag, op="max"))
        else:
            waiting = _c.allreduce(flag, op="max", name="elastic.host_updates")
        if waiting[0]:
            raise HostsUpdatedInterrupt()

    def sync(self) -> None:
        """Every rank takes the state of a rank holding the newest commit."""
        if not _c.is_initialized() or _c.size() == 1:
            return
        root, newest = newest_commit_root(self.commits)
        self._sync_from(root)
        self.commits = newest
        _rendezvous.commit_counter = newest
        self.save()  # a loss before the first commit of this world rolls back to what was synced

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def _sync_from(self, root: int) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Any picklable values, as attributes: `state = ObjectState(epoch=0, w=w)`,
    then `state.epoch += 1; state.commit()`."""

    def __init__(self, **kwargs):
        self._values = list(kwargs)
        self.__dict__.update(kwargs)
        super().__init__()
        self._saved = {}
        self.save()

    def _current(self) -> dict:
        return {k: getattr(self, k) for k in self._values}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._current())

    def restore(self) -> None:
        self.__dict__.update(copy.deepcopy(self._saved))

    def _sync_from(self, root: int) -> None:
        self.__dict__.update(broadcast_object(self._current(), root, "elastic.object_state"))
