"""ringreduce for TensorFlow 2 / Keras 3, Horovod-style.

    import ringreduce.tensorflow as rrtf
    rrtf.init()
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.Adam(1e-3 * rrtf.size())), ...)
    model.fit(x, y, callbacks=[rrtf.BroadcastGlobalVariablesCallback(0), rrtf.MetricAverageCallback()])

This layer uses only ringreduce's public API and its background engine.
"""
from ringreduce import init, local_rank, local_size, rank, shutdown, size

from .alltoall import alltoall
from .callbacks import BroadcastGlobalVariablesCallback, LearningRateWarmupCallback, MetricAverageCallback
from .compression import Compression
from .ops import allgather, allreduce, broadcast, broadcast_variables
from .optimizer import DistributedGradientTape, DistributedOptimizer
from .partial import PartialDistributedGradientTape, PartialDistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization

__all__ = [
    "init", "shutdown", "rank", "size", "local_rank", "local_size",
    "allreduce", "allgather", "broadcast", "broadcast_variables", "alltoall",
    "DistributedOptimizer", "DistributedGradientTape", "Compression",
    "PartialDistributedOptimizer", "PartialDistributedGradientTape", "SyncBatchNormalization",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
]
