"""The hierarchical allreduce (RINGREDUCE_HIERARCHICAL): for a world of H
hosts with L ranks each, a large allreduce runs in three phases instead of
one flat ring of N = H * L ranks:

  1. reduce-scatter inside each host (the host's own ring, its links through
     shared memory): the rank with local index i ends with chunk i of its
     host's reduction;
  2. an allreduce of chunk i across hosts, on the ring of the ranks with
     local index i on every host (L such rings run at once, one per local
     index);
  3. an allgather inside each host of the L reduced chunks.

Each host's link to the others then carries 2(H-1)/H of the tensor instead
of the flat ring's 2(N-1)/N (1.0x against 1.75x at 2 hosts x 4 ranks).

Every rank ends with the same bits: chunk i is reduced once, in one order
(the host ring's reduce-scatter order, then the cross ring's), by the ranks
of cross ring i, whose allreduce leaves it bit-identical on each of them;
the allgather only copies it. The bits may differ from the flat ring's for
floats (another order of additions); integer sums are exact either way.
avg sums in both phases and divides the final chunk once by N (as the flat
ring does), except for 16-bit floats, which average as running means in
both phases (their sums could overflow), a mean of equal-weight means.

Which rank is on which host (ringreduce/core/host_rings.py, which builds
the rings at init): every rank's shm.host_identity() (hostname and network
namespace: the identity under which ranks share memory), gathered in one
header pass of the world's ring. RINGREDUCE_HOST_ID, when set (on every rank), replaces it: a
testing hook that fakes hosts on one machine. The hierarchy is built at
init (socket or MPI backend) when the setting is alike on every rank and
allows it, there are at least two hosts and every host holds the same
number (at least two) of ranks; an uneven world (hosts with different
numbers of ranks) keeps the flat ring. A world declared on one host
(RINGREDUCE_LOCAL_SIZE equal to its size; over MPI, MPI's shared-memory
split) skips the probe entirely unless the hook is set. Only the world's ring uses it (process sets keep their flat
rings); device (GPU) arrays keep the flat ring.

`auto` takes the hierarchy for allreduces of at least `crossover_bytes`
(the cost model below), or under RINGREDUCE_AUTOTUNE=1 of at least the
crossover timed at init (core/autotune.py, tune_hierarchy); `on` for every allreduce on the ring path; `off`
never. Every rank decides alike: from the tensor's byte size, which the
header pass agreed, and the setting, agreed at init.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import numpy as np

from .. import _core
from .arrays import as_bytes, as_raw, chunk_bounds


# The pipeline's pieces are CHUNK_BYTES per rank of the host (L * CHUNK_BYTES
# in all): from 2 MiB a chunk, the host ring reduces straight in its
# shared-memory mappings (csrc/schedule/ring.c ZC_MIN_CHUNK), which costs
# the CPU about half of the copying path's (measured at 2 hosts x 4 ranks:
# 280 ms of CPU per 64 MiB allreduce, all ranks together, against 366 ms
# with 512 KiB chunks and 544 ms with 128 KiB ones); smaller pieces would
# leave less of the first and last pieces' host phases unhidden, but cost
# more than they hide where the ranks share cores.
CHUNK_BYTES = 2 << 20

# The cost model `auto` decides by (seconds for S bytes, N = H * L):
#   flat: 2(N-1)/N * S / LINK_BW
#   hier: max(host, link) + the first and last pieces' host phases + PHASE_OVERHEAD, where
#         host = 2(L-1)/L * S / SHM_BW, link = 2(H-1)/H * S / LINK_BW
# The flat ring sends 2(N-1)/N of the tensor over each host's link (one ring
# link in and one out per host); the hierarchy sends 2(H-1)/H over it, spread
# over L connections, and moves 2(L-1)/L through shared memory besides (the
# reduce-scatter and the allgather inside the host), which the pipeline
# runs beside the link's phase but for a piece at each end. LINK_BW is a
# 10 Gbit/s network, SHM_BW what a host's ring moves through shared memory
# on a modest machine (docs/performance.md). PHASE_OVERHEAD stands for what
# the model leaves out: the extra calls, the hand-offs to the worker thread,
# and each phase waiting for its slowest rank to be scheduled. Ranks with
# cores of their own pay tens of microseconds for it; 1 ms keeps `auto` off
# where a little oversubscription would eat the gain (with 8 ranks and other
# jobs on 2 cores it reached ~10 ms: docs/scaling.md). Ring steps (latency)
# are not counted otherwise: the hierarchy takes fewer, 2(L-1) + 2(H-1)
# against 2(N-1).
LINK_BW = 1.25e9      # bytes/s
SHM_BW = 4e9          # bytes/s
PHASE_OVERHEAD = 1e-3  # seconds


def model_seconds(nbytes: int, hosts: int, per_host: int, link_bw: float = LINK_BW, shm_bw: float = SHM_BW,
                  overhead: float = PHASE_OVERHEAD) -> tuple[float, float]:
    """(flat, hierarchical): the cost model's seconds for one allreduce."""
    n = hosts * per_host
    flat = 2 * (n - 1) / n * nbytes / link_bw
    host = 2 * (per_host - 1) / per_host / shm_bw
    link = 2 * (hosts - 1) / hosts * nbytes / link_bw
    ends = host * min(nbytes, per_host * CHUNK_BYTES)
    return flat, max(host * nbytes, link) + ends + overhead


def crossover_bytes(hosts: int, per_host: int, link_bw: float = LINK_BW, shm_bw: float = SHM_BW,
                    overhead: float = PHASE_OVERHEAD) -> int | None:
    """Smallest allreduce (bytes) the cost model runs faster hierarchically
    on hosts x per_host ranks; None where it never does (one host, one rank
    per host, or shared memory too slow against the link)."""
    if hosts < 2 or per_host < 2:
        return None

    def wins(nbytes):
        flat, hier = model_seconds(nbytes, hosts, per_host, link_bw, shm_bw, overhead)
        return hier < flat
    hi = 1 << 40
    if not wins(hi):  # the gain grows with the size past the first piece: none here, none below
        return None
    lo = 1
    while lo < hi:  # the smallest size that wins (the gain only grows with it)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid + 1, hi)
    return lo


@dataclass
class Hierarchy:
    """This rank's place in the hierarchy and its two rings."""
    hosts: int             # H
    per_host: int          # L
    host: int              # this rank's host (hosts numbered in the order of their lowest rank)
    local: int             # this rank's index among its host's ranks (in rank order)
    intra: object          # the ring of this host's ranks, local index order
    cross: object          # the ring of the ranks with this local index, one per host, host order
    mode: str              # "auto" or "on"
    threshold: int         # smallest tensor (bytes) that takes it
    members: list = field(default_factory=list)  # world ranks of each host, hosts in order

    _worker: object = field(default=None, repr=False)

    def worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread the cross ring's phase runs on, beside the host ring's (made on first use)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringreduce-hierarchy")
        return self._worker

    def takes(self, nbytes: int) -> bool:
        return nbytes >= self.threshold

    def comms(self) -> list:
        return [c for c in (self.intra, self.cross) if c is not None]

    def interrupt(self) -> None:
        """Ends both rings after a failure on this rank (a peer lost, a
        timeout, Ctrl-C): a call still running on the worker returns at once,
        and this rank's peers on either ring raise promptly instead of
        waiting out RINGREDUCE_TIMEOUT for a rank that left; theirs then end
        their rings in turn, so the failure reaches every rank, and every
        later hierarchical allreduce raises (as the flat ring's comm stays
        unusable after an error)."""
        for c in self.comms():
            c.interrupt()

    def close(self) -> None:
        for c in self.comms():
            c.close()
        if self._worker is not None:
            self._worker.shutdown(wait=False)

    def describe(self) -> dict:
        return {"hosts": self.hosts, "per_host": self.per_host, "mode": self.mode, "threshold": self.threshold,
                "host": self.host, "local": self.local}


_MEAN_CODES = (_core.FLOAT16, _core.BFLOAT16)


def allreduce(h: Hierarchy, src: np.ndarray, dst: np.ndarray, code: int, opc: int) -> None:
    """dst = the reduction of every world rank's src, in the three phases
    above, pipelined over pieces of L * CHUNK_BYTES: while the cross ring
    reduces piece k (on the hierarchy's worker thread), this thread runs the
    host ring's reduce-scatter of piece k+1 and its allgather of piece k-1,
    so the shared-memory phases hide behind the network's. Each piece is an
    allreduce of its own, cut alike on every rank, so the bits stay alike.
    src and dst are C-contiguous arrays of one shape and dtype; dst is src or
    apart from it. Every world rank calls it with the same size, dtype and op
    (the header pass agreed them)."""
    mean = opc == _core.AVG and code in _MEAN_CODES
    phase_op = _core.SUM if opc == _core.AVG and not mean else opc
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    count, size = flat_src.size, dst.itemsize
    step = max(1, h.per_host * CHUNK_BYTES // size)
    pieces = [(a, min(a + step, count)) for a in range(0, count, step)] or [(0, 0)]
    L, world = h.per_host, h.hosts * h.per_host

    def scatter(k):  # 1. inside the host: chunk `local` of the piece ends reduced over the host
        a, b = pieces[k]
        h.intra.reduce_scatter(as_raw(flat_src[a:b]), as_raw(flat_dst[a:b]), code, phase_op)

    def across(k):  # 2. across hosts: the chunk ends reduced over the world, the same bits on each host
        a, b = pieces[k]
        lo, hi = chunk_bounds(b - a, L, h.local)
        if hi > lo:  # alike on every rank of the cross ring: the piece, L and the local index are
            chunk = flat_dst[a + lo:a + hi]
            h.cross.allreduce(as_raw(chunk), as_raw(chunk), code, phase_op)
            if opc == _core.AVG and not mean:
                _core.divide(as_raw(chunk), code, world)

    def gather(k):  # 3. inside the host: every rank gets every chunk of the piece
        a, b = pieces[k]
        nbytes = [(hi - lo) * size for lo, hi in (chunk_bounds(b - a, L, i) for i in range(L))]
        h.intra.allgather(as_bytes(flat_dst[a:b]), nbytes)

    if len(pieces) == 1:
        try:
            scatter(0)
            across(0)
            gather(0)
        except BaseException:
            h.interrupt()
            raise
        return
    # The host ring runs scatter 0, scatter 1, gather 0, scatter 2, gather 1, ... on every rank of the
    # host, the cross ring 0, 1, 2, ... on every rank of it: the same order everywhere, whatever the timing.
    worker = h.worker()
    done: list = []
    try:
        scatter(0)
        done.append(worker.submit(across, 0))
        for k in range(1, len(pieces)):
            scatter(k)
            done.append(worker.submit(across, k))
            done[k - 1].result()
            gather(k - 1)
        done[-1].result()
        gather(len(pieces) - 1)
    except BaseException:
        h.interrupt()
        for f in done:
            f.cancel()
        concurrent.futures.wait(done)
        raise


def run_allreduce(ring, device: bool, src: np.ndarray, dst: np.ndarray, code: int, opc: int) -> bool:
    """The ring path of an allreduce on `ring`: hierarchical where the
    world's ring has a hierarchy that takes this size and no rank runs it
    from a device (device: any header of the pass says so; a GPU rank runs
    the flat ring on its pinned mirror, core/cuda.py), else the flat ring.
    Every rank decides alike, from what the header pass agreed. Returns
    whether it ran hierarchically."""
    h = ring.hierarchy
    if h is not None and not device and h.takes(src.nbytes):
        allreduce(h, src, dst, code, opc)
        return True
    ring.comm.allreduce(as_raw(src), as_raw(dst), code, opc)
    return False
