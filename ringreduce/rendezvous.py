"""The elastic rendezvous: ringrun holds it, workers come and go.

Under `ringrun --elastic` no rank is special: ringrun runs a RendezvousServer
and every worker keeps one authenticated connection to it (the job-secret
handshake of world.py). A worker registers with the port of a fresh ring
listener; the server forms a *generation* of the workers waiting, ranks
0..n-1 assigned densely (last generation's survivors first, in their old
order, then newcomers in the order they came), and sends each its rank,
size, local rank and size, the generation and the table of listening
addresses. The workers connect their ring (world.connect_subring: the hello
of every link carries the job and the generation, so no link of another
generation is ever taken), then say ready.

    worker -> server : {"register": worker id, "port": p, "host": host id, "commit": n}
    server -> worker : {"assign": {"rank", "size", "local_rank", "local_size",
                                   "generation", "table", "job", "ports"}}
    worker -> server : {"ready": generation}
    server -> worker : {"abort": generation}   a member left while it formed
    server -> worker : {"update": generation}  new workers wait: re-form at the next commit
    server -> worker : {"queued": generation}  (to a newcomer) a ring runs: wait for its next commit, untimed
    worker -> server : {"failed": text}        its training function raised (not a lost peer): ringrun ends the job
    worker -> server : {"committed": n}        its first commit (once per process): the job has trained

When a generation is formed:
  * at the start: once all `expected` workers registered (or, after
    `settle` seconds, at least min_np of them);
  * after a loss: once every member of the last generation that is still
    connected has registered again (each gets PeerLostError from its ring
    and comes back); a member whose connection closed is gone;
  * newcomers while a generation runs: its members are told ("update"), and
    ringreduce.elastic raises HostsUpdatedInterrupt on every rank at the
    next commit; they register again and the next generation has everyone.
A member that leaves (connection closed, or registers again) while its
generation is still connecting calls that generation off: the others are
told ("abort") and register again at once, instead of waiting for a peer
that will never dial. Below min_np the server waits; ringrun decides how
long (elastic_launcher.py).
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from . import world as _world
from .errors import RingReduceError

log = logging.getLogger("ringreduce")

class RendezvousLostError(RingReduceError):
    """This worker's connection to ringrun's rendezvous is gone (ringrun
    ended, or dropped this worker as too late to come back): no reset can
    help, so ringreduce.elastic.run lets it end the worker."""


MALFORMED = (ValueError, TypeError, AttributeError, KeyError)  # what a message that makes no sense raises
# how a connection ends when the worker's host, not the worker, went away (keepalive unanswered, no route)
CUT_OFF = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
ELASTIC_CONNECT_TIMEOUT = 30.0  # seconds a worker may take to connect its ring of one generation


# --------------------------------------------------------------------------- server (in ringrun)


@dataclass
class _Worker:
    id: str
    conn: socket.socket
    addr: str                      # the address the server saw it come from
    host: str = ""                 # its host identity, for local ranks
    port: int = 0                  # its ring listener for the generation it waits for
    state: str = "waiting"         # waiting | assigned (connecting) | member (ready)
    generation: int = -1           # the last generation it was given
    rank: int = -1
    since: float = field(default_factory=time.monotonic)
    buf: bytearray = field(default_factory=bytearray)


class RendezvousServer:
    """Forms generations of workers (see the module's docstring). Thread-safe
    getters for the launcher: `size()`, `generation`, `waiting()`."""

    def __init__(self, secret: bytes, expected: int, min_np: int = 1, max_np: int | None = None,
                 bind_host: str = "127.0.0.1", settle: float = 2.0, rejoin_timeout: float = 60.0):
        self.key = secret or _world.NO_SECRET_KEY
        self.expected, self.min_np, self.max_np = expected, min_np, max_np or 1 << 30
        self.settle, self.rejoin_timeout = settle, rejoin_timeout
        self.broken_since: float | None = None  # when a member of the running generation first came back
        self.listener = _world._listen(bind_host, 0)
        self.port = self.listener.getsockname()[1]
        self.acceptor = _world._Acceptor(self.listener, self.key, "ringrun's elastic rendezvous")
        self.workers: dict[str, _Worker] = {}
        self.generation = 0  # the last generation formed (0: none yet)
        self.forming = False  # its members are still connecting
        self.updates_sent: set = set()  # newcomer ids the members of this generation were told about
        self.first_seen: float | None = None
        self.lock = threading.Lock()
        self.closed = False
        self.events: list[str] = []  # what happened, for the launcher's log and the tests
        self.failures: dict[str, str] = {}  # worker id -> the exception its training function raised
        self.registered: set = set()  # ids of every worker that ever registered
        self.dropped: set = set()  # ids of the workers dropped, or whose host stopped answering
        self.committed = False  # some worker has committed (told us, or registered again with a commit)
        self.thread = threading.Thread(target=self._loop, name="ringreduce-rendezvous", daemon=True)
        self.thread.start()

    # -- for the launcher

    def size(self) -> int:
        """Members of the running generation (0 while none runs)."""
        with self.lock:
            return sum(1 for w in self.workers.values() if w.generation == self.generation and w.state == "member")

    def members(self) -> set:
        """Ids of the workers in the last generation formed."""
        with self.lock:
            return {w.id for w in self.workers.values()
                    if w.generation == self.generation and w.state in ("assigned", "member")}

    def joiners(self, ids) -> set:
        """Those of `ids` that wait to join a ring: registered and waiting for
        a generation (queued ones too), or not registered yet. A worker that
        registered and closed its connection since is not one: it has left
        (finished, or exiting) and is left to end by itself."""
        with self.lock:
            return {i for i in ids if (i in self.workers and self.workers[i].state == "waiting")
                    or i not in self.registered}

    def dropped_of(self, ids) -> set:
        """Those of `ids` cut off from the job: dropped by this server (too
        late to come back, or malformed), or whose host stopped answering
        (keepalive probes unanswered, no route), whether or not they noticed."""
        with self.lock:
            return set(ids) & self.dropped

    def has_committed(self) -> bool:
        """Whether any worker of this job has committed its state yet."""
        with self.lock:
            return self.committed

    def failure_of(self, wid: str, wait: float = 1.0) -> str | None:
        """The exception worker `wid` reported before it exited, if any; waits
        (up to `wait` s) for its connection's end, so a report still in
        flight is not missed."""
        deadline = time.monotonic() + wait
        while True:
            with self.lock:
                if wid in self.failures or wid not in self.workers or time.monotonic() > deadline:
                    return self.failures.get(wid)
            time.sleep(0.02)

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=2)
        self.acceptor.close()
        for w in list(self.workers.values()):
            w.conn.close()

    # -- the loop

    def _loop(self) -> None:
        """Sleeps in select() on the workers' connections (waking every 50 ms
        for new ones), or on the acceptor's queue while none is connected:
        a rendezvous with nobody to talk to takes no CPU."""
        while not self.closed:
            with self.lock:
                idle = not self.workers
            self._take_new(block=0.2 if idle else 0.0)
            with self.lock:
                conns = {w.conn.fileno(): w for w in self.workers.values()}
            if not conns:
                continue
            try:
                readable, _, _ = select.select(list(conns), [], [], 0.05)
            except (OSError, ValueError):
                readable = []
            for fd in readable:
                try:
                    self._read(conns[fd])
                except MALFORMED as exc:  # an authenticated peer that speaks nonsense: it goes, the job goes on
                    self._drop_malformed(conns[fd], exc)
            with self.lock:
                self._decide()

    def _take_new(self, block: float = 0.0) -> None:
        """Takes the connections the acceptor has checked; waits up to `block`
        seconds for the first."""
        while True:
            try:
                conn, peer, hello = self.acceptor.ready.get(timeout=block) if block else \
                    self.acceptor.ready.get_nowait()
            except queue.Empty:
                return
            block = 0.0
            wid = hello.get("register")
            if not isinstance(wid, str) or wid in self.workers:
                log.warning("ringreduce: rendezvous refused %s: bad or duplicate worker id %r", peer, wid)
                conn.close()
                continue
            conn.settimeout(5.0)
            _probe(conn, self.rejoin_timeout)
            w = _Worker(wid, conn, peer[0])
            with self.lock:
                self.workers[wid] = w
                self.registered.add(wid)
                self.first_seen = self.first_seen or time.monotonic()
                try:
                    self._register(w, hello)
                except MALFORMED as exc:
                    self._drop_malformed(w, exc, locked=True)

    def _drop_malformed(self, w: _Worker, exc: Exception, locked: bool = False) -> None:
        log.warning("ringreduce: rendezvous dropped worker %s: malformed message (%s)", w.id, exc)
        self.dropped.add(w.id)
        if locked:
            self._gone(w)
            return
        with self.lock:
            self._gone(w)

    def _read(self, w: _Worker) -> None:
        try:
            data = w.conn.recv(65536)
        except OSError as exc:
            with self.lock:
                if exc.errno in CUT_OFF:  # its host stopped answering: lost, though it may still run there
                    self.dropped.add(w.id)
                self._gone(w)  # else reset: a worker that exits with messages unread closes that way
            return
        if not data:  # the worker closed its end (it exits, or left the rendezvous)
            with self.lock:
                self._gone(w)
            return
        w.buf += data
        while len(w.buf) >= 4:
            n = int.from_bytes(w.buf[:4], "little")
            if n > _world.MAX_MESSAGE:
                raise ValueError(f"a message of {n} bytes is too large")
            if len(w.buf) < 4 + n:
                break
            msg = json.loads(bytes(w.buf[4:4 + n]))
            del w.buf[:4 + n]
            if not isinstance(msg, dict):
                raise ValueError("not a JSON object")
            with self.lock:
                if "register" in msg:
                    self._register(w, msg)
                elif "failed" in msg:
                    self.failures[w.id] = str(msg["failed"])[:500]
                    self.events.append(f"worker {w.id} failed: {self.failures[w.id]}")
                elif "committed" in msg:
                    if not self.committed:
                        self.events.append(f"worker {w.id} committed: the job has trained")
                    self.committed = True
                elif msg.get("ready") == w.generation and w.state == "assigned":
                    w.state = "member"
                    if not any(x.state == "assigned" for x in self.workers.values()):
                        self.forming = False
                        self.events.append(f"generation {self.generation} running with {self.size_locked()}")

    def size_locked(self) -> int:
        return sum(1 for w in self.workers.values() if w.generation == self.generation and w.state == "member")

    def _register(self, w: _Worker, msg: dict) -> None:
        left_forming = w.state in ("assigned", "member") and w.generation == self.generation and self.forming
        self.events.append(f"worker {w.id} registered")
        w.state, w.port, w.host = "waiting", int(msg.get("port", 0)), str(msg.get("host", ""))
        if int(msg.get("commit", 0)) > 0:
            self.committed = True
        w.since = time.monotonic()
        if left_forming:
            self._abort(f"worker {w.id} left while generation {self.generation} was connecting")

    def _gone(self, w: _Worker) -> None:
        self.workers.pop(w.id, None)
        w.conn.close()
        self.events.append(f"worker {w.id} gone (generation {w.generation}, {w.state})")
        if w.generation == self.generation and w.state in ("assigned", "member") and self.forming:
            self._abort(f"worker {w.id} was lost while generation {self.generation} was connecting")

    def _abort(self, why: str) -> None:
        """The forming generation is called off: its other members register again."""
        self.events.append(f"generation {self.generation} called off: {why}")
        for x in self.workers.values():
            if x.generation == self.generation and x.state == "assigned":
                self._send(x, {"abort": self.generation, "why": why})
                x.state = "member"  # counts as a member until it registers again
        self.forming = False

    def _send(self, w: _Worker, msg: dict) -> None:
        try:
            _world.send_msg(w.conn, msg)
        except OSError:
            pass  # its loss shows up as EOF on the next read

    def _decide(self) -> None:
        waiting = [w for w in self.workers.values() if w.state == "waiting"]
        if not waiting or self.forming:
            return
        in_generation = [w for w in self.workers.values()
                         if w.generation == self.generation and w.state in ("assigned", "member")]
        if in_generation:
            if any(w.generation == self.generation for w in waiting):
                # the generation broke: wait for every member still connected to come back, but not
                # for ever: one that stays away (stopped, hung) is dropped, and ends when it sees that
                self.broken_since = self.broken_since or time.monotonic()
                if time.monotonic() - self.broken_since < self.rejoin_timeout:
                    return
                for w in in_generation:
                    self.events.append(f"worker {w.id} did not come back within {self.rejoin_timeout:g} s: dropped")
                    log.warning("ringreduce: elastic: worker %s did not come back within %g s: dropped",
                                w.id, self.rejoin_timeout)
                    self.workers.pop(w.id, None)
                    self.dropped.add(w.id)
                    w.conn.close()
                self._decide()
                return
            fresh = [w for w in waiting if w.id not in self.updates_sent]
            if fresh and len(in_generation) < self.max_np:  # newcomers: the members re-form at their next commit
                self.updates_sent.update(w.id for w in fresh)
                for m in in_generation:
                    self._send(m, {"update": self.generation})
                for w in fresh:  # however long that takes: no start timeout for them
                    self._send(w, {"queued": self.generation})
            return
        if len(waiting) < self.min_np:
            return
        if self.generation == 0 and len(waiting) < self.expected and time.monotonic() - self.first_seen < self.settle:
            return
        self._form(waiting)

    def _form(self, waiting: list[_Worker]) -> None:
        last = self.generation
        waiting.sort(key=lambda w: (w.generation != last, w.rank if w.generation == last else 0, w.since))
        members = waiting[:self.max_np]
        self.generation += 1
        self.forming = True
        self.broken_since = None
        self.updates_sent = {w.id for w in waiting[self.max_np:]}  # no room for them: no update either
        for w in waiting[self.max_np:]:
            self._send(w, {"queued": self.generation})  # they wait for a place, as long as the job runs
        job = os.urandom(8).hex()
        table = [[w.addr, w.port] for w in members]
        hosts = [w.host for w in members]
        for rank, w in enumerate(members):
            w.state, w.generation, w.rank = "assigned", self.generation, rank
            self._send(w, {"assign": {"rank": rank, "size": len(members), "generation": self.generation,
                                      "local_rank": hosts[:rank].count(w.host), "local_size": hosts.count(w.host),
                                      "table": table, "ports": [m.port for m in members], "job": job}})
        self.events.append(f"generation {self.generation} formed: {[w.id for w in members]}")
        log.info("ringreduce: elastic generation %d: %d worker(s)", self.generation, len(members))


def _probe(conn: socket.socket, within: float) -> None:
    """TCP keepalive, a probe a second: a worker whose host stopped answering
    (link down, machine gone) reads as gone within about `within` seconds,
    so the survivors need not also wait rejoin_timeout for it. A worker that
    is merely slow or stopped still answers (its kernel does), and is judged
    by rejoin_timeout as before."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, math.ceil(within)))
    except (AttributeError, OSError):
        pass  # not Linux: rejoin_timeout alone judges


# --------------------------------------------------------------------------- client (in each worker)


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
        self.sock = _world._dial(self.addr, deadline, self.key, "ringrun's elastic rendezvous")
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
        alike before any commit ends instead (elastic_launcher.py)."""
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
