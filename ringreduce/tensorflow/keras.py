"""horovod.tensorflow.keras's names over ringreduce (minimal: what a Keras
script needs; the TF API branch writes the full module).

    import ringreduce.tensorflow.keras as hvd
"""
from ringreduce import init, local_rank, local_size, rank, shutdown, size

from . import callbacks
from .compression import Compression
from .ops import allgather, allreduce, broadcast, broadcast_variables
from .optimizer import DistributedOptimizer
from .partial import PartialDistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "callbacks", "Compression",
           "allreduce", "allgather", "broadcast", "broadcast_variables", "DistributedOptimizer",
           "PartialDistributedOptimizer", "SyncBatchNormalization"]
