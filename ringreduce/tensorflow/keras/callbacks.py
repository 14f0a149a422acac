"""horovod.tensorflow.keras.callbacks' names (ringreduce.tensorflow.callbacks)."""
from ..callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                         LearningRateWarmupCallback, MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]
