"""A worker's side of ringrun's elastic rendezvous (the server and its
protocol: ringreduce/launch/rendezvous_server.py). Under `ringrun --elastic`
init() joins through here instead of world.connect_ring: the worker
registers with a fresh ring listener, waits for a generation (its rank, size
and the table of listening addresses) and connects that generation's ring.
The connection stays open for the process's life: ringreduce.elastic reads
its news (update, abort) and reports a failed training function on it."""
from __future__ import annotations

import logging
import os
import select
import socket
import time

from ..errors import RingReduceError
from . import world as _world

log = logging.getLogger("ringreduce")


class RendezvousLostError(RingReduceError):
    """This worker's connection to ringrun's rendezvous is gone (ringrun
    ended, or dropped this worker as too late to come back): no reset can
    help, so ringreduce.elastic.run lets it end the worker."""


ELASTIC_CONNECT_TIMEOUT = 30.0  # seconds a worker may take to connect its ring of one generation


class _Client:
    """A worker's connection to the rendezvous, kept for the whole process."""

    def __init__(self, world: _world.World):
        self.addr, self.key, self.worker = world.addr, world.secret or _world.NO_SECRET_KEY, world.extra["worker"]
        self.sock: socket.socket | None = None
        self.update_pending = False
        self.generation = 0  # the last generation this worker was given
        self.pid = os.getpid()
        self.told_commit = False  # report_commit sent

    def _connect(self, port: int, host: str, commit: int, deadline: float) -> None:
        self.sock = _world.dial(self.addr, deadline, self.key, "ringrun's elastic rendezvous")
        _world.send_msg(self.sock, {"register": self.worker, "port": port, "host": host, "commit": commit})

    def register(self, port: int, host: str, commit: int, deadline: float) -> None:
        self.update_pending = False
        if self.sock is None:
            self._connect(port, host, commit, deadline)
            return
        try:
            _world.send_msg(self.sock, {"register": self.worker, "port": port, "host": host, "commit": commit})
        except OSError as exc:
            raise RendezvousLostError(f"worker {self.worker}: lost the connection to ringrun's elastic "
                                      f"rendezvous ({exc}): ringrun is gone or dropped this worker") from exc

    def next_message(self, timeout: float | None):
        """The next message from the server (None if none within timeout)."""
        if timeout is not None:
            r, _, _ = select.select([self.sock], [], [], timeout)
            if not r:
                return None
        self.sock.settimeout(None)
        try:
            msg = _world.recv_msg(self.sock)
        except (OSError, ConnectionError, ValueError) as exc:
            raise RendezvousLostError(f"worker {self.worker}: lost the connection to ringrun's elastic "
                                      f"rendezvous ({exc}): ringrun is gone or dropped this worker") from exc
        if msg.get("update") == self.generation:  # an older one was for a ring already left
            self.update_pending = True
        return msg

    def poll_update(self) -> bool:
        """Whether the server said new workers wait (a cheap, non-blocking look)."""
        while self.sock is not None and self.next_message(0) is not None:
            pass
        return self.update_pending

    def aborted(self, generation: int):
        """connect_subring's `cancelled`: the reason, if the server called this generation off."""
        while True:
            msg = self.next_message(0)
            if msg is None:
                return None
            if msg.get("abort") == generation:
                return f"generation {generation} was called off ({msg.get('why')})"

    def report_commit(self, commits: int) -> None:
        """Tells ringrun this worker committed (its first commit only): a job
        that has trained restarts lost workers; one whose every worker failed
        alike before any commit ends instead (ringreduce/launch/elastic_launcher.py)."""
        if self.told_commit or self.sock is None:
            return
        self.told_commit = True
        try:
            _world.send_msg(self.sock, {"committed": commits})
        except OSError:
            pass  # its loss shows on the next read

    def report_failure(self, text: str) -> None:
        """Tells ringrun the training function raised: the job ends, nothing is restarted."""
        if self.sock is not None:
            try:
                _world.send_msg(self.sock, {"failed": text})
            except OSError:
                pass  # ringrun is gone anyway

    def ready(self, generation: int) -> None:
        _world.send_msg(self.sock, {"ready": generation})


_client: _Client | None = None
commit_counter = 0  # set by ringreduce.elastic: this worker's newest commit, sent when registering


def client() -> _Client | None:
    return _client


def join(world: _world.World) -> _world.Links:
    """Registers with ringrun's rendezvous, waits for a generation and
    connects its ring; fills world's rank, size, local rank/size and
    extra["generation"]. Tries again when a generation is called off."""
    global _client
    if _client is None or _client.pid != os.getpid():
        _client = _Client(world)
    c = _client
    deadline = time.monotonic() + world.config.start_timeout
    host = f"{socket.gethostname()}/{_netns()}"
    while True:
        listener = _world.open_subring_listener(world)
        try:
            c.register(listener.port, host, commit_counter, deadline)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingReduceError(f"worker {c.worker}: no elastic generation formed within "
                                          f"{world.config.start_timeout:.0f} s (RINGREDUCE_START_TIMEOUT)")
                msg = c.next_message(min(left, 1.0))
                if msg is not None and "assign" in msg:
                    break
                if msg is not None and "queued" in msg:
                    # a ring runs and lets this worker in at its next commit, however far off:
                    # it waits as long as the job does (ringrun stops it when training ends)
                    deadline = float("inf")
        except BaseException:
            listener.close()
            raise
        a = msg["assign"]
        c.generation = a["generation"]
        world.rank, world.size = a["rank"], a["size"]
        world.local_rank, world.local_size = a["local_rank"], a["local_size"]
        world.extra.update(generation=a["generation"], table=a["table"], job=a["job"])
        try:
            links = _world.connect_subring(world, listener, a["rank"], list(range(a["size"])), a["ports"],
                                           f"generation {a['generation']}", a["generation"],
                                           timeout=min(world.config.start_timeout, ELASTIC_CONNECT_TIMEOUT),
                                           cancelled=lambda: c.aborted(a["generation"]))
        except RingReduceError as exc:
            log.info("ringreduce: worker %s: generation %d did not connect (%s); registering again",
                     c.worker, a["generation"], exc)
            continue
        c.ready(a["generation"])
        return links


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
