"""Building the hierarchical allreduce's rings at init (the schedule and
its cost model: ringreduce/core/hierarchy.py): which rank is on which host,
whether the world takes the hierarchy, and each rank's two rings, the one
among its host's ranks and the one among the ranks of its local index on
every host, made as process sets' rings are (over sockets
world.connect_subring, over MPI splits of the world's communicator) but
registered nowhere: only the world ring's allreduce uses them."""
from __future__ import annotations

import logging
import os

from .. import _core
from ..errors import RingReduceError
from . import mpi_backend as _mpi, process_sets as _ps, shm as _shm, world as _world
from .hierarchy import Hierarchy, crossover_bytes

log = logging.getLogger("ringreduce")

HOST_ID_HOOK = "RINGREDUCE_HOST_ID"  # testing hook: the host this rank counts as (set on every rank)


def build(state, mode: str, env=None) -> Hierarchy | None:
    """Builds this rank's hierarchy for the world just joined (state: the
    communicator, its world ring made), or None where the flat ring stays.
    A collective of the world when it probes (core/hierarchy.py says when):
    every rank calls it at the same point of init(). Raises on every rank
    alike: ValueError when ranks disagree on the setting, RingReduceError
    when a ring could not be made."""
    env = os.environ if env is None else env
    world = state.world
    hook = env.get(HOST_ID_HOOK)
    over_mpi = world.source == "MPI communicator"
    if world.size < 4 or not (over_mpi or "table" in world.extra):
        return None  # no two hosts of two ranks, or no way to connect rings (the table: where members listen)
    if hook is None and world.local_size == world.size:
        return None  # declared on one host (over MPI: MPI's shared-memory split found one)
    listeners = []
    try:
        if mode != "off" and not over_mpi:
            listeners = [_world.open_subring_listener(world), _world.open_subring_listener(world)]
        host_id = hook if hook is not None else _shm.host_identity()
        offers = _ps._agree({"host": host_id, "mode": mode, "ports": [a.port for a in listeners]},
                            "ringreduce.hierarchy", "init (the hierarchical allreduce's rings)")
        modes = [o["mode"] for o in offers]
        if any(m != modes[0] for m in modes):
            per_rank = ", ".join(f"rank {r}: {m}" for r, m in enumerate(modes))
            raise ValueError(f"RINGREDUCE_HIERARCHICAL must be alike on every rank ({per_rank})")
        hosts: dict = {}
        for r, o in enumerate(offers):
            hosts.setdefault(o["host"], []).append(r)
        members = list(hosts.values())
        per_host = {len(m) for m in members}
        if mode == "off" or len(members) < 2 or len(per_host) != 1 or per_host == {1}:
            if mode == "on" and world.rank == 0 and len(members) > 1 and len(per_host) > 1:
                log.warning("ringreduce: RINGREDUCE_HIERARCHICAL=on, but hosts hold different numbers of ranks "
                            "(%s): the flat ring runs", ", ".join(str(len(m)) for m in members))
            return None
        L, H = per_host.pop(), len(members)
        threshold = 0 if mode == "on" else crossover_bytes(H, L)
        if threshold is None:
            return None  # the cost model never has it win here (alike on every rank: H and L are)
        host = next(i for i, m in enumerate(members) if world.rank in m)
        local = members[host].index(world.rank)
        intra_ranks = members[host]
        cross_ranks = [m[local] for m in members]
        ports = [o["ports"] for o in offers]
        intra = cross = None
        failure = None
        try:
            if over_mpi:
                intra, cross = _connect_mpi(state, world, host, local, intra_ranks, cross_ranks)
            else:
                intra = _connect(state, world, listeners[0], intra_ranks, [ports[r][0] for r in intra_ranks],
                                 f"host {host}", intra_ranks.index(world.rank))
                cross = _connect(state, world, listeners[1], cross_ranks, [ports[r][1] for r in cross_ranks],
                                 f"cross ring {local}", cross_ranks.index(world.rank))
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised
            failure = f"{type(exc).__name__}: {exc}"
        outcome = _ps._agree({"error": failure}, "ringreduce.hierarchy.done", "init (the hierarchical allreduce's rings)")
        failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcome) if o.get("error")]
        if failed:
            for c in (intra, cross):
                if c is not None:
                    c.close()
            raise RingReduceError("building the hierarchical allreduce's rings failed: " + "; ".join(failed))
        return Hierarchy(H, L, host, local, intra, cross, mode, threshold, members)
    finally:
        for a in listeners:
            a.close()


def _connect(state, world, listener, ranks: list, ports: list, label: str, me: int):
    """This rank's Comm on the ring of `ranks` (world ranks, ring order)."""
    links = _world.connect_subring(world, listener, me, ranks, ports, f"hierarchy {label}",
                                   state.generation)
    cfg = world.config
    comm = _core.Comm(me, len(ranks), links.next_fd, links.prev_fd, links.ctrl_fds, cfg.ring_timeout,
                      cfg.segment_bytes, cfg.spin, tx_shm=links.tx_shm_fd, rx_shm=links.rx_shm_fd)
    try:
        tag = f"hier-{label.replace(' ', '')}"
        _shm.attach_arena(comm, me, len(ranks), tag, cfg.arena_slot, cfg.spin, reduce=cfg.arena_reduce)
        _shm.agree_zero_copy(comm, cfg.shm_zerocopy)
        _shm.agree_cma(comm, me, len(ranks), cfg.shm_cma)
    except BaseException:
        comm.close()
        raise
    return _RingComm(comm, label, ranks, links.kinds())





def _connect_mpi(state, world, host: int, local: int, intra_ranks: list, cross_ranks: list):
    """This rank's two Comms over MPI: splits of the communicator the
    world's ring runs over (every rank splits it twice, by host and then by
    local index, before connecting either: the splits are collectives of
    the whole world), each ring its own transport on a duplicate of its
    split, as a process set's (mpi_backend.process_set_ring)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if state.init_args[1] is None else state.init_args[1]
    subs = [comm.Split(host, local), comm.Split(local, host)]
    rings = []
    try:
        for sub, label, ranks in zip(subs, (f"host {host}", f"cross ring {local}"), (intra_ranks, cross_ranks)):
            _, ring = _mpi.connect(world.config, sub, tag=f"hier-{label.replace(' ', '')}")
            rings.append(_RingComm(ring, label, ranks, None))
    except BaseException:
        for ring in rings:
            ring.close()
        raise
    finally:
        for sub in subs:
            sub.Free()
    return rings


class _RingComm(_ps.SetComm):
    """A hierarchy ring's Comm whose errors name world ranks (as a process set's)."""

    def _where(self) -> str:
        return f"the hierarchical allreduce's {self._set_id} (world ranks {self._ranks})"
