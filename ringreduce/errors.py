"""The exceptions ringreduce raises. Every rank of a failed operation raises."""


class RingReduceError(RuntimeError):
    """Base class. After one is raised by a collective once data has moved
    (a lost peer, a transport error), the communicator is unusable: every
    later call raises RingReduceError saying why. MismatchError is the
    exception: it is found before any data moves, and the ring stays usable."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank if rank is not None and rank >= 0 else None


class MismatchError(RingReduceError):
    """Ranks called a collective with different op, dtype, shape, root or name.
    Found from a small header every rank sends before any data moves, and
    raised on every rank alike; the communicator stays usable (as Horovod's)."""


class PeerLostError(RingReduceError):
    """A peer died, closed its connection, or stayed silent past
    RINGREDUCE_TIMEOUT seconds. `.rank` is the lost rank."""


class WithdrawnError(RingReduceError):
    """The request was withdrawn (engine.withdraw) before it ran: its step
    failed on another collective, so nobody reads its result."""


class StaleGenerationError(RingReduceError):
    """A header from another generation of an elastic job's ring (ringrun
    --elastic re-forms the ring after a loss, each time a new generation):
    the operation is refused on every rank that sees it, never paired."""
