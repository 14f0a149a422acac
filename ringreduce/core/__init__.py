"""The communicator: the world and its ring, process sets, and the
collectives over numpy (and cupy) arrays. What ringreduce.* exports comes
from here; the other layers (engine, compression, elastic, tensorflow,
launch) use only the public names of core's modules.

    lifecycle.py          init, shutdown, rank, size (the world joined or left)
    communicator.py       the communicator's state: the world, its rings, the lock
    collectives.py        allreduce, reduce_scatter, allgather, broadcast, alltoall, barrier
    protocol.py           the header pass every collective starts with, and its agreement
    arrays.py             dtypes, ops and the array families (numpy; cupy in cuda.py)
    process_sets.py       collectives among some ranks, each set its own ring
    traffic.py            stats(): what the rings moved
    shared.py             arrays in shared memory, moved by the ranks of one host in place
    world.py              who the ranks are, and the ring's connections (TCP)
    rendezvous_client.py  a worker's side of ringrun --elastic's rendezvous
    mpi_backend.py        the ring over MPI (mpi4py), and bootstrapping TCP over mpirun
    shm.py                shared-memory links, the host arena, zero-copy and CMA
    config.py             RINGREDUCE_* settings
    autotune.py           calibrating the ring at init (RINGREDUCE_AUTOTUNE)
    cuda.py               GPU arrays: the reduction kernels through cupy
    flight_recorder.py    the last K collectives of this rank, dumped after a failure (rr.flight_recorder)
    testing.py            hooks for ringreduce's own tests
"""
from . import cuda, flight_recorder
from .collectives import (allgather, allreduce, alltoall, barrier, broadcast, check_weights, reduce_scatter,
                          weight_record, weighted_dtypes)
from .communicator import Communicator, communicator
from .lifecycle import backend, init, is_initialized, local_rank, local_size, rank, shutdown, size
from .mpi_backend import available as mpi_unavailable_reason
from .process_sets import (ProcessSet, add_process_set, find_process_set, global_process_set, remove_process_set)
from .shared import is_shared, shared_empty, shared_empty_like, shared_zeros
from .traffic import reset_stats, stats

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "backend",
    "allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "barrier",
    "check_weights", "weight_record", "weighted_dtypes",
    "ProcessSet", "add_process_set", "remove_process_set", "find_process_set", "global_process_set",
    "stats", "reset_stats", "shared_empty", "shared_zeros", "shared_empty_like", "is_shared",
    "Communicator", "communicator", "mpi_unavailable_reason", "cuda", "flight_recorder",
]
