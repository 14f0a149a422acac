"""Shared-memory links between ring neighbours on the same host.

Each rank offers its previous neighbour a file in /dev/shm to write into
(the link prev -> me). The offer travels over the link's authenticated
socket with a random nonce written in the file; the neighbour takes it only
if it runs on the same host (same host name and network namespace: ranks in
separate namespaces stand in for hosts in the emulated cluster), can open
the file and finds the nonce there. Both sides then know the answer, and
the file is unlinked at once: the two mappings keep it alive, and once the
links are agreed nothing is left in /dev/shm, however the job ends.

The file's layout is csrc/transport/shm_link.h's: the magic and nonce at the start,
the data from RR_SHM_DATA_OFFSET on. After this, csrc/transport/tcp.c moves the data
through the mapping and uses the socket only to wake a sleeping side.

When every rank of a ring is on one host, they also share one arena
(csrc/schedule/host_arena.h) for small operations: attach_arena() below, agreed the
same way (the offer travels in a ring pass of blobs, or in an MPI allgather
over MPI) and unlinked at once.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import stat

import numpy as np

from . import _core

log = logging.getLogger("ringreduce")

MAGIC = b"RRSHM1\0\0"
ARENA_MAGIC = b"RRARENA1"  # csrc/schedule/host_arena.h
# RINGREDUCE_ARENA_REDUCE's names for Comm.use_arena's modes (csrc/schedule/host_arena.h rr_arena_mode).
ARENA_MODES = {"auto": 1, "copy": 2, "direct": 3, "split": 4}
DATA_OFFSET = 4096
ALIGN = 64  # csrc/transport/shm_link.h RR_SHM_ALIGN
SHM_DIR = "/dev/shm"
MAX_BYTES = 1 << 30  # largest link buffer offered or taken


def host_identity() -> str:
    """Ranks with equal identities share /dev/shm and may use shared memory."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


# A file's name ends in its maker's pid namespace and pid: the file lives
# under its name only until its peers have opened it, but a maker killed
# (SIGKILL) in that window cannot unlink it, and the next maker on the host
# that finds the pid gone does (_sweep_stale).
_STALE = re.compile(r"^ringreduce-.*-n(\d+)p(\d+)-[0-9a-f]{12}$")


def pid_namespace() -> int:
    """Ranks with equal host identities and pid namespaces see each other's pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _sweep_stale() -> None:
    """Unlinks our files in SHM_DIR whose maker (in our pid namespace) is dead."""
    ns = pid_namespace()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        m = _STALE.match(name)
        if not m or int(m.group(1)) != ns or int(m.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue  # alive (or another user's): not ours to judge
        except ProcessLookupError:
            pass
        except OSError:
            continue
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.geteuid():
                os.unlink(path)
                log.info("ringreduce: removed %s, left by a rank that died", path)


def _make_file(tag: str, capacity: int, magic: bytes = MAGIC, header: int = DATA_OFFSET) -> tuple[int, str, bytes]:
    _sweep_stale()
    nonce = secrets.token_bytes(32)
    owner = f"n{pid_namespace()}p{os.getpid()}"
    path = os.path.join(SHM_DIR, f"ringreduce-{tag}-{owner}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        # Reserve the pages now: a full /dev/shm then says ENOSPC here (the
        # link stays on TCP), not SIGBUS in the middle of a collective.
        os.posix_fallocate(fd, 0, header + capacity)
        os.pwrite(fd, magic + nonce, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path, nonce


def _open_offer(offer: dict, magic: bytes = MAGIC, size_ok=lambda n: DATA_OFFSET < n <= DATA_OFFSET + MAX_BYTES) -> int:
    """The file named by a neighbour's offer, or -1 where we cannot share it."""
    if not isinstance(offer, dict) or not offer.get("path") or offer.get("host") != host_identity():
        return -1
    path = offer["path"]
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith("ringreduce-"):
        return -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        # Only a file as _make_file leaves it: ours alone, one name, a sane size.
        private = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
        if private and st.st_nlink == 1 and size_ok(st.st_size) and \
                os.pread(fd, len(magic) + 32, 0) == magic + bytes.fromhex(offer.get("nonce", "")):
            return fd
    except Exception:  # noqa: BLE001 - a malformed offer is declined, whatever is wrong with it
        pass
    os.close(fd)
    return -1


def connect(to_next: socket.socket, from_prev: socket.socket, tag: str, capacity: int,
            send_msg, recv_msg) -> tuple[int, int]:
    """Agrees with both neighbours which links go through shared memory.

    capacity: bytes of each link's buffer (at most MAX_BYTES), 0 to use none (then every offer
    is declined too, so a link is shared only where both ends want it).
    Returns (tx_fd, rx_fd): the files of the links to next and from prev, or
    -1 for a link that stays on its socket.
    """
    rx_fd, tx_fd, path = -1, -1, None
    offer: dict = {"path": None}
    # A whole number of RR_SHM_ALIGN (64) bytes: the zero-copy windows need it (csrc/transport/tcp.c), and a
    # RINGREDUCE_SHM_BYTES of, say, 1000 would otherwise turn that path off for the whole ring.
    # And at least two: a Cross Memory Attach token (csrc/schedule/cma.c) must fit after the alignment gap
    # the operation before leaves; one alone deadlocked every rank in put_token.
    capacity = min(max(-(-capacity // ALIGN) * ALIGN, 2 * ALIGN), MAX_BYTES) if capacity > 0 else 0
    if capacity > 0:
        try:
            rx_fd, path, nonce = _make_file(tag, capacity)
            offer = {"path": path, "nonce": nonce.hex(), "host": host_identity()}
        except OSError as exc:
            log.info("ringreduce: no shared memory for the link from the previous rank: %s", exc)
    try:
        send_msg(from_prev, {"shm_offer": offer})
        # Read the offer even when declining: unread bytes would turn this
        # socket's close into a reset that drops data still on its way.
        theirs = recv_msg(to_next)
        if capacity > 0 and isinstance(theirs, dict):
            tx_fd = _open_offer(theirs.get("shm_offer"))
        send_msg(to_next, {"shm_taken": tx_fd >= 0})
        answer = recv_msg(from_prev)
        taken = isinstance(answer, dict) and answer.get("shm_taken") is True
        if path is not None:
            os.unlink(path)
            path = None
    except BaseException:
        for fd in (rx_fd, tx_fd):
            if fd >= 0:
                os.close(fd)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    if rx_fd >= 0 and not taken:
        os.close(rx_fd)
        rx_fd = -1
    return tx_fd, rx_fd


def attach_arena(comm, rank: int, size: int, tag: str, slot_bytes: int, spin: int, allgather=None,
                 reduce: str = "auto") -> bool:
    """Gives comm (every rank of its ring calls this at the same point) a
    host arena with slot_bytes per rank, when all ranks share this host and
    want the same slot size (slot_bytes 0: this rank wants none, and so
    nobody gets one; it still takes part, so no rank waits for it).

    allgather(bytes) -> every rank's bytes, in ring rank order: how the ranks
    agree. Default: the ring's own pass of blobs (comm.exchange_blobs); the
    MPI backend passes its communicator's allgather (ringreduce/mpi_backend.py).

    Ring rank 0 makes the file and offers it in an allgather that also
    carries every rank's host identity and slot size; the others open it only
    when all of those are the same and map it, and a second allgather says
    whether all could. Rank 0 unlinks the file after that, whatever happened:
    the mappings keep it alive, and nothing is left in /dev/shm however the
    job ends. Returns whether the arena is in use on every rank (False: small
    operations stay on the ring, or by doubling over MPI, on every rank).
    It reduces as `reduce` says (Config.arena_reduce, RINGREDUCE_ARENA_REDUCE
    as init() read it; ranks that differ there still agree: the split
    happens only where every rank offers it).
    """
    from . import _core

    if size < 2:
        return False
    if allgather is None:
        def allgather(data: bytes) -> list:
            return [bytes(b) for b in comm.exchange_blobs(data)]
    nbytes = _core.arena_file_bytes(size, slot_bytes) if slot_bytes > 0 else 0
    fd, path, attached = -1, None, False
    offer: dict = {"host": host_identity(), "slot": slot_bytes}
    try:
        if rank == 0 and slot_bytes > 0:
            try:
                fd, path, nonce = _make_file(f"arena-{tag}", nbytes, ARENA_MAGIC, header=0)
                offer.update(path=path, nonce=nonce.hex())
            except OSError as exc:
                log.info("ringreduce: no host arena: %s", exc)
        offers = [json.loads(bytes(b)) for b in allgather(json.dumps(offer).encode())]
        alike = all(o.get("host") == offer["host"] and o.get("slot") == slot_bytes for o in offers)
        if alike and slot_bytes > 0 and rank != 0 and offers[0].get("path"):
            fd = _open_offer(offers[0], ARENA_MAGIC, lambda n: n == nbytes)
        if fd >= 0 and alike:
            # Mapped before the vote: a rank whose mapping fails says so
            # there, instead of leaving the others waiting for it in the arena.
            try:
                attached = comm.attach_arena(fd, slot_bytes, spin)
            except Exception as exc:  # noqa: BLE001 - reported in the vote below, which every rank takes part in
                log.info("ringreduce: no host arena: %s", exc)
            fd = -1  # attach_arena took it, whatever came of it
            if attached:
                comm.use_arena(0)  # the vote goes the way every rank can go, the ring's
        opened = allgather(b"1" if attached else b"0")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if fd >= 0:
        os.close(fd)
    if not all(bytes(b) == b"1" for b in opened):
        return False  # mapped here perhaps, but unused: every rank stays on the other path
    comm.use_arena(ARENA_MODES[reduce])
    return True


def agree_zero_copy(comm, wanted: bool) -> bool:
    """Lets comm's ring reduce straight in the shared-memory mappings
    (csrc/schedule/ring.c, ring_steps_zero_copy) if every rank wants it
    (RINGREDUCE_SHM_ZEROCOPY) and has both its links through shared memory.
    That path sends bytes in another order than the copying one, so it is
    all ranks or none. Collective: every rank of comm calls it at the same
    point. Returns whether the ring now takes it."""
    comm.set_zero_copy(False)  # the vote itself travels the copying path, which every rank can take
    able = np.array([comm.set_zero_copy(wanted)], np.int32)
    comm.set_zero_copy(False)
    everyone = np.zeros_like(able)
    comm.allreduce(able, everyone, _core.INT32, _core.MIN)
    return comm.set_zero_copy(bool(everyone[0]))


def agree_cma(comm, me: int, n: int, mode: str) -> bool:
    """Lets comm's ring read each previous neighbour's buffers by Cross
    Memory Attach (csrc/schedule/cma.h) if every rank wants it (RINGREDUCE_SHM_CMA=1, or
    auto in a ring of two),
    zero copy is on (agree_zero_copy first) and every rank's probe passes:
    process_vm_readv of a random canary in its previous neighbour, refused
    under Yama's ptrace_scope, a seccomp filter or across pid namespaces.
    Otherwise (a fallback agreed by all) the ring keeps zero copy through
    the mappings. Collective over the copying path. Returns whether the ring
    now takes it. me, n: this rank's number in comm and comm's size."""
    canary = np.frombuffer(os.urandom(8), np.int64).copy()
    table = np.zeros((n, 3), np.int64)
    table[me] = (os.getpid(), canary.ctypes.data, canary[0])
    comm.set_cma(0)
    zero_copy = comm.zero_copy
    comm.set_zero_copy(False)
    every = np.zeros_like(table)
    comm.allreduce(table, every, _core.INT64, _core.SUM)
    pid, addr, value = (int(v) for v in every[(me - 1) % n])
    # auto: rings of two only. With more ranks the kernel's copy (slower than memcpy here) does more
    # work than the mappings' path (docs/performance.md, "Plain arrays: zero copy against CMA").
    wanted = mode == "1" or (mode == "auto" and n == 2)
    able = wanted and zero_copy and n > 1 and _core.Comm.cma_probe(pid, addr, np.int64(value).tobytes())
    vote = np.array([int(able)], np.int32)
    everyone = np.zeros_like(vote)
    comm.allreduce(vote, everyone, _core.INT32, _core.MIN)
    del canary  # read by next during the probe, which the vote has ended
    comm.set_zero_copy(zero_copy)
    return comm.set_cma(pid if everyone[0] else 0)
