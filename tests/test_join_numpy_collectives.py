"""rr.join() beside the numpy collectives: ranks with different numbers of
batches call rr.allreduce directly, then rr.join() (the README's loop); a
joined rank's engine answers each allreduce with zeros (the op's identity
for min, max, prod), avg still dividing by every rank (Horovod's join).
Every other direct collective beside a joined rank raises MismatchError on
the ranks that called it, and the joined rank stays joined."""
import pickle

import numpy as np

import pytest

from ranks import run_ranks

README_LOOP = """
STEPS = [int(s) for s in os.environ["STEPS"].split(",")]
n, me = rr.size(), rr.rank()
CASES = [("float32", 17, "avg"), ("float32", 17, "sum"), ("int32", 5, "sum"), ("float16", 9, "avg"),
         ("float64", 3, "max"), ("int64", 4, "min"), ("float32", 400_000, "sum"), ("float64", 200_000, "avg")]
def batch(rank, step, dt, count, op):
    sign = -1 if op == "max" else 1      # a joined rank's zeros would win a max of negatives: it adds -inf
    return np.full(count, sign * (rank + 1) * (step + 1) * 3, dtype=dt)
got, wrong = [], []
for step in range(STEPS[me]):
    for i, (dt, count, op) in enumerate(CASES):
        r = rr.allreduce(batch(me, step, dt, count, op), op=op, name=f"case{i}")
        active = [batch(q, step, dt, count, op) for q in range(n) if STEPS[q] > step]
        total = np.sum(active, axis=0, dtype=np.float64)
        want = {"sum": total, "avg": total / n if dt[0] == "f" else total // n,
                "max": np.max(active, axis=0), "min": np.min(active, axis=0)}[op].astype(dt)
        if not np.array_equal(r, want):
            wrong.append((step, dt, count, op, r[:3].tolist(), want[:3].tolist()))
        got.append(r.tobytes())
last = rr.join()
result = (wrong, last, got)
"""


# (the small path's pass meets the joined rank's negotiation in the host arena, or around the ring without it)
@pytest.mark.parametrize("n,steps,last,arena", [(2, "3,1", 0, True), (2, "1,4", 1, True), (3, "2,4,6", 2, True),
                                                (3, "5,1,3", 0, True), (3, "4,1,2", 0, False)])
def test_the_readme_loop_of_direct_allreduces_goes_on_past_a_joined_rank(tmp_path, n, steps, last, arena):
    env = {"STEPS": steps, **({} if arena else {"RINGREDUCE_ARENA_BYTES": "0"})}
    ranks = run_ranks(n, README_LOOP, tmp_path, env=env, timeout=180)
    counts = [int(s) for s in steps.split(",")]
    for r in ranks:
        wrong, got_last, got = r.result
        assert wrong == [], f"rank {r.rank}: {wrong}"
        assert got_last == last, f"rank {r.rank}: join returned {got_last}, the last to join was {last}"
    for r in ranks:  # bit-identical on every rank that ran the step
        for q in ranks:
            k = min(counts[r.rank], counts[q.rank]) * 8
            assert r.result[2][:k] == q.result[2][:k], f"ranks {r.rank} and {q.rank} differ"


def test_other_direct_collectives_beside_a_joined_rank_fail_on_their_callers_and_join_goes_on(tmp_path):
    ranks = run_ranks(3, """
        from ringreduce.engine import engine
        errors = {}
        if rr.rank() == 0:
            last = rr.join()
        else:
            calls = {
                "allgather": lambda: rr.allgather(np.ones((rr.rank(), 2))),
                "broadcast": lambda: rr.broadcast(np.ones(3), root=1),
                "big broadcast": lambda: rr.broadcast(np.ones(100_000), root=2),
                "reduce_scatter": lambda: rr.reduce_scatter(np.ones(6)),
                "alltoall": lambda: rr.alltoall(np.arange(6.0)),
                "barrier": lambda: rr.barrier(),
                "unlike allreduces": lambda: rr.allreduce(np.ones(3 + rr.rank())),
            }
            for what, call in calls.items():
                try:
                    call()
                    errors[what] = "ran"
                except rr.MismatchError as e:
                    errors[what] = str(e)
            ok = rr.allreduce(np.full(4, 2.0), op="avg").tolist()   # the ring still pairs after every refusal
            errors["after"] = ok
            last = rr.join()
        after = engine().wait(engine().enqueue("x", np.ones(2), op="sum")).tolist()
        result = (errors, last, after)
    """, tmp_path, timeout=120)
    for r in ranks:
        errors, last, after = r.result
        assert last in (1, 2) and after == [3.0, 3.0], r.result
        if r.rank == 0:
            continue
        for what in ("allgather", "broadcast", "big broadcast", "reduce_scatter", "alltoall", "barrier"):
            kind = what.split()[-1]
            assert f"{kind} cannot run while rank(s) 0 have joined" in errors[what], (what, errors[what])
        assert "shape" in errors["unlike allreduces"] and "rank 1" in errors["unlike allreduces"], errors
        assert errors["after"] == [4 / 3] * 4, errors["after"]   # (2 + 2 + 0) / 3: the joined rank's zeros


MPI_JOB = """
import os, pickle, sys
import numpy as np
import ringreduce as rr
rr.init(backend="mpi")
exec(os.environ["BODY"])
with open(f"{sys.argv[1]}.rank{rr.rank()}.pkl", "wb") as f:
    pickle.dump(result, f)
"""


def _mpi_results(tmp_path, body, n, env):
    """Runs body (MPI_JOB) on n ranks under mpirun; each rank's `result`."""
    import subprocess
    import sys
    from test_mpi import MPIRUN, _missing
    from ranks import REPO
    if _missing() is not None:
        pytest.skip(_missing())
    job = tmp_path / "job.py"
    job.write_text(MPI_JOB)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "BODY": body, **env}
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, str(job), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [pickle.loads((tmp_path / f"out.rank{r}.pkl").read_bytes()) for r in range(n)]


def test_the_readme_loop_over_mpi_where_small_allreduces_double(tmp_path):
    # Over MPI without the host arena, small allreduces run by recursive doubling: its pass meets the
    # joined rank's negotiation there, and the others learn of the join from the headers it gathered.
    results = _mpi_results(tmp_path, README_LOOP, 3, {"STEPS": "2,5,3", "RINGREDUCE_ARENA_BYTES": "0"})
    for r, (wrong, last, got) in enumerate(results):
        assert wrong == [] and last == 1, (r, wrong, last)
    assert results[0][2] == results[1][2][:len(results[0][2])] == results[2][2][:len(results[0][2])]


def test_a_direct_allreduce_beside_a_rank_that_left_fails_naming_it(tmp_path):
    # A rank that shuts down (Engine.leave, the TF layer's shutdown) is no joined rank: no zeros stand in for it.
    ranks = run_ranks(2, """
        from ringreduce.engine import engine
        if rr.rank() == 0:
            engine().leave()
            result = "left"
        else:
            try:
                rr.allreduce(np.ones(3))
                result = "ran"
            except rr.MismatchError as e:
                result = str(e)
            rr.join()
    """, tmp_path, timeout=60)
    assert ranks[0].result == "left"
    assert "allreduce cannot run: rank(s) 0 have shut down" in ranks[1].result, ranks[1].result


@pytest.mark.parametrize("arena", [True, False])
def test_an_out_that_overlaps_its_input_gets_the_sum_of_the_inputs_beside_a_joined_rank(tmp_path, arena):
    # The small path's pass meets the joined rank's negotiation, so the allreduce goes on by the ring:
    # x (buf[0:6]) must still hold its values then, though out (buf[2:8]) overlaps it.
    ranks = run_ranks(3, """
        if rr.rank() == 2:
            rr.join()
            result = None
        else:
            buf = np.arange(10.0) * (rr.rank() + 1)
            rr.allreduce(buf[0:6], op="sum", out=buf[2:8])
            rr.join()
            result = buf.tolist()
    """, tmp_path, env={} if arena else {"RINGREDUCE_ARENA_BYTES": "0"}, timeout=120)
    for r in ranks[:2]:
        mine = np.arange(10.0) * (r.rank + 1)
        want = np.concatenate([mine[:2], np.arange(6.0) * 3, mine[8:]])
        assert r.result == want.tolist(), f"rank {r.rank}: {r.result}"


OVERLAP_BODY = """
if rr.rank() == rr.size() - 1:
    rr.join()
    result = None
else:
    buf = np.arange(10.0) * (rr.rank() + 1)
    rr.allreduce(buf[0:6], op="sum", out=buf[2:8])
    rr.join()
    result = buf.tolist()
"""


def test_an_out_that_overlaps_its_input_over_mpi_where_small_allreduces_double(tmp_path):
    # Recursive doubling writes out as its rounds go; the joined rank's header, seen in a late round,
    # sends the allreduce to the ring, which must still find x as the caller gave it.
    results = _mpi_results(tmp_path, OVERLAP_BODY, 4, {"RINGREDUCE_ARENA_BYTES": "0"})
    for r, got in enumerate(results[:3]):
        mine = np.arange(10.0) * (r + 1)
        assert got == np.concatenate([mine[:2], np.arange(6.0) * 6, mine[8:]]).tolist(), (r, got)


def test_a_joined_rank_stays_joined_while_the_others_disagree_among_themselves(tmp_path):
    # Rank 1's engine negotiates while rank 2 calls a direct allreduce: both of them raise, and rank 0,
    # joined with nothing of its own, keeps waiting for them to join.
    ranks = run_ranks(3, """
        from ringreduce.engine import engine
        if rr.rank() == 0:
            result = ("joined", rr.join())
        else:
            try:
                if rr.rank() == 1:
                    engine().wait(engine().enqueue("a", np.ones(3)))
                else:
                    rr.allreduce(np.ones(3))
                result = "ran"
            except rr.MismatchError as e:
                result = "mismatch"
            rr.join()
    """, tmp_path, timeout=120)
    assert ranks[0].result[0] == "joined", ranks[0].result
    assert [r.result for r in ranks[1:]] == ["mismatch", "mismatch"]


def test_adding_or_removing_a_process_set_beside_a_joined_rank_fails_naming_it_and_works_after_join(tmp_path):
    # add_process_set and remove_process_set are passes of the world's ring that every rank must run: beside a
    # joined rank they fail on the ranks that called them, saying which call and which rank joined; the joined
    # rank stays joined, and once join() returns every rank adds and removes sets as before.
    ranks = run_ranks(3, """
        kept = rr.add_process_set([0, 2])
        errors = []
        if rr.rank() == 0:
            last = rr.join()
        else:
            for call in (lambda: rr.add_process_set([1, 2]), lambda: rr.remove_process_set(kept)):
                try:
                    call()
                    errors.append("ran")
                except rr.MismatchError as e:
                    errors.append(str(e))
            ok = rr.allreduce(np.full(2, 3.0)).tolist()   # the world's ring still pairs: (3 + 3 + 0)
            last = rr.join()
        ps = rr.add_process_set([0, 1])
        got = rr.allreduce(np.full(2, rr.rank() + 1.0), process_set=ps).tolist() if rr.rank() < 2 else None
        removed = rr.remove_process_set(kept)
        result = (errors, last, got, removed, ok if rr.rank() else None)
    """, tmp_path, timeout=120)
    for r in ranks:
        errors, last, got, removed, ok = r.result
        assert last in (1, 2) and removed is True, r.result
        if r.rank < 2:
            assert got == [3.0, 3.0], r.result
        if r.rank == 0:
            continue
        assert ok == [6.0, 6.0], r.result
        assert len(errors) == 2, errors
        for what, e in zip(("add_process_set", "remove_process_set"), errors):
            assert what in e and "rank(s) 0 have joined" in e, e


SET_BESIDE_JOINED = """
import time
from ringreduce.engine import engine
ps = rr.add_process_set([0, 1, 2])              # rank 0 joins; ranks 1 and 2 go on in the set, rank 3 is outside it
me = rr.rank()
HOG = os.environ.get("HOG") == "1"
if HOG:                                          # a CPU hog beside: the serving passes must not depend on timing
    import multiprocessing
    hog = multiprocessing.Process(target=lambda: [None for _ in iter(int, 1)], daemon=True)
    hog.start()
got, errors = [], {}
if me == 0:
    last = rr.join()
else:
    if me in (1, 2):
        for i, (dt, count, op) in enumerate([("float32", 5, "sum"), ("float32", 5, "avg"), ("int64", 3, "sum"),
                                              ("float64", 300_000, "avg"), ("float32", 7, "max"),
                                              ("int32", 4, "min")]):
            x = np.full(count, (me + 1) * (-1 if op == "max" else 1), dtype=dt)
            got.append((rr.allreduce(x, op=op, name=f"s{i}", process_set=ps).tolist(), dt, count, op))
        calls = {
            "allgather": lambda: rr.allgather(np.ones((me, 2)), process_set=ps),
            "broadcast": lambda: rr.broadcast(np.ones(3), root=1, process_set=ps),
            "barrier": lambda: rr.barrier(process_set=ps),
            "reduce_scatter": lambda: rr.reduce_scatter(np.ones(6), process_set=ps),
            "alltoall": lambda: rr.alltoall(np.arange(6.0), process_set=ps),
            "unlike allreduces": lambda: rr.allreduce(np.ones(3 + me), process_set=ps),
        }
        for what, call in calls.items():
            try:
                call()
                errors[what] = "ran"
            except rr.MismatchError as e:
                errors[what] = str(e)
        # the engine's allreduces on the set, plain and compressed, beside the joined member's engine
        from ringreduce.compression import Int8
        eng = engine()
        got.append((eng.wait(eng.enqueue("e", np.full(4, float(me)), op="sum", process_set=ps)).tolist(),
                    "engine", 4, "sum"))
        got.append((eng.wait(eng.enqueue("c", np.full((16, 16), float(me), np.float32), op="avg",
                                         process_set=ps, compression=Int8())).mean().tolist(), "int8", 1, "avg"))
        got.append((rr.allreduce(np.full(2, 10.0 * me), process_set=ps).tolist(), "after", 2, "sum"))
    # the world's ring still pairs (through the engine: rank 3's negotiates meanwhile, where a direct
    # collective of its own would meet the others' engines)
    world = engine().wait(engine().enqueue("w", np.full(2, float(me)), op="sum")).tolist()
    got.append((world, "world", 2, "sum"))
    last = rr.join()
after = rr.allreduce(np.full(2, me + 1.0), process_set=ps).tolist() if me < 3 else None
result = (got, errors, last, after)
"""


# (the set's passes meet in its host arena, or around its ring without one)
@pytest.mark.parametrize("hog,arena", [(False, True), (True, True), (False, False)])
def test_a_process_sets_collectives_beside_a_joined_member_go_on_as_the_worlds(tmp_path, hog, arena):
    env = {"HOG": "1" if hog else "0", **({} if arena else {"RINGREDUCE_ARENA_BYTES": "0"})}
    ranks = run_ranks(4, SET_BESIDE_JOINED, tmp_path, env=env, timeout=180)
    live = {1: 2.0, 2: 3.0}   # me + 1 on the set's live members; rank 0 adds zeros (the op's identity)
    for r in ranks:
        got, errors, last, after = r.result
        assert last in (1, 2, 3), r.result
        if r.rank < 3:
            assert after == [6.0, 6.0], (r.rank, after)   # 1 + 2 + 3 once everyone has returned from join
        if r.rank in (1, 2):
            want = {"s0": [5.0] * 5, "s1": [5.0 / 3] * 5, "s2": [5] * 3, "s3": [5.0 / 3] * 300_000,
                    "s4": [-2.0] * 7, "s5": [2] * 4}
            for i, (values, dt, count, op) in enumerate(got[:6]):
                assert np.allclose(values, want[f"s{i}"], rtol=1e-6, atol=0), (r.rank, i, values[:3])
            assert got[6][0] == [3.0] * 4, got[6]                   # 1 + 2 + 0 through the engine
            assert abs(got[7][0] - 1.0) < 0.02, got[7]                # (1 + 2 + 0) / 3, int8-compressed
            assert got[8][0] == [30.0, 30.0], got[8]
            for what, e in errors.items():
                if what == "unlike allreduces":
                    assert "shape" in e and "world rank 1" in e and "world rank(s) 0" in e, e
                else:
                    assert f"{what} cannot run while world rank(s) 0 have joined" in e, (what, e)
        if r.rank:
            assert got[-1][0] == [6.0, 6.0], got[-1]                  # 1 + 2 + 3 + 0 on the world's ring
    assert ranks[1].result[0] == ranks[2].result[0]                  # bit-identical on the set's live members


def test_a_joined_member_waits_on_a_set_idle_past_the_timeout(tmp_path):
    # The members with data run only world collectives for longer than RINGREDUCE_TIMEOUT before their next
    # collective on the set: the joined member's serving pass on the set's ring waits for it, never timing out.
    ranks = run_ranks(3, """
        import time
        ps = rr.add_process_set([0, 1])
        if rr.rank() == 0:
            rr.join()
            result = None
        else:
            t = time.monotonic()
            while time.monotonic() - t < 4:
                rr.allreduce(np.ones(2))
                time.sleep(0.1)
            result = rr.allreduce(np.full(3, 5.0), process_set=ps).tolist() if rr.rank() == 1 else None
            rr.join()
    """, tmp_path, env={"RINGREDUCE_TIMEOUT": "2"}, timeout=120)
    assert ranks[1].result == [5.0, 5.0, 5.0]


def test_a_process_sets_allreduce_beside_a_joined_member_over_mpi(tmp_path):
    # Over MPI a set's ring is a split of the world's communicator; its serving pass waits there the same way.
    results = _mpi_results(tmp_path, SET_BESIDE_JOINED, 4, {"HOG": "0", "RINGREDUCE_TIMEOUT": "20"})
    for r, (got, errors, last, after) in enumerate(results):
        assert last in (1, 2, 3) and (after == [6.0, 6.0] if r < 3 else after is None), (r, last, after)
        if r in (1, 2):
            assert got[0][0] == [5.0] * 5 and got[6][0] == [3.0] * 4 and got[8][0] == [30.0, 30.0], (r, got[:1])
            assert "allgather cannot run while world rank(s) 0 have joined" in errors["allgather"], errors
    assert results[1][0] == results[2][0]


def test_a_process_sets_allreduce_beside_a_member_that_left_fails_naming_it(tmp_path):
    # A member that shuts down (Engine.leave) serves its sets as a leaving one: no zeros stand in for it.
    ranks = run_ranks(3, """
        from ringreduce.engine import engine
        ps = rr.add_process_set([0, 1])
        if rr.rank() == 0:
            engine().leave()
            result = "left"
        elif rr.rank() == 1:
            try:
                rr.allreduce(np.ones(3), process_set=ps)
                result = "ran"
            except rr.MismatchError as e:
                result = str(e)
            rr.join()
        else:
            result = rr.join()
    """, tmp_path, timeout=60)
    assert ranks[0].result == "left"
    assert "allreduce cannot run: world rank(s) 0 have shut down" in ranks[1].result, ranks[1].result


def test_a_join_that_fails_stops_standing_in_on_its_process_sets(tmp_path):
    # Rank 0's join() fails (its engine's negotiation raises once, while its serving pass waits on the
    # set's ring). Were that pass left running, it would answer rank 1's next allreduce on the set with
    # zeros, as if rank 0 were still joined: rank 1 would get its own data back as the sum.
    ranks = run_ranks(3, """
        import threading, time
        from ringreduce import engine as E
        ps = rr.add_process_set([0, 1])
        if rr.rank() == 0:
            eng = E.engine()
            real, calls = eng.negotiator.negotiate, []
            def fails_once(*a, **k):
                if not calls:
                    calls.append(1)
                    time.sleep(0.5)  # the serving pass is in the set's ring by now
                    raise rr.MismatchError("injected")
                return real(*a, **k)
            eng.negotiator.negotiate = fails_once
            try:
                rr.join()
                joined = "returned"
            except rr.MismatchError as e:
                joined = str(e)
            serving = [t.name for t in threading.enumerate() if t.name.startswith("ringreduce-joined-set")]
            try:
                rr.allreduce(np.ones(3), process_set=ps)
                after = "ran"
            except rr.RingReduceError as e:
                after = type(e).__name__
            result = (joined, serving, after)
        elif rr.rank() == 1:
            time.sleep(2)
            try:
                result = ("ran", rr.allreduce(np.ones(3), process_set=ps).tolist())
            except rr.RingReduceError as e:
                result = (type(e).__name__, str(e))
        else:
            result = None
        world = rr.allreduce(np.ones(1)).tolist()  # the world's ring goes on
        rr.remove_process_set(ps)  # and the set, removed and added again, works
        ps = rr.add_process_set([0, 1])
        again = rr.allreduce(np.ones(3), process_set=ps).tolist() if rr.rank() < 2 else None
        result = (result, world, again)
    """, tmp_path, timeout=90)
    joined, serving, after = ranks[0].result[0]
    assert "injected" in joined and serving == [] and after != "ran", ranks[0].result
    kind, said = ranks[1].result[0]
    assert kind != "ran" and "rank 0" in said, ranks[1].result
    assert [r.result[1:] for r in ranks] == [([3.0], [2.0] * 3), ([3.0], [2.0] * 3), ([3.0], None)]
