"""PartialDistributedOptimizer and PartialDistributedGradientTape: data
parallel for every layer but the local ones, whose gradients each rank keeps
(divided by size when scale_local_gradients, as Horovod does), so their
weights are each rank's own."""
from __future__ import annotations

from .optimizer import DistributedGradientTape, DistributedOptimizer, _local_variables


def PartialDistributedOptimizer(optimizer, *args, local_layers=None, **kwargs):
    """DistributedOptimizer (same arguments) that leaves the trainable
    weights of local_layers (a Keras layer or a list of them) unreduced."""
    optimizer = DistributedOptimizer(optimizer, *args, **kwargs)
    _local_variables(optimizer).add_layers(local_layers)
    return optimizer


def PartialDistributedGradientTape(gradtape, *args, local_layers=None, **kwargs):
    """DistributedGradientTape (same arguments) that leaves the gradients of
    local_layers' trainable weights unreduced."""
    tape = DistributedGradientTape(gradtape, *args, **kwargs)
    tape._local.add_layers(local_layers)
    return tape
