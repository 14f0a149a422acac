"""The worker side of ringreduce.ray: one Ray actor per rank.

The driver (executor.py) makes each actor a `ray.remote` of `Worker`, asks
it where it runs, hands it its place in the world as RINGREDUCE_* variables
and has it join the ring (`rr.init()`) before any training function runs;
the ring then stays up across `run` calls. Methods run one at a time on the
actor's main thread (Ray's default for a synchronous actor), where
ringreduce's Ctrl-C hook also lives.
"""
from __future__ import annotations

import os
import socket

import ray

import ringreduce as rr
from ringreduce import engine as _engine
from ringreduce.core import world as _world

# What a worker may have inherited from the environment Ray started it in (a
# driver under ringrun, a raylet started by hand): cleared before the driver's
# own variables are set, so only the driver decides where the worker stands.
WORLD_VARIABLES = ("RINGREDUCE_RANK", "RINGREDUCE_SIZE", "RINGREDUCE_ADDR", "RINGREDUCE_SECRET",
                   "RINGREDUCE_LOCAL_RANK", "RINGREDUCE_LOCAL_SIZE", "RINGREDUCE_ELASTIC_ADDR",
                   "RINGREDUCE_WORKER_ID")


class Worker:
    """One rank of a ringreduce job, as a Ray actor."""

    def where(self) -> dict:
        """The node this actor runs on: its Ray node id, the node's IP (the
        address other nodes reach it at) and this process's pid."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def free_port(self) -> int:
        """A port free on this actor's node now: rank 0's rendezvous port."""
        return _world.free_port()

    def join(self, env: dict) -> tuple:
        """Sets this rank's RINGREDUCE_* variables and joins the ring; returns
        (rank, size) as the ring sees them."""
        for name in WORLD_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(env)
        rr.init()
        return rr.rank(), rr.size()

    def execute(self, fn, args: tuple, kwargs: dict):
        """Runs the training function. Returns (rank, result): ranks change
        in an elastic job, so the driver orders results by the rank each
        worker ended with. If fn raises, this rank leaves the ring first, so
        peers waiting in a collective for it fail at once (PeerLostError
        naming it) instead of waiting RINGREDUCE_TIMEOUT."""
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self.leave()
            raise
        return (rr.rank() if rr.is_initialized() else -1), result

    def join_and_execute(self, env: dict, fn, args: tuple, kwargs: dict):
        """join, then execute: a worker started to replace a lost one in an
        elastic job (it waits at the rendezvous for the ring's next commit)."""
        try:
            self.join(env)
        except BaseException:
            self.leave()
            raise
        return self.execute(fn, args, kwargs)

    def leave(self) -> None:
        """Leaves the ring (a collective the engine's thread is in is
        interrupted, its thread joined), so join() may form a new one."""
        rr.shutdown()
        _engine.reset()
