"""run(): call the training function; on a lost peer, roll back, re-form the
ring, sync, and call it again (Horovod's hvd.elastic.run)."""
from __future__ import annotations

import functools
import logging
import time

from .. import core as _c
from .. import engine as _engine
from ..errors import MismatchError, RingReduceError
from ..core import rendezvous_client as _rendezvous
from ..core.rendezvous_client import RendezvousLostError
from .state import HostsUpdatedInterrupt

log = logging.getLogger("ringreduce")


def recoverable(exc: BaseException) -> bool:
    """A failure of the ring itself (a lost peer, a stale generation, a ring
    left unusable by one): re-forming it helps. A mismatch is the program's;
    a worker cut off from ringrun's rendezvous cannot rejoin."""
    return isinstance(exc, RingReduceError) and not isinstance(exc, (MismatchError, RendezvousLostError))


def generation() -> int:
    """The generation of the running ring (ringrun --elastic forms a new one
    at every reset; 0 outside elastic jobs)."""
    return _c.communicator().generation


def reset() -> None:
    """Leaves the broken ring (the engine's thread stopped, its waiters
    failed, every descriptor closed) and joins the next generation's."""
    global _resets
    _c.shutdown()    # interrupts a collective the engine's thread may be in
    _engine.reset()  # joins that thread; the next engine starts with an empty cache
    _c.init()        # registers again with ringrun's rendezvous and connects the new ring
    _resets += 1


_resets = 0


def resets() -> int:
    """How many times this process has re-formed the ring (reset() done):
    its elastic restarts after a lost peer or a change of hosts."""
    return _resets


def run_with(func, state, args, kwargs, recoverable=recoverable, on_lost=None):
    """The loop behind run(); `recoverable` decides which exceptions mean a
    lost ring (the TensorFlow layer adds its wrapped ones)."""
    reset_required = False
    while True:
        try:
            if reset_required:  # in the try: a peer lost in the reset or its callbacks is one more loss
                started = time.monotonic()
                reset()
                log.info("ringreduce: elastic reset: rank %d of %d (generation %d) in %.2f s",
                         _c.rank(), _c.size(), _c.communicator().generation, time.monotonic() - started)
                state.on_reset()
            state.sync()
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            pass  # committed just now: nothing to roll back
        except BaseException as exc:
            if _rendezvous.client() is None:  # not under ringrun --elastic: fail fast, as without elastic
                raise
            if not recoverable(exc):
                _report(exc)
                raise
            log.info("ringreduce: elastic: %s: rolling back to commit %d", exc, state.commits)
            state.restore()
        reset_required = True


def _report(exc: BaseException) -> None:
    """A program error (not a lost peer) ends the job: ringrun must not restart
    a worker that would only raise again. A clean sys.exit() is no error."""
    client = _rendezvous.client()
    if client is None or isinstance(exc, RendezvousLostError) or (isinstance(exc, SystemExit) and not exc.code):
        return
    client.report_failure(f"{type(exc).__name__}: {exc}")


def run(func):
    """Decorator: `@run def train(state, ...)`; call train(state, ...)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return run_with(func, state, args, kwargs)
    return wrapper
