"""Horovod's TF1 session hook: a tf.compat.v1 MonitoredSession (or
Estimator) that starts every rank from rank root_rank's variables."""
from __future__ import annotations

import tensorflow as tf

from .ops import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from root_rank once the session is
    created (after the variables are initialised or restored), as Horovod's.
    device is accepted for Horovod's sake and has no effect."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        # The graph is final after begin(): the op is built here, once per graph.
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
