"""GPU arrays device to device through CUDA IPC (csrc/schedule/ipc.c): the
IPC path of the collectives on the ring (allreduce, reduce_scatter,
allgather, broadcast), beside the staged path (the host ring on a pinned
mirror, csrc/schedule/ring.c).

Which path a ring takes is agreed once, the first time every rank of it
runs a collective on a device (each rank's header says so: a ring with a
host rank keeps the staged path), in two blob passes. In the first every
rank gives its host, its RINGREDUCE_CUDA_IPC setting, its device's IPC
identity (the device's UUID: a MIG instance's own) and its window's handle
(none where the device or driver refuses IPC or cannot export memory). Where every rank is on one
host with the setting on, each rank checks that its device reaches every
peer's (the same GPU, or another with peer access) and opens every peer's
window (and keeps it open: the first operation needs no opening); the
second pass says whether every rank succeeded. Every rank takes the
IPC path when it did; otherwise every rank takes the staged path, which is
never an error. Every rank sees the same blobs, so every rank decides
alike; the decision is kept on the ring (Ring.ipc).

Small allreduces (the ring's small limit) on a ring that agreed on the IPC
path take one pass (allreduce_small): the pass carries the headers and
where each rank's input lies on its device, and every rank folds every
rank's input in rank order (the host small paths' bits). A small one on a
ring whose path is not agreed yet takes the ring's device path once, which
agrees; where that pass meets a host rank, the ring stops asking
(Ring.small_asks_ipc) and its small GPU allreduces take the pinned bounce
buffer.

A ring that agreed on IPC ends with release (before a process set's
removal and at shutdown): each rank closes the peers' windows it opened
for the ring, a handshake, then each frees its small window for the ring,
so no window goes while a peer has it open or still reads it (the last
small allreduce's slots included).

A rank that later runs on a device its peers cannot reach makes the next
IPC collective fail on every rank (its new window does not open on its
peers; the handshake tells every rank, naming the rank whose open failed),
never silently."""
from __future__ import annotations

import json
import threading
import weakref

from . import shm as _shm
from ..errors import RingReduceError
from .communicator import current as _state

AGREE_HEAD = b"RRIPC1"  # the agreement's blobs: a pass that met anything else fails, naming the rank


def wanted() -> bool:
    """This rank's RINGREDUCE_CUDA_IPC (the world's config; on by default)."""
    world = _state.world
    return bool(getattr(world.config, "cuda_ipc", True)) if world is not None else True


def offer(ring, device, want: bool) -> dict:
    """What this rank gives in the agreement's first pass."""
    got = device.ipc_offer(ring.comm.ring_id) if want else None
    identity, handle = got if got is not None else (None, b"")
    return {"host": _shm.host_identity(), "pidns": _shm.pid_namespace(), "want": want, "device": identity,
            "handle": handle.hex()}


def candidates(offers: list[dict]) -> bool:
    """Whether every rank may take the IPC path, from every rank's offer (the
    same list on every rank): all on one host (and pid namespace: the
    handles name processes), all willing and able to export."""
    first = offers[0]
    return all(o["want"] and o["device"] and o["host"] == first["host"] and o["pidns"] == first["pidns"]
               for o in offers)


def agreement_payloads(blobs) -> list[bytes]:
    """The agreement's blobs without their head; RingReduceError on every
    rank naming the first rank whose blob is no agreement blob (its
    collectives are out of step with the others')."""
    for q, b in enumerate(blobs):
        if bytes(b[:len(AGREE_HEAD)]) != AGREE_HEAD:
            raise RingReduceError(f"the GPU path's agreement met something else from rank {q}: "
                                  "the ranks' collectives are out of step")
    return [bytes(b[len(AGREE_HEAD):]) for b in blobs]


def agree(ring, device) -> bool:
    """The ring's path for device collectives, agreed by every rank on its first
    one (collective: every rank calls it at the same point, under the ring's
    lock), then kept."""
    if ring.ipc is None:
        uses(ring, device)
        mine = json.dumps(offer(ring, device, wanted())).encode()
        offers = [json.loads(p) for p in agreement_payloads(ring.comm.exchange_blobs(AGREE_HEAD, mine))]
        able = candidates(offers) and all(device.ipc_probe(bytes.fromhex(o["handle"]), o["device"],
                                                           ring.comm.ring_id)
                                          for q, o in enumerate(offers) if q != ring.rank)
        votes = ring.comm.exchange_blobs(AGREE_HEAD, b"1" if able else b"0")
        ring.ipc = all(v == b"1" for v in agreement_payloads(votes))
    return ring.ipc


def uses(ring, device) -> None:
    """Records that this rank runs ring's IPC collectives on device (its
    windows and its peers' are kept there for the ring until release)."""
    if not any(ref() is device for ref in ring.ipc_devices):
        ring.ipc_devices.append(weakref.ref(device))  # a device dropped meanwhile has closed and freed it all


def release(ring, closing: bytes) -> None:
    """The IPC path's end on ring, before it closes (Comm.release_ipc):
    every peer closes the windows it opened for the ring, a handshake, then
    each rank frees its small windows of the ring. So no window, the last
    small allreduce's included, goes while a peer still has it open or
    reads it. Collective where the ring agreed on IPC (alike on every rank),
    nothing otherwise. It starts with a pass of `closing` (protocol.closing_header):
    a peer that meets it in a collective of its own raises PeerLostError
    naming this rank, and this rank frees nothing. A ring already broken, or
    a peer gone, frees nothing (the devices free it when they go), and
    raises nothing."""
    if ring.ipc and ring.size > 1 and ring.comm is not None and ring.comm.broken is None:
        try:
            if all(blob == closing for blob in ring.comm.exchange_blobs(closing, b"")):
                ring.comm.release_ipc([d for d in (ref() for ref in ring.ipc_devices) if d is not None])
        except RingReduceError:
            pass
    ring.ipc_devices = []


def closes_with_pass(ring) -> bool:
    """Whether closing ring starts with release's closing pass: it agreed on
    IPC, has peers, and is neither closed nor broken."""
    return bool(ring.ipc) and ring.size > 1 and ring.comm is not None and ring.comm.broken is None


def release_all(rings, closing: bytes) -> None:
    """release() of every ring of this rank (shutdown: the world's and the
    process sets'), the closing passes (closes_with_pass) at once, a thread
    each: a peer waiting in a collective on any of them meets this rank's
    closing pass there at once (PeerLostError naming this rank), whichever
    ring it waits on, instead of waiting out RINGREDUCE_TIMEOUT while this
    rank's pass on another ring waits for it. (A ring without a closing
    pass is best closed before: a peer waiting on it then hears at once
    that this rank left.) The first error other than a peer's (release
    raises none of those) is raised once every pass has ended."""
    passing = [ring for ring in rings if closes_with_pass(ring)]
    errors = []

    def run(ring):
        try:
            release(ring, closing)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every pass has ended
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(ring,), name="ringreduce-release", daemon=True)
               for ring in passing[1:]]
    for t in threads:
        t.start()
    for ring in passing[:1]:
        run(ring)
    for t in threads:
        t.join()
    for ring in rings:
        if not any(ring is p for p in passing):
            ring.ipc_devices = []  # nothing to pass: its devices free what they hold when they go
    if errors:
        raise errors[0]


def takes_ipc(ring, device, all_device: bool) -> bool:
    """Whether this allreduce takes the IPC path: a ring of two or more ranks,
    every one on a device (all_device: every header of its pass says so,
    protocol.all_device), that agreed on it."""
    return ring.size > 1 and all_device and agree(ring, device)


def allreduce(ring, device, src: int, dst: int, nbytes: int, code: int, opc: int, all_device: bool) -> bool:
    """The ring allreduce of device memory src into dst (pointers) on
    `device` (ringreduce._core.Device), after a header pass in which every
    rank said it runs on a device (all_device) or not: the IPC path where
    the ring agreed on it, else the staged path. Returns whether it took
    the IPC path. The collectives below choose alike."""
    ipc = takes_ipc(ring, device, all_device)
    if ipc:
        uses(ring, device)
    (ring.comm.allreduce_ipc if ipc else ring.comm.allreduce_device)(device, src, dst, nbytes, code, opc)
    return ipc


def small_takes_ipc(ring) -> bool:
    """Whether a small allreduce of device memory takes the one-pass IPC
    path (allreduce_small): the ring agreed on IPC. Alike on every rank."""
    return ring.size > 1 and bool(ring.ipc)


def small_agrees_first(ring) -> bool:
    """Whether a small allreduce of device memory takes the ring's device
    path (header pass, then allreduce) instead of the bounce buffer, so that
    the ring agrees on its path: not agreed yet, and no pass of such an
    allreduce has met a host rank."""
    return ring.size > 1 and ring.ipc is None and ring.small_asks_ipc


def allreduce_small(ring, device, head: bytes, src: int, dst: int, nbytes: int, code: int, opc: int):
    """The one-pass small allreduce of device memory src into dst on a ring
    that agreed on IPC: None when every rank's header is head (dst holds the
    result), else every rank's blob (nothing reduced: the caller agrees on
    them and takes the ring). The ring's small window is made for its
    allreduce limit, so it never grows."""
    uses(ring, device)
    return ring.comm.allreduce_small_ipc(head, device, src, dst, nbytes, code, opc, ring.allreduce_limit)


def reduce_scatter(ring, device, src: int, dst: int, nbytes: int, code: int, opc: int, all_device: bool) -> bool:
    """Chunk `rank` of dst gets the reduction (ring.c's chunks)."""
    ipc = takes_ipc(ring, device, all_device)
    if ipc:
        uses(ring, device)
    (ring.comm.reduce_scatter_ipc if ipc else ring.comm.reduce_scatter_device)(device, src, dst, nbytes, code, opc)
    return ipc


def allgather(ring, device, buf: int, nbytes: list, all_device: bool) -> bool:
    """In place: block i of buf (nbytes[i] bytes) is rank i's."""
    ipc = takes_ipc(ring, device, all_device)
    if ipc:
        uses(ring, device)
    (ring.comm.allgather_ipc if ipc else ring.comm.allgather_device)(device, buf, nbytes)
    return ipc


def broadcast(ring, device, buf: int, nbytes: int, root: int, all_device: bool) -> bool:
    """In place: root's nbytes at buf on every rank."""
    ipc = takes_ipc(ring, device, all_device)
    if ipc:
        uses(ring, device)
    (ring.comm.broadcast_ipc if ipc else ring.comm.broadcast_device)(device, buf, nbytes, root)
    return ipc
