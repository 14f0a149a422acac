"""Shared-memory links between ring neighbours on the same host.

Each rank offers its previous neighbour a file in /dev/shm to write into
(the link prev -> me). The offer travels over the link's authenticated
socket with a random nonce written in the file; the neighbour takes it only
if it runs on the same host (same host name and network namespace: ranks in
separate namespaces stand in for hosts in the emulated cluster), can open
the file and finds the nonce there. Both sides then know the answer, and
the file is unlinked at once: the two mappings keep it alive, and nothing is
left in /dev/shm when the job ends, however it ends.

The file's layout is csrc/shm_link.h's: the magic and nonce at the start,
the data from RR_SHM_DATA_OFFSET on. After this, csrc/tcp.c moves the data
through the mapping and uses the socket only to wake a sleeping side.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket

log = logging.getLogger("ringreduce")

MAGIC = b"RRSHM1\0\0"
DATA_OFFSET = 4096
SHM_DIR = "/dev/shm"


def host_identity() -> str:
    """Ranks with equal identities share /dev/shm and may use shared memory."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def _make_file(tag: str, capacity: int) -> tuple[int, str, bytes]:
    nonce = secrets.token_bytes(32)
    path = os.path.join(SHM_DIR, f"ringreduce-{tag}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, DATA_OFFSET + capacity)
        os.pwrite(fd, MAGIC + nonce, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path, nonce


def _open_offer(offer: dict) -> int:
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
        if os.pread(fd, len(MAGIC) + 32, 0) == MAGIC + bytes.fromhex(offer.get("nonce", "")):
            return fd
    except (OSError, ValueError):
        pass
    os.close(fd)
    return -1


def connect(to_next: socket.socket, from_prev: socket.socket, tag: str, capacity: int,
            send_msg, recv_msg) -> tuple[int, int]:
    """Agrees with both neighbours which links go through shared memory.

    capacity: bytes of each link's buffer, 0 to use none (then every offer
    is declined too, so a link is shared only where both ends want it).
    Returns (tx_fd, rx_fd): the files of the links to next and from prev, or
    -1 for a link that stays on its socket.
    """
    rx_fd, tx_fd, path = -1, -1, None
    offer: dict = {"path": None}
    if capacity > 0:
        try:
            rx_fd, path, nonce = _make_file(tag, capacity)
            offer = {"path": path, "nonce": nonce.hex(), "host": host_identity()}
        except OSError as exc:
            log.info("ringreduce: no shared memory for the link from the previous rank: %s", exc)
    try:
        send_msg(from_prev, {"shm_offer": offer})
        tx_fd = _open_offer(recv_msg(to_next).get("shm_offer")) if capacity > 0 else -1
        send_msg(to_next, {"shm_taken": tx_fd >= 0})
        taken = recv_msg(from_prev).get("shm_taken") is True
    except BaseException:
        for fd in (rx_fd, tx_fd):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        if path is not None:
            os.unlink(path)
    if rx_fd >= 0 and not taken:
        os.close(rx_fd)
        rx_fd = -1
    return tx_fd, rx_fd
