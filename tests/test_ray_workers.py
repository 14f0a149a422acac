"""ringreduce.ray: ranks as Ray actors on a local Ray cluster (one per module:
started once, shut down at the end). The functions run on the workers are
this module's (and examples/ray_train.py's): the workers import them by
name, so the cluster's workers get tests/ and examples/ on PYTHONPATH.

Ray's local cluster registers this machine's own address as its node IP
(it replaces 127.0.0.1 on purpose), so the ring's traffic goes to that
address: it never leaves the machine."""
import os
import sys
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray not installed (pip install 'ringreduce[ray]')")

import ringreduce as rr  # noqa: E402
from ranks import REPO  # noqa: E402
from ringreduce.errors import PeerLostError, RingReduceError  # noqa: E402
from ringreduce.ray import RayExecutor, WorkerFailedError, WorkerLostError  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join([str(REPO / "tests"), str(REPO / "examples"), str(REPO)])
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture
def executor(cluster):
    made = []

    def make(**kwargs):
        ex = RayExecutor(**kwargs)
        made.append(ex)
        return ex
    yield make
    for ex in made:
        ex.shutdown()


def _until(path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# ---------------------------------------------------------------- functions run on the workers


def reduce_rank_data(n):
    rng = np.random.default_rng(100 + rr.rank())
    x = rng.standard_normal(n)
    ints = rng.integers(-1000, 1000, size=n, dtype=np.int64)
    return {"rank": rr.rank(), "size": rr.size(), "local_rank": rr.local_rank(), "local_size": rr.local_size(),
            "addr": os.environ["RINGREDUCE_ADDR"], "secret": os.environ["RINGREDUCE_SECRET"],
            "ip": ray.util.get_node_ip_address(), "x": x, "ints": ints,
            "sum": rr.allreduce(x), "avg": rr.allreduce(x, op="avg"), "isum": rr.allreduce(ints)}


def rank_and_sum():
    return rr.rank(), rr.allreduce(np.array([rr.rank() + 1]))[0]


def steps_until_killed(marker, victim):
    for step in range(100000):
        rr.allreduce(np.ones(1000), name="step")
        if step == 3 and rr.rank() == victim:
            open(marker, "w").close()
        time.sleep(0.02)
    return "never killed"


def compute_for_ever_or_raise(bad_rank):
    if rr.rank() == bad_rank:
        raise ValueError("raised at once")
    time.sleep(3600)  # no collective: never learns of the failure by itself


def raise_on(bad_rank):
    if rr.rank() == bad_rank:
        raise ValueError(f"rank {bad_rank}'s own error")
    rr.allreduce(np.ones(10), name="waits for the bad rank")
    return "unreachable"


def elastic_steps(marker, victim, steps, grow_to=0):
    from ringreduce import elastic
    state = elastic.ObjectState(step=0, w=np.zeros(8), sizes=[])

    @elastic.run
    def train(state):
        # on past `steps` until the world is grow_to again (a replacement joined), at most 3000 steps
        while state.step < steps or (rr.size() < grow_to and state.step < 3000):
            # a sum over the ring: the committed history of world sizes says what w must be
            state.w = state.w + rr.allreduce(np.full(8, 1.0), name="grad")
            state.sizes = state.sizes + [rr.size()]
            state.step += 1
            if state.step == 10 and rr.rank() == victim and not os.path.exists(marker):
                open(marker, "w").close()
            time.sleep(0.05)
            state.commit()
    train(state)
    return {"rank": rr.rank(), "size": rr.size(), "step": state.step, "w": state.w, "sizes": state.sizes}


# ---------------------------------------------------------------- tests


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_allreduce_on_four_ray_workers_equals_numpy_bit_identical_on_every_rank(executor):
    ex = executor(num_workers=4, cpus_per_worker=1)
    ex.start()
    out = ex.run(reduce_rank_data, args=(10001,))
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert {o["size"] for o in out} == {4}
    # one node: local ranks are the ranks
    assert [(o["local_rank"], o["local_size"]) for o in out] == [(i, 4) for i in range(4)]
    # rank 0's rendezvous is at rank 0's node IP, as its actor saw it; one fresh secret for the job
    host, _, port = out[0]["addr"].rpartition(":")
    assert host == out[0]["ip"] and int(port) > 0 and {o["addr"] for o in out} == {out[0]["addr"]}
    assert len({o["secret"] for o in out}) == 1 and len(out[0]["secret"]) == 64
    x = np.stack([o["x"] for o in out])
    for o in out:
        assert o["sum"].tobytes() == out[0]["sum"].tobytes()
        assert o["avg"].tobytes() == out[0]["avg"].tobytes()
        assert o["isum"].tobytes() == out[0]["isum"].tobytes()
    np.testing.assert_allclose(out[0]["sum"], x.sum(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out[0]["avg"], x.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out[0]["isum"], np.stack([o["ints"] for o in out]).sum(axis=0))
    # the ring stays up across runs
    again = ex.run(reduce_rank_data, args=(3,))
    np.testing.assert_array_equal(again[2]["isum"], np.stack([o["ints"] for o in again]).sum(axis=0))


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_keras_distributed_optimizer_on_two_ray_workers_ends_with_identical_weights(executor):
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    import ray_train  # examples/ray_train.py, the documented example
    ex = executor(num_workers=2, placement_strategy="SPREAD")
    ex.start()
    out = ex.run(ray_train.train, kwargs={"epochs": 2})
    assert [o["rank"] for o in out] == [0, 1]
    assert len(out[0]["weights"]) == 4
    for a, b in zip(out[0]["weights"], out[1]["weights"]):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()
    assert out[0]["accuracy"] == out[1]["accuracy"] > 0.3  # well above chance (0.1): learned, from two shards


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_a_killed_worker_fails_the_run_naming_its_rank_and_the_others_raise_peer_lost(executor, tmp_path):
    ex = executor(num_workers=3)
    ex.start()
    marker = str(tmp_path / "rank1-running")
    killer = threading.Thread(target=lambda: (_until(marker), ray.kill(ex.actors[1])), daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        ex.run(steps_until_killed, args=(marker, 1))
    assert time.monotonic() - started < 90
    err = info.value
    assert err.rank == 1 and isinstance(err, PeerLostError)
    assert "rank 1 of 3 was lost: its Ray actor died" in str(err) and "ray.kill" in str(err)
    assert sorted(err.errors) == [0, 1, 2]
    for r in (0, 2):
        assert isinstance(err.errors[r], PeerLostError) and err.errors[r].rank == 1, err.errors[r]
    # the executor says it cannot go on, rather than hanging on a ring with a rank gone
    with pytest.raises(RingReduceError, match="shutdown\\(\\) and start\\(\\) again"):
        ex.run(reduce_rank_data, args=(3,))


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_a_function_error_names_its_rank_and_the_ring_forms_again_for_the_next_run(executor):
    ex = executor(num_workers=3)
    ex.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        ex.run(raise_on, args=(2,))
    assert time.monotonic() - started < 60  # the others learn it at once, not after RINGREDUCE_TIMEOUT
    err = info.value
    assert not isinstance(err, WorkerLostError) and err.rank == 2
    assert "rank 2 of 3 failed: ValueError: rank 2's own error" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert all(isinstance(err.errors[r], PeerLostError) and err.errors[r].rank == 2 for r in (0, 1))
    out = ex.run(reduce_rank_data, args=(5,))
    assert [o["rank"] for o in out] == [0, 1, 2]
    np.testing.assert_array_equal(out[1]["isum"], np.stack([o["ints"] for o in out]).sum(axis=0))


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_ranks_that_never_end_are_killed_after_the_grace_or_the_run_timeout(executor):
    ex = executor(num_workers=2, grace=2)
    ex.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        ex.run(compute_for_ever_or_raise, args=(1,))
    assert time.monotonic() - started < 60
    err = info.value
    assert err.rank == 1 and isinstance(err.errors[1], ValueError)
    assert "rank 0: TimeoutError: still running 2 s after rank 1 failed; its actor was killed" in str(err)
    ex.shutdown()
    ex = executor(num_workers=2)
    ex.start()
    with pytest.raises(WorkerFailedError, match=r"rank 0 of 2 failed: TimeoutError: still running when the "
                                                r"run's timeout \(2 s\) passed") as info:
        ex.run(compute_for_ever_or_raise, args=(-1,), timeout=2)
    assert sorted(info.value.errors) == [0, 1]
    with pytest.raises(RingReduceError, match="shutdown\\(\\) and start\\(\\) again"):
        ex.run(rank_and_sum)


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_elastic_job_goes_on_without_a_killed_worker_from_its_last_commit(executor, tmp_path):
    ex = executor(num_workers=3, min_workers=2)
    ex.start()
    marker = str(tmp_path / "killed")
    killer = threading.Thread(target=lambda: (_until(marker), ray.kill(ex.actors[1])), daemon=True)
    killer.start()
    out = ex.run(elastic_steps, args=(marker, 1, 40), timeout=240)
    assert len(ex.lost) == 1 and "ray.kill" in ex.lost[0][1]
    assert [o["rank"] for o in out] == [0, 1] and {o["size"] for o in out} == {2} and len(ex.actors) == 2
    for o in out:  # every committed step once, none lost or repeated, bit-identical on both
        assert o["step"] == 40 and o["w"].tobytes() == out[0]["w"].tobytes() and o["sizes"] == out[0]["sizes"]
    sizes = out[0]["sizes"]
    assert sizes[:9] == [3] * 9 and sizes[-1] == 2, sizes  # step 10 may be done again without the lost rank
    np.testing.assert_array_equal(out[0]["w"], np.full(8, float(sum(sizes))))
    assert ex.run(rank_and_sum) == [(0, 3), (1, 3)]  # the survivors' ring serves the next run


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_elastic_job_goes_on_without_a_killed_worker_and_its_replacement_joins(executor, tmp_path):
    ex = executor(num_workers=3, min_workers=2, max_restarts=1)
    ex.start()
    marker = str(tmp_path / "killed")
    killer = threading.Thread(target=lambda: (_until(marker), ray.kill(ex.actors[1])), daemon=True)
    killer.start()
    out = ex.run(elastic_steps, args=(marker, 1, 60, 3), timeout=240)
    assert len(ex.lost) == 1 and "ray.kill" in ex.lost[0][1]
    assert [o["rank"] for o in out] == [0, 1, 2] and {o["size"] for o in out} == {3}
    for o in out:
        assert 60 <= o["step"] < 3000 and o["step"] == out[0]["step"]
        assert o["w"].tobytes() == out[0]["w"].tobytes() and o["sizes"] == out[0]["sizes"]
    sizes = out[0]["sizes"]
    # the survivors re-form as 2, or as 3 at once when the replacement registered first
    assert sizes[:9] == [3] * 9 and sizes[-1] == 3 and set(sizes) <= {2, 3}, sizes
    lost_id = ex.lost[0][0]
    assert lost_id not in [s.worker_id for s in ex.workers] and len(ex.actors) == 3 and ex.restarts == 1
    np.testing.assert_array_equal(out[0]["w"], np.full(8, float(sum(sizes))))


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_elastic_job_below_min_workers_raises_naming_the_lost_rank(executor, tmp_path):
    ex = executor(num_workers=2, min_workers=2 - 1)
    ex.start()
    assert ex.elastic
    marker = str(tmp_path / "killed")
    killer = threading.Thread(target=lambda: (_until(marker), ray.kill(ex.actors[0]), ray.kill(ex.actors[1])),
                              daemon=True)
    killer.start()
    with pytest.raises(WorkerLostError, match=r"elastic job lost rank \d and fewer than min_workers=1 remain"):
        ex.run(elastic_steps, args=(marker, 0, 100000), timeout=120)


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_a_placement_group_that_cannot_be_placed_raises_and_leaves_nothing(executor):
    ex = executor(num_workers=2, placement_strategy="STRICT_SPREAD", start_timeout=3)  # one node only
    with pytest.raises(RingReduceError, match="was not placed within 3 s"):
        ex.start()
    assert ex.workers == [] and ex._pg is None
    ex = executor(num_workers=1, cpus_per_worker=64, start_timeout=3)
    with pytest.raises(RingReduceError, match=r"1 bundle\(s\) of \{'CPU': 64\}"):
        ex.start()


@pytest.mark.parametrize("kwargs, error, text", [
    ({"num_workers": 0}, ValueError, "num_workers=0"),
    ({"num_workers": -2}, ValueError, "num_workers=-2"),
    ({"num_workers": 2.0}, TypeError, "num_workers=2.0"),
    ({"num_workers": "4"}, TypeError, "num_workers='4'"),
    ({"num_workers": True}, TypeError, "num_workers=True"),
    ({"num_workers": 2, "cpus_per_worker": -1}, ValueError, "cpus_per_worker=-1"),
    ({"num_workers": 2, "gpus_per_worker": float("nan")}, ValueError, "gpus_per_worker=nan"),
    ({"num_workers": 2, "placement_strategy": "CLUSTER"}, ValueError, "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    ({"num_workers": 2, "min_workers": 3}, ValueError, "min_workers=3"),
    ({"num_workers": 2, "min_workers": 0}, ValueError, "min_workers=0"),
    ({"num_workers": 2, "max_restarts": 1}, ValueError, "needs an elastic job"),
    ({"num_workers": 2, "resources_per_worker": {"GPU": 1}}, ValueError, "gpus_per_worker"),
    ({"num_workers": 2, "env": {"RINGREDUCE_TIMEOUT": 5}}, TypeError, "must be strings"),
    ({"num_workers": 2, "start_timeout": 0}, ValueError, "start_timeout=0"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, error, text):
    with pytest.raises(error, match=__import__("re").escape(text)):
        RayExecutor(**kwargs)


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_run_refuses_bad_calls_before_any_worker_runs(executor):
    ex = executor(num_workers=1)
    with pytest.raises(RingReduceError, match="not started"):
        ex.run(reduce_rank_data, args=(3,))
    ex.start()
    with pytest.raises(TypeError, match="must be callable"):
        ex.run(42)
    with pytest.raises(TypeError, match="args must be a tuple"):
        ex.run(reduce_rank_data, args=3)
    with pytest.raises(RingReduceError, match="already started"):
        ex.start()
    assert ex.run(reduce_rank_data, args=(2,))[0]["size"] == 1  # still usable


@pytest.mark.slow  # a local Ray cluster, a Python process per actor
def test_the_example_in_docs_ringrun_md_runs_as_written(cluster):
    text = (REPO / "docs" / "ringrun.md").read_text().split("\n## Ray\n", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "ray.init()" in code and "executor.shutdown()" in code
    # the cluster is up already; not importable by name, the snippet's functions travel by value
    scope = {"__name__": "docs_ringrun_ray"}
    exec(compile(code.replace("ray.init()", "pass"), "docs/ringrun.md", "exec"), scope)
    weights = scope["weights"]
    assert len(weights) == 4 and weights[0].shape == (10,) and np.any(weights[0] != 0)
    assert all(w.tobytes() == weights[0].tobytes() for w in weights)
