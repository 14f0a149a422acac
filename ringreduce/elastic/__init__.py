"""Elastic training: lose a worker, keep training; a worker comes back, the
ring grows. Under `ringrun --elastic` (docs/elastic.md):

    import ringreduce as rr
    from ringreduce import elastic

    rr.init()
    state = elastic.ObjectState(step=0, w=w)

    @elastic.run
    def train(state):
        while state.step < steps:
            state.w -= lr * rr.allreduce(grad(state.w), op="avg")
            state.step += 1
            state.commit()

    train(state)
"""
from .runner import generation, recoverable, reset, resets, run
from .state import HostsUpdatedInterrupt, ObjectState, State, broadcast_object

__all__ = ["run", "State", "ObjectState", "HostsUpdatedInterrupt", "broadcast_object", "reset", "recoverable",
           "generation", "resets"]
