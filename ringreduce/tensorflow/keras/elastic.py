"""horovod.tensorflow.keras.elastic's names: `hvd.elastic.KerasState`,
`hvd.elastic.run` and the callbacks (ringreduce/tensorflow/elastic.py)."""
from ..elastic import (CommitStateCallback, HostsUpdatedInterrupt, KerasState, ObjectState, State,  # noqa: F401
                       TensorFlowKerasState, TensorFlowState, UpdateBatchStateCallback, UpdateEpochStateCallback, run)
from ..elastic import __all__  # noqa: F401
