"""ringreduce for TensorFlow 2 / Keras 3, with Horovod's names: a script
written for horovod.tensorflow runs after one changed line,

    import ringreduce.tensorflow as hvd        # Keras scripts: ringreduce.tensorflow.keras
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size())), ...)
    model.fit(x, y, callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])

This layer uses only ringreduce's public API and its background engine.
basics.py: who am I and what is built; ops.py: the collectives as TF ops;
functions.py: Python objects; errors.py: the errors TF code expects
(MismatchError, InvalidArgumentError, is_mismatch);
async_op.py: the asynchronous op collectives use in TF1 graphs; hooks.py: TF1's
session hook; balance.py: unequal, measured shares of the global batch in
Keras (ringreduce.tensorflow.balance.fit; DistributedOptimizer's
local_batch_size= weights the average by them).
"""
from ringreduce import ProcessSet, add_process_set, remove_process_set

from .alltoall import alltoall
from .basics import (ccl_built, check_process_set, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, global_process_set, init, is_homogeneous, is_initialized, local_rank,
                     local_rank_op, local_size, local_size_op, mpi_built, mpi_enabled, mpi_threads_supported,
                     nccl_built, process_set_included_op, rank, rank_op, rocm_built, shutdown, size, size_op,
                     start_timeline, stop_timeline)
from .callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                        LearningRateWarmupCallback, MetricAverageCallback)
from .compression import Compression
from . import elastic  # hvd.elastic.run, hvd.elastic.TensorFlowKerasState, ... (docs/elastic.md)
from .errors import InvalidArgumentError, MismatchError, is_mismatch
from .functions import allgather_object, broadcast_object, broadcast_object_fn
from .hooks import BroadcastGlobalVariablesHook
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, broadcast, broadcast_,
                  broadcast_global_variables, broadcast_variables, grouped_allgather, grouped_allreduce,
                  grouped_reducescatter, join, reducescatter)
from .optimizer import DistributedGradientTape, DistributedOptimizer
from .partial import PartialDistributedGradientTape, PartialDistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "rank_op", "size_op", "local_rank_op", "local_size_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "broadcast_variables", "broadcast_global_variables", "reducescatter", "grouped_reducescatter", "alltoall", "join",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "MismatchError",
    "InvalidArgumentError", "is_mismatch",
    "DistributedOptimizer", "DistributedGradientTape", "Compression",
    "PartialDistributedOptimizer", "PartialDistributedGradientTape", "SyncBatchNormalization",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "BestModelCheckpoint", "BroadcastGlobalVariablesHook",
    "process_set_included_op", "start_timeline", "stop_timeline",
]
