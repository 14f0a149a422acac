"""The parameter-server baseline's arithmetic against numpy, on loopback."""
import threading

import numpy as np
import pytest

from ranks import REPO

import sys
sys.path.insert(0, str(REPO / "benchmarks"))
import ps_baseline as ps  # noqa: E402


@pytest.mark.parametrize("count,shards", [(10, 3), (2, 3), (100_003, 1), (100_003, 4)])
def test_shards_tile_the_tensor(count, shards):
    bounds = [ps.shard_bounds(count, shards, i) for i in range(shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def _run(workers, shards, count, iters, asynchronous):
    """k server threads and n worker threads on loopback; every thread must finish."""
    ports = [[] for _ in range(shards)]  # each server's port, bound by the server itself (port 0)
    readies = [threading.Event() for _ in range(shards)]
    finals, outs = [None] * shards, [None] * workers
    grads = [np.random.default_rng(w).integers(-5, 6, count).astype(np.float32) for w in range(workers)]

    def server(i):
        lo, hi = ps.shard_bounds(count, shards, i)
        finals[i] = ps.serve(0, workers, hi - lo, iters, asynchronous, readies[i], host="127.0.0.1",
                             bound=ports[i])

    def worker(w):
        outs[w] = ps.work([("127.0.0.1", p[0]) for p in ports], count, iters, grads[w], asynchronous)

    threads = [threading.Thread(target=server, args=(i,), daemon=True) for i in range(shards)]
    for t in threads:
        t.start()
    assert all(r.wait(10) for r in readies)
    threads += [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
    for t in threads[shards:]:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "the parameter server hung"
    return grads, outs, np.concatenate(finals)


@pytest.mark.parametrize("shards", [1, 3])
def test_synchronous_steps_return_the_sum_to_every_worker(shards):
    grads, outs, final = _run(workers=3, shards=shards, count=10_007, iters=2, asynchronous=False)
    want = np.sum(grads, axis=0)
    for out in outs:
        assert np.array_equal(out["result"], want) and len(out["times"]) == 2
    assert np.array_equal(final, want)


def test_asynchronous_pushes_all_land():
    grads, outs, final = _run(workers=3, shards=2, count=5_003, iters=4, asynchronous=True)
    assert np.array_equal(final, 4 * np.sum(grads, axis=0)), "every push must be applied exactly once"
    for out in outs:
        assert out["pushes_per_s"] > 0
