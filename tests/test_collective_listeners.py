"""ringreduce.core.listeners: what the layers above core (the metrics
exporter) observe. Every public collective is reported once, after it, with
its kind, wall time and error; a listener that raises never fails the
collective; an init listener that raises fails init() and leaves the ring."""
from ranks import run_ranks


def test_every_collective_is_reported_once_with_its_kind_time_and_error(tmp_path):
    body = """
from ringreduce.core import listeners
seen = []
def record(kind, seconds, error):
    seen.append((kind, seconds, None if error is None else type(error).__name__))
def broken(kind, seconds, error):
    raise RuntimeError("an observer's bug")
listeners.add_listener(broken)
listeners.add_listener(record)
listeners.add_listener(record)  # once is enough: added once
x = np.arange(100_000, dtype=np.float64)
total = rr.allreduce(x)
rr.allreduce(np.ones(3))
rr.broadcast(np.ones(2), root=1)
rr.allgather(np.ones(1))
rr.reduce_scatter(np.ones(4))
rr.alltoall(np.ones((2, 1)))
rr.barrier()
try:
    rr.allreduce(np.ones(3 + rr.rank()))  # shapes differ: MismatchError on every rank
except rr.MismatchError as exc:
    listeners.report("engine", None, exc)  # reported by the collective already: not again
listeners.report("engine", None, rr.PeerLostError("gone", 1))
listeners.remove_listener(record)
rr.allreduce(np.ones(3))  # no longer reported
result = (seen, total.tolist() == (2 * x).tolist())
"""
    for r in run_ranks(2, body, tmp_path, timeout=90):
        seen, right = r.result
        assert right  # the listener that raised changed nothing
        assert [k for k, _, _ in seen] == ["allreduce", "allreduce", "broadcast", "allgather", "reduce_scatter",
                                           "alltoall", "barrier", "allreduce", "engine"]
        assert all(s > 0 for _, s, _ in seen[:-1]) and seen[-1][1] is None
        assert [e for _, _, e in seen] == [None] * 7 + ["MismatchError", "PeerLostError"]
        assert "an observer's bug" in r.stderr  # logged, not raised


def test_an_init_listener_that_raises_fails_init_and_leaves_the_ring(tmp_path):
    body = """
from ringreduce.core import listeners
configs = []
def refuse(config):
    configs.append(config.metrics_addr)
    raise ValueError("not today")
listeners.add_init_listener(refuse)
try:
    rr.init()
    failed = None
except ValueError as exc:
    failed = str(exc)
left = not rr.is_initialized()
listeners.remove_init_listener(refuse)
rr.init()  # the ring may be joined again
result = (failed, left, configs, rr.allreduce(np.ones(2)).tolist())
"""
    for r in run_ranks(2, body, tmp_path, timeout=90, init=False):
        assert r.result == ("not today", True, ["127.0.0.1"], [2.0, 2.0])


def test_a_collective_run_inside_another_is_reported_as_the_outer_one_only():
    # as a GPU allreduce that reduces through the host allreduce: one allreduce
    from ringreduce.core import listeners
    seen = []

    def record(kind, seconds, error):
        seen.append((kind, None if error is None else str(error)))

    inner = listeners.collective("inner")(lambda fail=False: 1 / 0 if fail else 1)
    outer = listeners.collective("outer")(lambda: inner() + 1)
    listeners.add_listener(record)
    try:
        assert outer() == 2
        assert inner() == 1
        try:
            inner(fail=True)
        except ZeroDivisionError:
            pass
        assert outer() == 2  # the failure above left no "inside" mark behind
    finally:
        listeners.remove_listener(record)
    assert seen == [("outer", None), ("inner", None), ("inner", "division by zero"), ("outer", None)]
