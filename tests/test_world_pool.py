"""The pool of reused worlds (tests/world_pool.py): it runs snippets as
run_ranks does, reuses a world only while it is fit for the next test, and
a failing or hanging snippet fails its test (naming the rank, within the
timeout) and leaves a fresh world for the next one."""
import time

import pytest

from world_pool import WorldPool


@pytest.fixture
def pool(tmp_path):
    p = WorldPool(tmp_path)
    yield p
    p.close()


def pids(ranks):
    return [r.pid for r in ranks]


def test_a_healthy_world_is_reused_and_returns_each_ranks_result(pool):
    first = pool.run(3, "result = (rr.rank(), rr.allreduce(np.full(70_001, rr.rank() + 1.0)).sum())")
    again = pool.run(3, "result = (rr.rank(), rr.size(), 'np' in dir(), result)")
    assert [r.result for r in first] == [(k, 6.0 * 70_001) for k in range(3)]
    assert [r.result for r in again] == [(k, 3, True, None) for k in range(3)], "a fresh namespace each run"
    assert pids(again) == pids(first) and pool.started == 1


def test_a_snippet_raising_on_one_rank_fails_naming_it_and_the_next_runs_on_a_fresh_world(pool):
    before = pool.run(3, "result = 1")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        pool.run(3, """
            if rr.rank() == 1:
                raise ValueError("boom on rank 1")
            rr.allreduce(np.ones(4))  # the others wait for rank 1: its exit ends their wait
        """, timeout=60)
    assert time.monotonic() - started < 30, "the peers waited out RINGREDUCE_TIMEOUT"
    said = str(failed.value)
    assert said.startswith("a rank failed: rank 1: ValueError: boom on rank 1"), said
    after = pool.run(3, "result = rr.allreduce(np.ones(2)).tolist()")
    assert [r.result for r in after] == [[3.0, 3.0]] * 3
    assert not set(pids(after)) & set(pids(before))


def test_a_hanging_snippet_times_out_and_the_next_test_gets_a_fresh_world(pool):
    before = pool.run(2, "result = 1")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="job timed out after 3 s"):
        pool.run(2, "import time\nif rr.rank() == 0:\n    time.sleep(600)\nrr.barrier()", timeout=3)
    assert time.monotonic() - started < 15
    after = pool.run(2, "result = rr.allreduce(np.ones(2)).tolist()")
    assert [r.result for r in after] == [[2.0, 2.0]] * 2
    assert not set(pids(after)) & set(pids(before))


@pytest.mark.parametrize("snippet", [
    "os.environ['RINGREDUCE_TIMEOUT'] = '1'",
    "rr.shutdown()",
    "import ringreduce.core.collectives as C\nC.allreduce = lambda *a, **k: None",
    "import threading\nthreading.Thread(target=__import__('time').sleep, args=(30,), daemon=True).start()",
], ids=["env", "shutdown", "monkeypatch", "thread"])
def test_a_snippet_leaving_the_world_unfit_gets_the_next_test_a_fresh_one(pool, snippet):
    first = pool.run(2, snippet)
    after = pool.run(2, "import ringreduce.core.collectives as C\n"
                        "result = (os.environ.get('RINGREDUCE_TIMEOUT'), rr.allreduce(np.ones(2)).tolist())")
    assert [r.result for r in after] == [(None, [2.0, 2.0])] * 2
    assert not set(pids(after)) & set(pids(first)), pool.discarded
    assert pool.started == 2


def test_process_sets_a_snippet_added_are_removed_after_it(pool):
    body = """
        ps = rr.add_process_set([0, 2])
        result = (ps.process_set_id, rr.allreduce(np.full(3, rr.rank() + 1.0), process_set=ps).tolist()
                  if ps.included() else None)
    """
    first, again = pool.run(3, body), pool.run(3, body)
    for ranks in (first, again):
        assert [r.result for r in ranks] == [(1, [4.0] * 3), (1, None), (1, [4.0] * 3)]
    assert pids(again) == pids(first), pool.discarded


def test_worlds_with_other_settings_are_other_worlds(pool):
    body = "result = os.environ.get('RINGREDUCE_SMALL_BYTES')"
    plain, ring = pool.run(2, body), pool.run(2, body, env={"RINGREDUCE_SMALL_BYTES": "0"})
    assert [r.result for r in plain] == [None] * 2 and [r.result for r in ring] == ["0"] * 2
    assert pids(pool.run(2, body)) == pids(plain) and pool.started == 2


def test_a_large_result_comes_back_whole(pool):
    ranks = pool.run(2, "result = np.full(4 << 20, rr.rank(), np.float64)", timeout=60)  # 32 MiB a rank
    for r in ranks:
        assert r.result.shape == (4 << 20,) and (r.result == r.rank).all()
