"""rr.join(), Horovod's hvd.join(): a rank out of data joins; the others'
allreduces go on with it adding zeros (avg still divides by every rank);
join() returns, on every rank, the rank that joined last."""
import pytest

from ranks import run_ranks

UNEVEN_JOB = """
from ringreduce.engine import engine
STEPS = [int(s) for s in os.environ["STEPS"].split(",")]
n, me = rr.size(), rr.rank()
def grad(rank, step, dtype, shape, op):
    sign = -1 if op == "max" else 1   # a joined rank's zeros would win a max of negatives: it adds -inf
    return np.full(shape, sign * (rank + 1) * (step + 1) * 3, dtype=dtype)
wrong, errors = [], {}
for step in range(STEPS[me]):
    handles = {(dt, op): engine().enqueue(f"g/{dt}/{op}", grad(me, step, dt, (5, 3) if dt == "float64" else (17,), op), op=op)
               for dt in ("float64", "int32", "float16") for op in ("avg", "sum", "max")}
    for (dt, op), h in handles.items():
        got = engine().wait(h)
        active = [grad(r, step, dt, got.shape, op) for r in range(n) if STEPS[r] > step]
        total = np.sum(active, axis=0, dtype=np.float64)
        want = {"sum": total, "avg": total / n if dt != "int32" else total // n, "max": np.max(active, axis=0)}[op]
        if not np.array_equal(got, want.astype(dt)):
            wrong.append((step, dt, op, got.ravel()[:3].tolist(), want.ravel()[:3].tolist()))
    if step == min(STEPS):   # somebody has joined by now: only allreduce goes on
        for kind in ("allgather", "broadcast"):
            try:
                engine().wait(engine().enqueue(f"{kind}/{step}", np.ones(3), kind=kind))
                errors[kind] = "ran"
            except rr.MismatchError as e:
                errors[kind] = str(e)
last = rr.join()
after = engine().wait(engine().enqueue("after", np.full(4, me + 1.0), op="sum")).tolist()
result = (wrong, last, errors, after)
"""


@pytest.mark.parametrize("steps,last", [("2,4,6", 2), ("5,1,3", 0), ("3,6,1", 1)])
def test_ranks_run_out_of_data_at_different_steps_and_the_rest_go_on(tmp_path, steps, last):
    ranks = run_ranks(3, UNEVEN_JOB, tmp_path, env={"STEPS": steps}, timeout=180)
    first_out = min(range(3), key=lambda r: int(steps.split(",")[r]))
    for r in ranks:
        wrong, got_last, errors, after = r.result
        assert wrong == [], f"rank {r.rank}: {wrong}"
        assert got_last == last, f"rank {r.rank}: join returned {got_last}, the last to join was {last}"
        assert after == [6.0] * 4, "after every rank joined the engine must work as before"
        if int(steps.split(",")[r.rank]) > int(steps.split(",")[first_out]):
            for kind in ("allgather", "broadcast"):
                assert "joined" in errors[kind] and f"rank(s) {first_out}" in errors[kind], errors


def test_every_rank_joining_at_once_returns_the_same_rank_everywhere(tmp_path):
    ranks = run_ranks(2, "result = (rr.join(), rr.join())", tmp_path, timeout=60)
    assert ranks[0].result == ranks[1].result and all(v in (0, 1) for v in ranks[0].result)


def test_a_direct_allreduce_beside_a_joined_rank_runs_with_its_zeros_and_the_engine_goes_on(tmp_path):
    ranks = run_ranks(2, """
        from ringreduce.engine import engine
        first = None
        if rr.rank() == 0:
            last = rr.join()
        else:
            first = rr.allreduce(np.ones(3)).tolist()   # outside the engine: rank 0 adds zeros
            last = rr.join()
        after = engine().wait(engine().enqueue("x", np.ones(2), op="sum")).tolist()
        result = (first, last, after)
    """, tmp_path, timeout=60)
    assert ranks[1].result[0] == [1.0, 1.0, 1.0]
    for r in ranks:
        _, last, after = r.result
        assert last == 1 and after == [2.0, 2.0], r.result
