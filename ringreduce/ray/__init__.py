"""ringreduce on Ray: one actor per rank, the ring formed among them
(docs/ringrun.md, "Ray"). Needs `pip install ringreduce[ray]`.

    import ringreduce as rr
    from ringreduce.ray import RayExecutor

    def train(steps):
        w = np.zeros(10)
        for _ in range(steps):
            w -= 0.1 * rr.allreduce(grad(w), op="avg")
        return w

    executor = RayExecutor(num_workers=4, cpus_per_worker=1)
    executor.start()                  # actors placed, ring formed (rr.init() done on each)
    weights = executor.run(train, args=(100,))   # one result per rank, in rank order
    executor.shutdown()

`import ringreduce` never imports Ray; `rr.ray` (or this import) does.
"""
try:
    import ray as _ray  # noqa: F401
except ImportError as exc:
    raise ImportError("ringreduce.ray needs Ray: pip install 'ringreduce[ray]'") from exc

from .executor import RayExecutor, WorkerFailedError, WorkerLostError

__all__ = ["RayExecutor", "WorkerFailedError", "WorkerLostError"]
