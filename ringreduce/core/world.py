"""Who am I, and who are my ring neighbours.

discover() reads the world from the environment, in this order:
  0. RINGREDUCE_ELASTIC_ADDR (ringrun --elastic): rank and size come from
     ringrun's rendezvous at every (re)join (rendezvous_client.py)
  1. RINGREDUCE_RANK / RINGREDUCE_SIZE / RINGREDUCE_ADDR (set by ringrun, or by hand)
  2. mpirun: Open MPI's OMPI_COMM_WORLD_*, MPICH/Hydra's PMI_* (with the TCP
     backend, rank 0's address and the job secret then travel over MPI)
  3. TensorFlow's TF_CONFIG (the ring is the chief, then the workers in order)
  3b. srun without PMI: Slurm's SLURM_PROCID, SLURM_STEP_* (slurm.py; a batch
     script or salloc's shell, not being an srun step, is a world of one)
  4. a Kubeflow PyTorchJob or TrainJob pod's MASTER_ADDR/RANK/WORLD_SIZE or
     PET_* (kubernetes.py: one process per pod; ringrun -np L in each pod
     gives RINGREDUCE_* instead, step 1), unless RINGREDUCE_* is half-set;
     not where torchrun started the process (LOCAL_RANK, TORCHELASTIC_*):
     that stays refused below
  5. none of these: a world of one rank (but RINGREDUCE_SIZE/ADDR without
     RINGREDUCE_RANK, srun's tasks whose step cannot be read, or horovodrun's
     (gloo) or torchrun's world of N, raise: N ranks were meant)

connect_ring() then connects the ring: every rank dials rank 0 at
RINGREDUCE_ADDR and gets everyone's listening address back, connects to its
next neighbour and accepts its previous one. Every connection first proves it
belongs to the job (see `handshake`); strays are logged and dropped. The
connections to rank 0 stay open as the control star that spreads failure
notices (csrc/transport/tcp.c).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import random
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from . import kubernetes, shm, slurm
from .config import Config, env_int
from ..errors import RingReduceError

log = logging.getLogger("ringreduce")

MAGIC = b"RRHS1"
NONCE = 32
SOCKET_BUFFER = 4 << 20
HANDSHAKE_TIMEOUT = 10.0
MAX_UNPROVEN = 32               # connections in their handshake at once, per listener
ACCEPT_BACKOFF = (0.01, 0.5)    # seconds between tries after accept() fails, growing
MAX_MESSAGE = 1 << 20
NO_SECRET_KEY = b"ringreduce: loopback only, no job secret"


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    addr: tuple[str, int] | None = None
    secret: bytes | None = None
    config: Config = field(default_factory=Config)
    source: str = "single process"
    extra: dict = field(default_factory=dict)


# Other launchers' worlds, which ringreduce does not join: (what started this
# process, its size variable, a variable only that launcher sets).
_FOREIGN_LAUNCHERS = (("horovodrun", "HOROVOD_SIZE", "HOROVOD_RANK"),
                      ("torchrun", "WORLD_SIZE", "MASTER_ADDR"))


def _parse_addr(text: str, name: str = "RINGREDUCE_ADDR") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise RingReduceError(f"{name} must be host:port, got {text!r}")
    if not 0 < int(port) < 65536:  # 0 would have rank 0 listen where no rank looks
        raise RingReduceError(f"{name} must be host:port with a port of 1 .. 65535, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def discover(env=None) -> World:
    env = os.environ if env is None else env
    config = Config.from_env(env)
    secret = env.get("RINGREDUCE_SECRET") or None
    secret_bytes = secret.encode() if secret else None

    if env.get("RINGREDUCE_ELASTIC_ADDR"):  # ringrun --elastic: rank and size come from its rendezvous
        return World(0, 1, 0, 1, _parse_addr(env["RINGREDUCE_ELASTIC_ADDR"], "RINGREDUCE_ELASTIC_ADDR"), secret_bytes,
                     config, "elastic",
                     {"worker": env.get("RINGREDUCE_WORKER_ID") or f"{socket.gethostname()}:{os.getpid()}"})

    rank = env_int(env, "RINGREDUCE_RANK")
    if rank is not None:
        size = env_int(env, "RINGREDUCE_SIZE")
        if size is None or not 0 <= rank < size:
            raise RingReduceError(f"RINGREDUCE_RANK={rank} needs RINGREDUCE_SIZE > rank")
        addr = env.get("RINGREDUCE_ADDR")
        if size > 1 and not addr:
            raise RingReduceError("RINGREDUCE_SIZE > 1 needs RINGREDUCE_ADDR=host:port of rank 0")
        local_rank = env_int(env, "RINGREDUCE_LOCAL_RANK")
        local_size = env_int(env, "RINGREDUCE_LOCAL_SIZE")
        given = local_rank is not None
        local_rank, local_size = rank if local_rank is None else local_rank, size if local_size is None else local_size
        if given and not 0 <= local_rank < local_size:  # a GPU is picked by it (ringreduce/tensorflow)
            raise RingReduceError(f"RINGREDUCE_LOCAL_RANK={local_rank} needs 0 <= RINGREDUCE_LOCAL_RANK < "
                                  f"RINGREDUCE_LOCAL_SIZE={local_size}")
        return World(rank, size, local_rank, local_size,
                     _parse_addr(addr) if addr else None, secret_bytes, config, "RINGREDUCE_* environment")

    mpi_rank = env_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if mpi_rank is not None:
        size = env_int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS") or 1  # srun --mpi=pmix
        local_rank = env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
        local_size = env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
        return World(mpi_rank, size, mpi_rank if local_rank is None else local_rank,
                     size if local_size is None else local_size, None, secret_bytes, config, "mpirun")

    if env.get("TF_CONFIG"):
        return _from_tf_config(json.loads(env["TF_CONFIG"]), secret_bytes, config)
    if (step := slurm.step_world(env, secret_bytes, _parse_addr)) is not None:  # srun without PMI: slurm.py
        return World(**step, config=config, source="srun")
    half = [n for n in ("RINGREDUCE_SIZE", "RINGREDUCE_ADDR", "RINGREDUCE_LOCAL_RANK", "RINGREDUCE_LOCAL_SIZE")
            if env.get(n, "") != ""]
    if half:  # a world of N was meant: each process training alone would be silently wrong
        raise RingReduceError(f"{', '.join(f'{n}={env[n]}' for n in half)} is set but RINGREDUCE_RANK is not: "
                              "set RINGREDUCE_RANK on every rank too, or launch with ringrun -np N")
    pod = kubernetes.lone_process(env)  # a PyTorchJob or TrainJob pod's one process (not torchrun's)
    if pod is not None:
        return World(pod.node_rank, pod.nnodes, 0, 1, None if pod.port is None else (pod.host, pod.port),
                     secret_bytes, config,
                     f"{pod.operator} pod")
    for launcher, size_name, marker in _FOREIGN_LAUNCHERS:  # each process training alone would be silently wrong
        size = env_int(env, size_name) if env.get(marker, "") != "" else None
        if size is not None and size > 1:
            raise RingReduceError(f"{launcher} started {size} processes ({size_name}={size}) but none of them has a "
                                  f"ringreduce world: launch with ringrun -np {size} instead (or set "
                                  "RINGREDUCE_RANK, RINGREDUCE_SIZE and RINGREDUCE_ADDR on every rank)")
    return World(config=config)


def _from_tf_config(cfg: dict, secret: bytes | None, config: Config) -> World:
    cluster = cfg.get("cluster", {})
    members = [("chief", i, a) for i, a in enumerate(cluster.get("chief", []))]
    members += [("worker", i, a) for i, a in enumerate(cluster.get("worker", []))]
    task = cfg.get("task", {})
    me = (task.get("type"), int(task.get("index", 0)))
    ranks = [(t, i) for t, i, _ in members]
    if me not in ranks:
        raise RingReduceError(f"TF_CONFIG task {me} is not a chief or worker of its cluster")
    rank = ranks.index(me)
    hosts = [_parse_addr(a)[0] for _, _, a in members]
    local_rank = hosts[:rank].count(hosts[rank])
    return World(rank, len(members), local_rank, hosts.count(hosts[rank]), _parse_addr(members[0][2]),
                 secret, config, "TF_CONFIG")


def free_port(host: str = "") -> int:
    """A port free now for rank 0's rendezvous, picked below the kernel's
    ephemeral range, so no rank's own ring listener can be handed it first."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low // 2), max(1025, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # every pick taken: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# The handshake: a mutual challenge-response keyed by the job secret.
#
#   acceptor -> dialer : MAGIC, nonce_a
#   dialer -> acceptor : MAGIC, nonce_d, HMAC(key, "dial" | nonce_a | nonce_d)
#   acceptor -> dialer : HMAC(key, "accept" | nonce_d | nonce_a)
#
# then length-prefixed JSON messages. Neither side ever sees the secret on
# the wire, and a replayed answer fails against a fresh nonce.


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """n bytes; with a deadline, all of them by then (a peer that trickles
    one byte at a time cannot stretch the socket's per-call timeout)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError("timed out during the handshake")
            sock.settimeout(left)
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("connection closed during the handshake")
        buf += part
    return bytes(buf)


def send_msg(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_msg(sock: socket.socket, deadline: float | None = None):
    (n,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"message of {n} bytes is too large")
    return json.loads(_recv_exact(sock, n, deadline))


def accept_handshake(sock: socket.socket, key: bytes, deadline: float | None = None) -> None:
    nonce_a = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_a)
    hello = _recv_exact(sock, len(MAGIC) + NONCE + 32, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise ConnectionError("not a ringreduce handshake")
    nonce_d, proof = hello[len(MAGIC):len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"dial", nonce_a, nonce_d)):
        raise ConnectionError("wrong job secret")
    sock.sendall(_mac(key, b"accept", nonce_d, nonce_a))


def dial_handshake(sock: socket.socket, key: bytes, peer: str) -> None:
    try:
        head = _recv_exact(sock, len(MAGIC) + NONCE)
        if head[:len(MAGIC)] != MAGIC:
            raise ConnectionError("not a ringreduce peer")
        nonce_a, nonce_d = head[len(MAGIC):], secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + nonce_d + _mac(key, b"dial", nonce_a, nonce_d))
        answer = _recv_exact(sock, 32)
    except (OSError, ConnectionError) as exc:
        raise RingReduceError(f"handshake with {peer} failed ({exc}): is RINGREDUCE_SECRET the same on every rank?") from exc
    if not hmac.compare_digest(answer, _mac(key, b"accept", nonce_d, nonce_a)):
        raise RingReduceError(f"{peer} answered the handshake with a wrong proof: not our job (RINGREDUCE_SECRET differs)")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(s)  # accepted sockets inherit the buffer sizes
    s.bind((host, port))
    s.listen(64)
    return s


class Acceptor:
    """Accepts on a listener; each connection is checked on its own thread, so
    a stray that connects and says nothing delays no one. `expect(check)`
    returns the first connection whose hello passes `check`.

    Strays never stop it: it keeps accepting through any accept() error
    (out of descriptors, an aborted connection), backing off; at most
    MAX_UNPROVEN connections (and threads) wait in their handshake at once,
    the oldest dropped for a newer one (a real rank proves itself in
    milliseconds); and each must finish within HANDSHAKE_TIMEOUT overall."""

    def __init__(self, listener: socket.socket, key: bytes, who: str):
        self.listener, self.key, self.who = listener, key, who
        self.port = listener.getsockname()[1]
        self.ready: queue.Queue = queue.Queue()
        self.closed = False
        self.unproven: dict = {}  # connection -> peer, oldest first
        self.lock = threading.Lock()
        listener.settimeout(0.2)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        backoff = ACCEPT_BACKOFF[0]
        while not self.closed:
            try:
                conn, peer = self.listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self.closed:
                    return
                if backoff == ACCEPT_BACKOFF[0]:
                    log.warning("ringreduce: %s cannot accept a connection (%s): dropping the oldest "
                                "unproven one and retrying", self.who, exc)
                self._drop_oldest()  # frees a descriptor if that was the trouble
                time.sleep(backoff)
                backoff = min(backoff * 2, ACCEPT_BACKOFF[1])
                continue
            backoff = ACCEPT_BACKOFF[0]
            with self.lock:
                crowded = len(self.unproven) >= MAX_UNPROVEN
                self.unproven[conn] = peer
            if crowded:
                self._drop_oldest()
            threading.Thread(target=self._check, args=(conn, peer), daemon=True).start()

    def _drop_oldest(self, why: str = "too many at once"):
        with self.lock:
            if not self.unproven:
                return
            conn = next(iter(self.unproven))
            peer = self.unproven.pop(conn)
        log.warning("ringreduce: %s dropped a connection from %s that had not proven itself yet (%s)",
                    self.who, _fmt(peer), why)
        try:
            conn.shutdown(socket.SHUT_RDWR)  # its checking thread wakes, fails and closes it
        except OSError:
            pass

    def _check(self, conn: socket.socket, peer):
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        try:
            accept_handshake(conn, self.key, deadline)
            hello = recv_msg(conn, deadline)
            if not isinstance(hello, dict):
                raise ConnectionError("malformed hello")
            with self.lock:
                dropped = self.unproven.pop(conn, None) is None
            if dropped:
                raise ConnectionError("dropped while proving itself")
            self.ready.put((conn, peer, hello))
        except (OSError, ConnectionError, ValueError) as exc:
            with self.lock:
                self.unproven.pop(conn, None)
            log.warning("ringreduce: %s refused a connection from %s: %s", self.who, _fmt(peer), exc)
            conn.close()

    def expect(self, check, deadline: float, what: str, cancelled=None):
        """cancelled: asked every 50 ms; a true answer is raised as the reason
        (an elastic rendezvous whose generation was called off)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingReduceError(f"{self.who}: timed out waiting for {what}")
            _check_cancelled(cancelled)
            try:
                conn, peer, hello = self.ready.get(timeout=min(left, 1.0 if cancelled is None else 0.05))
            except queue.Empty:
                continue
            problem = check(hello)
            if problem is None:
                return conn, hello
            log.warning("ringreduce: %s refused a connection from %s: %s", self.who, _fmt(peer), problem)
            try:
                send_msg(conn, {"error": problem})
            except OSError:
                pass
            conn.close()

    def close(self):
        # A thread blocked in accept() keeps the port listening after close();
        # wake it and wait, so the port is free the moment this returns.
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(timeout=1.0)
        self.listener.close()
        while self.unproven:  # strays still in their handshake: free their descriptors now
            self._drop_oldest("no longer listening")


def _fmt(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _check_cancelled(cancelled) -> None:
    why = cancelled() if cancelled is not None else None
    if why:
        raise RingReduceError(why)


def dial(addr: tuple[str, int], deadline: float, key: bytes, peer: str, cancelled=None) -> socket.socket:
    """Connects (retrying while the peer is not up yet) and authenticates."""
    while True:
        _check_cancelled(cancelled)
        s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        _tune(s)
        s.settimeout(HANDSHAKE_TIMEOUT)
        try:
            s.connect(addr)
            break
        except OSError as exc:
            s.close()
            if time.monotonic() > deadline:
                raise RingReduceError(f"could not reach {peer} at {addr[0]}:{addr[1]}: {exc}") from exc
            time.sleep(0.05)
    dial_handshake(s, key, peer)
    return s


@dataclass
class Links:
    """The connected sockets a ring needs (file descriptors, owned by the caller)."""
    next_fd: int = -1
    prev_fd: int = -1
    ctrl_fds: list = field(default_factory=list)
    tx_shm_fd: int = -1  # the link to next carries its data through this shared file
    rx_shm_fd: int = -1  # likewise the link from prev

    def kinds(self) -> dict:
        """How each link moves its data: "shm" or "tcp"."""
        return {"next": "shm" if self.tx_shm_fd >= 0 else "tcp",
                "prev": "shm" if self.rx_shm_fd >= 0 else "tcp"}


def connect_ring(world: World) -> Links:
    """Connects this rank's ring links for a world whose ranks are known
    (rank 0 gathers every rank's ring listener and hands out the table).
    An elastic world's ranks come from ringrun instead: rendezvous_client.join."""
    if world.size == 1:
        return Links()
    key = world.secret or NO_SECRET_KEY
    host, port = world.addr
    if world.secret is None:
        log.warning("ringreduce: RINGREDUCE_SECRET is not set: listening on loopback only "
                    "(set it, as ringrun does, to run across hosts)")
    bind_host = _bind_host(world)
    deadline = time.monotonic() + world.config.start_timeout
    # Each rank opens its ring listener only once rank 0's listener holds the
    # rendezvous port: an ephemeral ring port can then never take that port.
    ring_listener = None
    try:
        if world.rank == 0:
            root_listener = _listen_for_rendezvous(bind_host, port)
            ring_listener = Acceptor(listen(bind_host, 0), key, f"rank {world.rank}")
            ctrl, table, job = _gather_at_root(world, key, root_listener, ring_listener.port, deadline)
        else:
            ctrl_sock = dial((host, port), deadline, key, "rank 0")
            ring_listener = Acceptor(listen(bind_host, 0), key, f"rank {world.rank}")
            send_msg(ctrl_sock, {"rank": world.rank, "size": world.size, "port": ring_listener.port})
            # The table comes once every rank has joined: wait for it as long as init may take.
            ctrl_sock.settimeout(max(deadline - time.monotonic(), 1.0))
            try:
                reply = recv_msg(ctrl_sock)
            except (OSError, ConnectionError) as exc:
                raise RingReduceError(f"rank {world.rank}: no table of ranks from rank 0 ({exc}); "
                                      "did every rank start?") from exc
            if "error" in reply:
                raise RingReduceError(f"rank 0 refused rank {world.rank}: {reply['error']}")
            table, job = reply["table"], reply["job"]
            ctrl = [ctrl_sock]
        world.extra["table"], world.extra["job"] = table, job  # process sets dial members there
        nxt, prv = (world.rank + 1) % world.size, (world.rank - 1) % world.size
        to_next = dial(tuple(table[nxt]), deadline, key, f"rank {nxt}")
        send_msg(to_next, {"rank": world.rank, "job": job, "ring": True})

        def is_prev(hello):
            if hello.get("job") != job or not hello.get("ring"):
                return "not from this job"
            return None if hello.get("rank") == prv else f"claims rank {hello.get('rank')}, expected {prv}"

        from_prev, _ = ring_listener.expect(is_prev, deadline, f"rank {prv} to connect")
        try:
            tx_shm, rx_shm = shm.connect(to_next, from_prev, f"{job}-{world.rank}", world.config.shm_bytes,
                                         send_msg, recv_msg)
        except (OSError, ConnectionError, ValueError) as exc:
            raise RingReduceError(f"rank {world.rank}: setting up the links to ranks {prv} and {nxt} "
                                  f"failed: {exc}") from exc
    finally:
        if ring_listener is not None:
            ring_listener.close()
    return _links(to_next, from_prev, ctrl, tx_shm, rx_shm)


def _bind_host(world: World) -> str:
    """Without a secret, ranks listen on loopback only."""
    if world.secret is None:
        return "127.0.0.1"
    return "::" if ":" in world.addr[0] else "0.0.0.0"


def _links(to_next, from_prev, ctrl, tx_shm: int, rx_shm: int) -> Links:
    """The connected sockets, blocking and without delay, as descriptors."""
    try:
        for s in [to_next, from_prev, *ctrl]:
            if s is not None:
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        for fd in (tx_shm, rx_shm):  # plain descriptors: no garbage collector closes them
            if fd >= 0:
                os.close(fd)
        raise
    return Links(to_next.detach(), from_prev.detach(), [s.detach() if s is not None else -1 for s in ctrl],
                 tx_shm, rx_shm)


# ---------------------------------------------------------------------------
# Sub-rings: a process set's own ring among some of the world's ranks
# (ringreduce/core/process_sets.py). Each member opens a listener first; the world
# then shares the ports (a collective on the world's ring); then every member
# dials its next member and accepts its previous one, and the set's first
# member plays rank 0 of the set's control star. Same handshake, same shared
# memory agreement as the world's ring.


def open_subring_listener(world: World):
    """A member's listener for its set's ring, open before the ports are shared."""
    return Acceptor(listen(_bind_host(world), 0), world.secret or NO_SECRET_KEY, f"rank {world.rank}")


def connect_subring(world: World, listener, me: int, members: list, ports: list, label: str,
                    generation: int, timeout: float | None = None, cancelled=None) -> Links:
    """Connects the ring of a process set: members[i] (a world rank) is the
    set's rank i and listens at ports[i]; this process is the set's rank
    `me`. Every hello carries the job, the set's label and the generation
    (how many sets the world has added), so no connection of another set, or
    of an earlier one with the same id, is taken. Closes the listener.
    timeout (default RINGREDUCE_START_TIMEOUT) bounds the whole connection;
    cancelled() is asked while waiting: a true answer (the reason) stops it
    with RingReduceError (the elastic rendezvous, rendezvous_client.py)."""
    k = len(members)
    try:
        if k == 1:
            return Links()
        key = world.secret or NO_SECRET_KEY
        table = world.extra["table"]
        tag = f"{world.extra['job']}/{label}/{generation}"
        deadline = time.monotonic() + (world.config.start_timeout if timeout is None else timeout)
        addr = [(table[w][0], p) for w, p in zip(members, ports)]
        name = [f"rank {w} (rank {i} of {label})" for i, w in enumerate(members)]
        nxt, prv = (me + 1) % k, (me - 1) % k
        ctrl: list = [None] * k if me == 0 else []
        to_next = from_prev = None
        opened: list = []
        try:
            if me != 0:
                ctrl.append(dial(addr[0], deadline, key, name[0], cancelled))
                opened.append(ctrl[0])
                send_msg(ctrl[0], {"rank": me, "job": tag, "ctrl": True})
            to_next = dial(addr[nxt], deadline, key, name[nxt], cancelled)
            opened.append(to_next)
            send_msg(to_next, {"rank": me, "job": tag, "ring": True})

            def check(hello):
                r = hello.get("rank")
                if hello.get("job") != tag:
                    return f"not from {label} of this job"
                if hello.get("ring"):
                    if r == prv and from_prev is None:
                        return None
                    return f"claims rank {r!r} of {label}, expected {prv}"  # the set's numbering, as the log says
                if hello.get("ctrl") and me == 0 and isinstance(r, int) and 0 < r < k and ctrl[r] is None:
                    return None
                return f"unexpected hello from rank {r!r} of {label}"
            for _ in range(1 + (k - 1 if me == 0 else 0)):  # prev; on the first member, every control link
                conn, hello = listener.expect(check, deadline, f"the members of {label} to connect", cancelled)
                opened.append(conn)
                if hello.get("ring"):
                    from_prev = conn
                else:
                    ctrl[hello["rank"]] = conn
            tx_shm, rx_shm = shm.connect(to_next, from_prev, f"{tag.replace('/', '-').replace(' ', '')}-{me}",
                                         world.config.shm_bytes, send_msg, recv_msg)
        except BaseException:
            for s in opened:
                s.close()
            raise
    except (OSError, ConnectionError, ValueError) as exc:
        raise RingReduceError(f"rank {world.rank}: connecting the ring of {label} failed: {exc}") from exc
    finally:
        listener.close()
    return _links(to_next, from_prev, ctrl, tx_shm, rx_shm)


def _listen_for_rendezvous(bind_host: str, port: int) -> socket.socket:
    try:
        return listen(bind_host, port)
    except OSError as exc:
        raise RingReduceError(f"rank 0 cannot listen on {bind_host}:{port} (RINGREDUCE_ADDR): {exc}") from exc


def _gather_at_root(world: World, key: bytes, listener: socket.socket, my_port: int, deadline: float):
    """Rank 0 collects every rank's listening address and sends the table back."""
    acceptor = Acceptor(listener, key, "rank 0")
    ctrl: list = [None] * world.size
    table: list = [None] * world.size
    table[0] = [world.addr[0] if world.addr[0] not in ("", "0.0.0.0") else "127.0.0.1", my_port]
    try:
        for _ in range(world.size - 1):
            def check(hello):
                r = hello.get("rank")
                if hello.get("size") != world.size:
                    return f"world size {hello.get('size')} differs from rank 0's {world.size}"
                if not isinstance(r, int) or not 0 < r < world.size:
                    return f"rank {r!r} is out of range"
                if ctrl[r] is not None:
                    return f"rank {r} has already joined"
                return None
            try:
                conn, hello = acceptor.expect(check, deadline, "every rank to join")
            except RingReduceError as exc:  # the timeout: say who is missing, and the setting that waited
                missing = ", ".join(str(r) for r in range(1, world.size) if ctrl[r] is None)
                raise RingReduceError(
                    f"{exc}: rank(s) {missing} of {world.size} never joined within RINGREDUCE_START_TIMEOUT="
                    f"{world.config.start_timeout:g} s; start every rank with the same world size and rank 0's "
                    f"address (port {listener.getsockname()[1]}), or raise RINGREDUCE_START_TIMEOUT") from None
            r = hello["rank"]
            ctrl[r] = conn
            table[r] = [conn.getpeername()[0], hello["port"]]
    except BaseException:
        for c in ctrl:
            if c is not None:
                c.close()
        raise
    finally:
        acceptor.close()
    job = secrets.token_hex(8)
    for c in ctrl[1:]:
        send_msg(c, {"table": table, "job": job})
    return ctrl, table, job
