"""Process sets (ringreduce/core/process_sets.py): collectives among some ranks,
on the socket backend (shared-memory and TCP links) and under mpirun, every
result against numpy and bit-identical across a set's members; the errors."""
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from ranks import PRELUDE, REPO, run_ranks

SETS = [[0, 2], [1, 3], [0, 1, 2], [3]]

# Every collective on each set this rank belongs to, against numpy; the
# global set in between; then two sets sharing ranks 0 and 2, interleaved.
def check_sets(sets: list) -> str:
    """The job body: each rank checks the sets it belongs to; the ids must be 1, 2, ..."""
    return CHECK_SETS.replace("SETS_HERE", repr(sets))


CHECK_SETS = """
    import hashlib
    import ml_dtypes
    r = rr.rank()
    sets = [rr.add_process_set(s) for s in SETS_HERE]
    checks, digests = {}, {}

    def record(key, got, want):
        checks[key] = bool(np.array_equal(got, want)) and got.dtype == np.asarray(want).dtype
        digests[key] = hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest()

    def check(ps):
        m, n, sid = ps.ranks, ps.size(), ps.process_set_id
        checks[(sid, "rank")] = ps.included() and m[ps.rank()] == r and n == len(m)
        for count in [0, 1, n + 1, 300_001]:
            for dtype in [np.float32, np.int64, ml_dtypes.bfloat16]:
                mine = (np.arange(count) % 7 + r).astype(dtype)
                want = sum((np.arange(count) % 7 + k).astype(np.float64) for k in m).astype(dtype)
                record((sid, "allreduce", count, np.dtype(dtype).name), rr.allreduce(mine, process_set=ps), want)
            x = np.arange(count, dtype=np.float64) + r
            full = sum(np.arange(count, dtype=np.float64) + k for k in m)
            record((sid, "avg", count), rr.allreduce(x, op="avg", process_set=ps), full / n)
            base, extra = divmod(count, n)
            i = ps.rank()
            lo = i * base + min(i, extra)
            record((sid, "reduce_scatter", count), rr.reduce_scatter(x, process_set=ps),
                   full[lo:lo + base + (i < extra)])
            parts = {k: np.full((count + k, 2), k, dtype=np.int32) for k in m}
            record((sid, "allgather", count), rr.allgather(parts[r], process_set=ps),
                   np.concatenate([parts[k] for k in m]))
            for root in m:
                record((sid, "broadcast", count, root), rr.broadcast(x, root=root, process_set=ps),
                       np.arange(count, dtype=np.float64) + root)
        rr.barrier(process_set=ps)

    for ps in sets:
        if ps.included():
            check(ps)
        record(("global", ps.process_set_id), rr.allreduce(np.full(100_000, r + 1.0)),
               np.full(100_000, sum(range(1, rr.size() + 1)), dtype=np.float64))
    pair, trio = sets[0], sets[min(2, len(sets) - 1)]
    for step in range(3):  # members of both sets alternate between them (ranks 0 and 2 of 4)
        for ps in (pair, trio):
            if ps.included():
                x = np.full(70_000 * (step + 1), float(r + step))
                record((ps.process_set_id, "interleaved", step), rr.allreduce(x, process_set=ps),
                       np.full(x.size, float(sum(k + step for k in ps.ranks))))
    result = {"ids": [ps.process_set_id for ps in sets], "checks": checks, "digests": digests}
"""


def _assert_sets_correct(results, sets=SETS):
    assert all(res["ids"] == list(range(1, len(sets) + 1)) for res in results), [res["ids"] for res in results]
    for r, res in enumerate(results):
        wrong = [case for case, ok in res["checks"].items() if not ok]
        assert not wrong, f"rank {r}: {wrong[:5]} differ from numpy"
        want_sets = [i + 1 for i, s in enumerate(sets) if r in s]
        assert sorted({case[0] for case in res["checks"] if case[0] != "global"}) == want_sets
    for set_id, members in enumerate(sets, start=1):
        for case, digest in results[members[0]]["digests"].items():
            if case[0] == set_id and case[1] != "reduce_scatter":  # each member holds its own chunk
                for k in members:
                    assert results[k]["digests"][case] == digest, f"{case}: rank {k} differs from rank {members[0]}"


LINKS = {"shm": {"RINGREDUCE_SHM_BYTES": "65536"}, "tcp": {"RINGREDUCE_SHM_BYTES": "0"}}


@pytest.mark.parametrize("links", list(LINKS))
def test_every_collective_on_each_set_matches_numpy(world_pool, links):
    ranks = world_pool.run(4, check_sets(SETS) + """
    from ringreduce.core.communicator import current as _state
    result["links"] = [_state.sets[ps.process_set_id].comm.links for ps in sets if ps.included() and ps.size() > 1]
""", timeout=240, env=LINKS[links])
    _assert_sets_correct([r.result for r in ranks])
    for r in ranks:  # every sub-ring link of these local ranks is of the kind asked for
        assert r.result["links"] and all(k == {"next": links, "prev": links} for k in r.result["links"]), r.result


@pytest.mark.parametrize("n, sets", [(2, [[0], [1]]), (3, [[0, 2], [1], [1, 2]])])
def test_sets_on_smaller_worlds(world_pool, n, sets):
    ranks = world_pool.run(n, check_sets(sets), timeout=180)
    _assert_sets_correct([r.result for r in ranks], sets)


def test_errors_of_sets_on_every_rank(world_pool):
    ranks = world_pool.run(4, """
        r = rr.rank()
        out = {}
        pair = rr.add_process_set([0, 2])
        solo = rr.add_process_set(rr.ProcessSet([3]))
        assert str(rr.global_process_set) == "ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3], mpi_comm=None)"
        assert str(pair) == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)"

        def error(fn):
            try:
                fn()
                return None
            except Exception as e:
                return (type(e).__name__, str(e))

        # A non-member's call fails at once, locally; the members go on undisturbed.
        out["nonmember"] = error(lambda: rr.allreduce(np.ones(3), process_set=pair if r in (1, 3) else solo))
        out["nonmember_rank"] = error(lambda: (pair if r in (1, 3) else solo).rank())
        if r in (0, 2):
            out["pair"] = rr.allreduce(np.full(5, r + 1.0), process_set=pair).tolist()
            out["root_outside"] = error(lambda: rr.broadcast(np.ones(2), root=1, process_set=pair))
            out["set_mismatch"] = error(lambda: rr.allreduce(np.ones(3 + r), process_set=pair))
            out["set_refused"] = error(lambda: rr.allreduce(np.ones(3, np.complex64 if r == 2 else np.float32),
                                                            process_set=pair))
            out["pair_still"] = rr.allreduce(np.full(2, r + 1.0), process_set=pair).tolist()
        out["unregistered"] = error(lambda: rr.allreduce(np.ones(3), process_set=rr.ProcessSet([0, 2])))
        out["not_a_set"] = error(lambda: rr.allreduce(np.ones(3), process_set=[0, 2]))
        # Duplicates of a registered set, the global one included, and bad ranks: ValueError everywhere.
        out["duplicate"] = error(lambda: rr.add_process_set([2, 0]))
        out["global_again"] = error(lambda: rr.add_process_set(range(4)))
        out["out_of_range"] = error(lambda: rr.add_process_set([0, 4]))
        out["one_bad"] = error(lambda: rr.add_process_set([0, 1] if r != 1 else ["x"]))
        # Ranks that disagree: MismatchError everywhere, and the world goes on.
        out["mismatch"] = error(lambda: rr.add_process_set([0, 1] if r == 0 else [0, 3]))
        out["world_after"] = rr.allreduce(np.ones(3)).tolist()
        # Remove, use after removal, add again (the id is reused), remove the global set.
        out["remove_global"] = rr.remove_process_set(rr.global_process_set)
        out["removed"] = rr.remove_process_set(pair)
        out["id_after_remove"] = pair.process_set_id
        out["use_removed"] = error(lambda: rr.allreduce(np.ones(3), process_set=pair))
        out["remove_twice"] = error(lambda: rr.remove_process_set(pair))
        trio = rr.add_process_set([0, 1, 2])
        out["trio_id"] = trio.process_set_id
        out["remove_mismatch"] = error(lambda: rr.remove_process_set(solo if r == 0 else trio))
        out["remove_unknown"] = error(lambda: rr.remove_process_set(trio if r != 3 else rr.ProcessSet([1, 2])))
        again = rr.add_process_set(pair)
        out["readded_id"] = again.process_set_id
        if r in (0, 2):
            out["pair_again"] = rr.allreduce(np.full(200_000, r + 1.0), process_set=pair)[[0, -1]].tolist()
        out["world_end"] = rr.allreduce(np.ones(3)).tolist()
        rr.shutdown()
        out["after_shutdown"] = (pair.process_set_id, solo.process_set_id)
        result = out
    """, timeout=120)
    for r, res in enumerate(x.result for x in ranks):
        kind, message = res["nonmember"]
        assert kind == "ValueError" and f"rank {r} is not a member" in message, message
        assert res["nonmember_rank"][0] == "ValueError"
        if r in (0, 2):
            assert res["pair"] == [4.0] * 5 and res["pair_again"] == [4.0, 4.0]
            assert res["root_outside"][0] == "ValueError" and "not a member" in res["root_outside"][1]
            kind, message = res["set_mismatch"]  # named by world rank and rank in the set
            assert kind == "MismatchError" and "world rank 0 (rank 0 of set 1): (3,)" in message, message
            assert "world rank 2 (rank 1 of set 1): (5,)" in message and not _bare_ranks(message), message
            kind, message = res["set_refused"]  # rank 2's own TypeError; rank 0 names it
            assert kind == ("TypeError" if r == 2 else "MismatchError"), res["set_refused"]
            if r == 0:
                assert "world rank 2 (rank 1 of set 1): " in message and not _bare_ranks(message), message
            assert res["pair_still"] == [4.0, 4.0]
        assert res["unregistered"][0] == "ValueError" and "not registered" in res["unregistered"][1]
        assert res["not_a_set"][0] == "TypeError"
        assert res["duplicate"][0] == "ValueError" and "already process set 1" in res["duplicate"][1]
        assert res["global_again"][0] == "ValueError" and "global" in res["global_again"][1]
        assert res["out_of_range"][0] == "ValueError" and "world of 4" in res["out_of_range"][1]
        assert res["one_bad"][0] == "ValueError" and "rank 1:" in res["one_bad"][1], res["one_bad"]
        kind, message = res["mismatch"]
        assert kind == "MismatchError" and "rank 0: [0, 1]" in message and "rank 3: [0, 3]" in message, message
        assert res["world_after"] == [4.0] * 3 and res["world_end"] == [4.0] * 3
        assert res["remove_global"] is False and res["removed"] is True and res["id_after_remove"] is None
        assert res["use_removed"][0] == "ValueError"
        assert res["remove_twice"][0] == "ValueError" and "not a registered" in res["remove_twice"][1]
        kind, message = res["remove_mismatch"]
        assert kind == "MismatchError" and "rank 0: ProcessSet(process_set_id=2, ranks=[3]" in message, message
        assert "rank 1: ProcessSet(process_set_id=1, ranks=[0, 1, 2]" in message, message
        kind, message = res["remove_unknown"]
        assert kind == "ValueError" and "rank 3:" in message and "not a registered" in message, message
        assert res["trio_id"] == 1 and res["readded_id"] == 3  # the lowest free id, as Horovod's
        assert res["after_shutdown"] == (None, None)


@pytest.mark.parametrize("links", list(LINKS))
def test_a_killed_member_is_named_on_the_other_members(tmp_path, links):
    ranks = run_ranks(4, """
        import os, signal, time
        trio = rr.add_process_set([1, 2, 3])
        x = np.ones(1 << 20, dtype=np.float32)
        if trio.included():
            try:
                for i in range(1000):
                    if rr.rank() == 2 and i == 3:
                        os.kill(os.getpid(), signal.SIGKILL)
                    rr.allreduce(x, process_set=trio)
                result = "no error"
            except rr.PeerLostError as e:
                result = (e.rank, getattr(e, "set_rank", None), str(e))
        else:
            time.sleep(3)
            result = "outside"
    """, tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "20", **LINKS[links]}, check=False)
    assert ranks[2].returncode == -signal.SIGKILL
    assert ranks[0].returncode == 0 and ranks[0].result == "outside", ranks[0].stderr
    for r in (1, 3):
        assert ranks[r].returncode == 0, ranks[r].stderr
        lost, set_rank, message = ranks[r].result
        assert (lost, set_rank) == (2, 1), (r, ranks[r].result)
        assert "process set 1" in message and "lost world rank 2 (rank 1 of set 1)" in message, message
        assert not _bare_ranks(message), message


def _bare_ranks(message: str) -> list:
    """Every "rank N" of a set's error that leaves open whose numbering N is in."""
    return [m.group(0) for m in re.finditer(r"(?<!world )\brank \d+(?! of set)", message)]


# What the C core says (in the set's numbering) -> what the user reads, for the set [1, 2, 3] (id 4).
SET_MESSAGES = {
    "lost rank 1: no progress for 3.0 s (RINGREDUCE_TIMEOUT); rank 2 was waiting on rank 1":
        "lost world rank 2 (rank 1 of set 4): no progress for 3.0 s (RINGREDUCE_TIMEOUT); "
        "world rank 3 (rank 2 of set 4) was waiting on world rank 2 (rank 1 of set 4)",
    "lost rank 1 (reported through rank 0; rank 2 saw: rank 1 closed its connection)":
        "lost world rank 2 (rank 1 of set 4) (reported through world rank 1 (rank 0 of set 4); "
        "world rank 3 (rank 2 of set 4) saw: world rank 2 (rank 1 of set 4) closed its connection)",
    "rank 0 gave up waiting on this rank (1) and left the ring (over MPI)":
        "world rank 1 (rank 0 of set 4) gave up waiting on this rank (world rank 2, rank 1 of set 4) "
        "and left the ring (over MPI)",
    "communicator is unusable after an earlier error: lost rank 1: it failed and left the ring (over MPI)":
        "communicator is unusable after an earlier error: lost world rank 2 (rank 1 of set 4): "
        "it failed and left the ring (over MPI)",
}


@pytest.mark.parametrize("said", list(SET_MESSAGES))
def test_a_sets_errors_name_every_rank_in_world_terms(said):
    """No process needed: the set's _core.Comm is a stand-in that raises what C would."""
    from ringreduce.errors import PeerLostError
    from ringreduce.core.process_sets import SetComm

    class Failing:
        broken = said  # why the ring is unusable, as Comm.broken (csrc/binding/comm.c) reads it

        def allreduce(self, *args):
            raise PeerLostError(said, 1)

    comm = SetComm(Failing(), 4, [1, 2, 3], None)
    with pytest.raises(PeerLostError) as caught:
        comm.allreduce()
    assert str(caught.value) == "process set 4 (world ranks [1, 2, 3]): " + SET_MESSAGES[said]
    assert comm.broken == str(caught.value)
    assert (caught.value.rank, caught.value.set_rank) == (2, 1)
    assert not _bare_ranks(str(caught.value))


def test_the_engines_verdicts_on_a_sets_request_say_they_count_world_ranks():
    """Negotiation numbers ranks as the world does; on a set's request (set 1:
    world ranks 1 and 3 of 4) its messages say so. No process needed."""
    from ringreduce.engine.negotiation import Negotiator, agree, decode, encode
    from ringreduce.engine.response_cache import ResponseCache

    def key(name, shape=(4,)):
        return (name, "allreduce", "float32", shape, "avg", 0, 1)

    def members(ps):
        return [1, 3] if ps == 1 else [0, 1, 2, 3]

    cache = ResponseCache(16)
    differ = agree([decode(encode(keys, False, cache)) for keys in [[], [key("x")], [], [key("x", (5,))]]],
                   cache, members)
    left = agree([decode(encode(keys, False, cache, left=r == 3)) for r, keys in enumerate([[], [key("y")], [], []])],
                 cache, members)
    stall = Negotiator(16, stall_seconds=0)._judge_stalls({(1, "z"): ([1], [3])})
    messages = [differ.failed[0][1], left.failed[0][1], stall[0][2]]
    assert "tensor 'x' of process set 1 differs between ranks: world rank 1 has" in messages[0], messages
    assert "world rank 3 has allreduce float32 shape (5,)" in messages[0], messages
    assert "cannot run: world rank(s) 3 (of process set 1) have shut down" in messages[1], messages
    assert ("submitted by world rank(s) 1 (of process set 1) but not by world rank(s) 3 (of process set 1)"
            in messages[2]), messages
    assert not any(_bare_ranks(m) for m in messages), messages


@pytest.mark.parametrize("links", list(LINKS))
def test_a_silent_member_is_named_in_world_terms_by_every_member(tmp_path, links):
    """World rank 2 (rank 1 of the set [1, 2, 3]) computes past the timeout:
    the set's star (world rank 1) judges it; every message names world ranks."""
    ranks = run_ranks(4, """
        import time
        trio = rr.add_process_set([1, 2, 3])
        if trio.included():
            rr.allreduce(np.ones(10), process_set=trio)
            if rr.rank() == 2:
                time.sleep(7)
            try:
                rr.allreduce(np.ones(1 << 18, dtype=np.float32), process_set=trio)
                result = "no error"
            except rr.PeerLostError as e:
                result = (e.rank, getattr(e, "set_rank", None), str(e))
        else:
            result = "outside"
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "2", **LINKS[links]})
    assert ranks[0].result == "outside"
    for r in (1, 3):
        lost, set_rank, message = ranks[r].result
        assert (lost, set_rank) == (2, 1), (r, ranks[r].result)
        assert "lost world rank 2 (rank 1 of set 1)" in message and not _bare_ranks(message), message
    assert "world rank 3 (rank 2 of set 1) was waiting on world rank 2 (rank 1 of set 1)" in ranks[3].result[2]


# --------------------------------------------------------------------------- under mpirun

MPI_EPILOGUE = """
with open(f"{sys.argv[1]}.rank{rr.rank()}.pkl", "wb") as _f:
    pickle.dump(result, _f)
"""


def _mpi_missing():
    from test_mpi import _missing
    return _missing()


@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_every_collective_on_each_set_matches_numpy_under_mpirun(tmp_path):
    from test_mpi import MPIRUN
    script = tmp_path / "sets.py"
    script.write_text(PRELUDE + "rr.init()\n" + textwrap.dedent(check_sets(SETS)) + """
from ringreduce.core.communicator import current as _state
result["source"] = _state.world.source
""" + MPI_EPILOGUE)
    out = tmp_path / "out"
    proc = subprocess.run([MPIRUN, "-np", "4", sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [pickle.loads(open(f"{out}.rank{r}.pkl", "rb").read()) for r in range(4)]
    assert {res["source"] for res in results} == {"MPI communicator"}
    _assert_sets_correct(results)


# Two threads on each rank, one running collectives on the world's ring, the
# other on a process set's. Each ring's collectives are issued in the same
# order on every rank; the two rings' interleave differs by rank. Each ring
# has its own lock, so the two run at once, as the docs say sets do (one lock
# for every ring would deadlock: rank 0 holding it in a world collective
# waiting for rank 1, rank 1 in a set collective waiting for rank 0).
TWO_RINGS = """
import threading
r = rr.rank()
ps = rr.add_process_set([0, 1])
out = {}
def run(key, process_set):
    try:
        got = set()
        for i in range(120):
            n = [4, 4000, 70000, 300000][i % 4]  # the fast path, the arena, the ring
            y = rr.allreduce(np.full(n, r + 1.0, np.float32), name=f"{key}{i}", process_set=process_set)
            got.add((n, float(y[0]), float(y[-1])))
            if i % 10 == 0:
                got.add(tuple(rr.allgather(np.array([r]), name=f"{key}g{i}", process_set=process_set).tolist()))
        out[key] = sorted(got)
    except BaseException as e:
        out[key] = repr(e)[:300]
threads = [threading.Thread(target=run, args=("world", None))]
if r < 2:
    threads.append(threading.Thread(target=run, args=("set", ps)))
for t in threads:
    t.start()
for t in threads:
    t.join()
result = out
"""


def test_a_world_collective_and_a_set_collective_on_two_threads_run_at_once(tmp_path):
    ranks = run_ranks(3, TWO_RINGS, tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "10"})
    sums = lambda total: [(n, total, total) for n in (4, 4000, 70000, 300000)]  # noqa: E731
    for x in ranks:
        assert x.result["world"] == sorted(sums(6.0) + [(0, 1, 2)]), (x.rank, x.result["world"])
        if x.rank < 2:
            assert x.result["set"] == sorted(sums(3.0) + [(0, 1)]), (x.rank, x.result["set"])
