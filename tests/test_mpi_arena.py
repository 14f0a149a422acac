"""The host arena over MPI (ringreduce/mpi_backend.py attach_arena): ranks of
an MPI ring on one host meet in one shared mapping for small operations, as
the socket backend's do (tests/test_small_shm.py), instead of recursive
doubling. Under mpirun -np 2, 3, 4: results against numpy for every dtype
and op, at and past the arena's limit; the same bits on every rank;
mismatches named on every rank; process sets with arenas of their own; a
silent rank named after the timeout and a killed one at once (the MPI
transport's stalled()), or the job ended by the launcher; no arena with
RINGREDUCE_ARENA_BYTES=0 or ranks on different hosts; the file gone.

This file is also the job each test starts: `mpirun -np N python
tests/test_mpi_arena.py MODE OUT` writes each rank's findings to
OUT.rank<r>.pkl.
"""
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import DTYPES, OPS, close_enough, digest, make_input, reference  # noqa: E402

# --------------------------------------------------------------------------- the job, on every rank


def _init():
    import ringreduce as rr
    from ringreduce import collectives as c
    rr.init(backend="mpi")
    return rr, c


def _sent(comm) -> int:
    """Bytes this rank sent over links (MPI, sockets, shared-memory links):
    all it sent but what it wrote into the host arena (bytes_via: tcp, shm, cma, arena, mpi)."""
    via = comm.bytes_via()
    return sum(via) - via[3]


def job_correctness():
    """Every dtype and op; sizes 0, 1, < N, odd, a 3-d shape, the arena's
    limit and one element past it (the ring); whether any byte left the rank."""
    rr, c = _init()
    n, r, ring = rr.size(), rr.rank(), c._state.ring
    out = {"arena": ring.comm.arena_slot, "limit": ring.allreduce_limit, "cases": {}}
    for dtype in DTYPES:
        for op in OPS:
            itemsize = np.dtype(make_input(0, 1, dtype, op).dtype).itemsize
            at = ring.allreduce_limit // itemsize
            for shape in (0, 1, max(n - 1, 1), 2 * n + 1, 1001, (3, 5, 7), at, at + 1):
                shape = shape if isinstance(shape, tuple) else (shape,)
                inputs = [make_input(i, shape, dtype, op) for i in range(n)]
                before = _sent(ring.comm)
                got = rr.allreduce(inputs[r], op=op)
                out["cases"][(dtype, op, shape)] = (close_enough(got, reference(inputs, dtype, op), dtype, op, inputs),
                                                    digest(got), _sent(ring.comm) > before)
    # Sums whose value depends on the order of reduction: the same bits on every rank.
    rng = np.random.default_rng(r)
    for dtype in ("float32", "float16", "float64"):
        x = (rng.standard_normal(4099) * 10 ** rng.uniform(-3, 3, 4099)).astype(dtype)
        out["cases"][("random", dtype)] = (True, digest(rr.allreduce(x)), False)
    inplace = np.full(513, r + 1.0, dtype=np.float32)
    rr.allreduce(inplace, out=inplace)
    out["inplace"] = bool((inplace == n * (n + 1) / 2).all())
    rr.barrier()
    return out


def job_mismatch():
    """The last rank disagrees on shape, dtype, op; on a shape on the small
    path for it alone (5000 floats), and one too big for its arena slot
    (its header alone comes to the arena); then everyone agrees again."""
    from ringreduce.errors import MismatchError
    rr, c = _init()
    n, r = rr.size(), rr.rank()
    odd = r == n - 1
    out = {"arena": c._state.comm.arena_slot}
    for what, call in (("shape", lambda: rr.allreduce(np.ones(7 if odd else 5, np.float32))),
                       ("dtype", lambda: rr.allreduce(np.ones(5, np.float64 if odd else np.float32))),
                       ("op", lambda: rr.allreduce(np.ones(5, np.float32), op="max" if odd else "sum")),
                       ("apart", lambda: rr.allreduce(np.ones(5000 if odd else 5, np.float32))),
                       ("long", lambda: rr.allreduce(np.ones(1 << 20 if odd else 5, np.float32)))):
        try:
            call()
            out[what] = None
        except MismatchError as exc:
            out[what] = str(exc)
    out["after"] = rr.allreduce(np.full(5, r + 1.0)).tolist()
    return out


def job_sets():
    """Two process sets and the world, interleaved: each set's ring has an
    arena of its own; results right and the same bits among members."""
    import hashlib
    rr, c = _init()
    sets = [(rr.add_process_set([0, 2, 3]), [0, 2, 3]), (None, [0, 1, 2, 3]), (rr.add_process_set([1, 3]), [1, 3])]
    arenas, digests, wrong = {}, {}, []
    for ps, members in sets:
        if rr.rank() in members:
            ring = c._ring(ps)
            arenas[repr(members)] = getattr(ring.comm, "_comm", ring.comm).arena_slot
    for i in range(20):
        for ps, members in sets:
            if rr.rank() not in members:
                continue
            x = np.random.default_rng(i * 10 + rr.rank()).random(1000 + i).astype(np.float32)
            got = rr.allreduce(x, process_set=ps)
            want = sum(np.random.default_rng(i * 10 + k).random(1000 + i).astype(np.float32) for k in members)
            if not np.allclose(got, want, rtol=1e-5):
                wrong.append((i, members))
            digests.setdefault(repr(members), hashlib.sha256()).update(got.tobytes())
    return {"arenas": arenas, "wrong": wrong, "digests": {k: v.hexdigest() for k, v in digests.items()}}


def job_silent():
    """The last rank stops (SIGSTOP) before a small allreduce; with
    RINGREDUCE_TIMEOUT=1 every other rank, waiting in the arena, raises
    PeerLostError naming it (rank 0 wakes it after 3 s)."""
    import signal
    import threading
    from mpi4py import MPI
    from ringreduce.errors import RingReduceError
    rr, c = _init()
    world = MPI.COMM_WORLD
    n, r = rr.size(), rr.rank()
    pids = world.allgather(os.getpid())
    rr.allreduce(np.ones(4))
    world.Barrier()

    def wake():
        time.sleep(3.0)
        os.kill(pids[n - 1], signal.SIGCONT)
    waker = threading.Thread(target=wake, daemon=True)
    if r == 0:
        waker.start()
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start, sent = time.monotonic(), _sent(c._state.comm)
    try:
        rr.allreduce(np.ones(1000, np.float32))
        error = None
    except RingReduceError as exc:
        error = (type(exc).__name__, exc.rank, str(exc))
    seconds = time.monotonic() - start
    if r == 0:
        waker.join()  # the sleeper must wake before this rank leaves
    return {"arena": c._state.comm.arena_slot, "error": error, "seconds": seconds,
            "sent": _sent(c._state.comm) - sent}


def job_killed():
    """Rank 1 dies (SIGKILL) while the others wait for it in the arena."""
    import signal
    rr, c = _init()
    assert c._state.comm.arena_slot > 0
    rr.allreduce(np.ones(4))
    if rr.rank() == 1:
        time.sleep(0.5)  # the others are waiting in the arena by now
        os.kill(os.getpid(), signal.SIGKILL)
    rr.allreduce(np.ones(1000, np.float32))
    return "no error"


def job_dead_pid():
    """The transport is told rank 1's process is one that has exited (a
    child's, reaped), and rank 1 comes 3 s late: the others, waiting for it
    in the arena, see that pid gone and name rank 1 at once, long before
    RINGREDUCE_TIMEOUT=60 and before rank 1 comes (which would end the wait)."""
    from ringreduce import mpi_backend
    real = mpi_backend._pids_on_one_host

    def with_a_dead_rank_1(comm):
        pids = real(comm)
        pids[1] = _exited_pid()
        return pids
    mpi_backend._pids_on_one_host = with_a_dead_rank_1
    rr, c = _init()
    rr.allreduce(np.ones(4))
    if rr.rank() == 1:
        time.sleep(3)
    try:
        rr.allreduce(np.ones(1000, np.float32))
        found = "no error"
    except rr.PeerLostError as exc:
        found = (exc.rank, str(exc))
    return {"arena": c._state.comm.arena_slot, "found": found}


def _exited_pid() -> int:
    import subprocess
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: no such process any more
    return child.pid


def job_off():
    """RINGREDUCE_ARENA_BYTES=0 (set by the test): no arena, the small path
    by recursive doubling, its bytes counted."""
    rr, c = _init()
    before = _sent(c._state.comm)
    got = rr.allreduce(np.full(1000, rr.rank() + 1.0, np.float32))
    return {"arena": c._state.comm.arena_slot, "extra": c._state.world.extra.get("arena"),
            "algorithm": c._state.comm.small_algorithm, "sent": _sent(c._state.comm) - before,
            "sum": float(got[0])}


def job_elsewhere():
    """Rank 1 claims another host: nobody takes the arena; the small path
    still works (by doubling)."""
    from ringreduce import shm
    if int(os.environ.get("PMI_RANK", "0")) == 1:
        shm.host_identity = lambda: "elsewhere/0"
    rr, c = _init()
    before = _sent(c._state.comm)
    got = rr.allreduce(np.arange(5.0) * (rr.rank() + 1))
    return {"arena": c._state.comm.arena_slot, "sent": _sent(c._state.comm) > before, "got": got.tolist()}


def job_file_gone():
    """Rank 0 makes the arena's file; it is gone once every rank agreed."""
    from ringreduce import shm
    made = []
    make = shm._make_file
    shm._make_file = lambda tag, *a, **k: made.append(make(tag, *a, **k)) or made[-1]
    rr, c = _init()
    paths = [m[1] for m in made if "arena" in m[1]]
    return {"arena": c._state.comm.arena_slot, "paths": paths, "exist": [os.path.exists(p) for p in paths],
            "sum": rr.allreduce(np.ones(8))[0]}


def job_bits():
    """Sums whose bits depend on the order: the arena's result against the
    rank-order left fold (the ring pass's order, not doubling's tree), for a
    size that splits and one in place."""
    rr, c = _init()
    n, r = rr.size(), rr.rank()
    out = {"arena": c._state.comm.arena_slot}
    for dtype, count in (("float32", 4099), ("float64", 30000), ("float16", 999)):
        xs = [(np.random.default_rng(k).standard_normal(count) * 10 ** np.random.default_rng(k + 99).uniform(
            -2, 2, count)).astype(dtype) for k in range(n)]
        left = xs[0].copy()
        for k in range(1, n):
            left = left + xs[k]
        got = rr.allreduce(xs[r])
        inplace = xs[r].copy()
        rr.allreduce(inplace, out=inplace)
        out[dtype] = (got.tobytes() == left.tobytes(), inplace.tobytes() == left.tobytes())
    return out


def job_other_pid_namespace():
    """The last rank runs in a pid namespace of its own (the test's
    wrapper): no rank is given pids (a live peer's pid is not ours to see),
    the arena is still used, and a late rank is waited for, not named dead."""
    from ringreduce import mpi_backend
    given = []
    real = mpi_backend._pids_on_one_host
    mpi_backend._pids_on_one_host = lambda comm: given.append(real(comm)) or given[-1]
    rr, c = _init()
    rr.allreduce(np.ones(4))
    if rr.rank() == rr.size() - 1:
        time.sleep(1.5)  # the others wait for it in the arena, asking stalled() all along
    got = rr.allreduce(np.full(1000, rr.rank() + 1.0, np.float32))
    return {"arena": c._state.comm.arena_slot, "given": given, "sum": float(got[0]), "pid": os.getpid()}


def job_env_after_init():
    """A setting changed in os.environ after init() (here to something
    init() would refuse): a process set's arena is set up from the config
    init() read, as the set's ring is, not from the environment of now."""
    rr, c = _init()
    os.environ["RINGREDUCE_ARENA_REDUCE"] = "no such mode"
    try:
        ps = rr.add_process_set([0, 1])
    except rr.RingReduceError as exc:
        return {"error": str(exc)}
    got = rr.allreduce(np.full(100, 1.0, np.float32), process_set=ps) if rr.rank() < 2 else None
    return {"error": None, "arena": c._ring(ps).comm.arena_slot if rr.rank() < 2 else None,
            "sum": None if got is None else float(got[0])}


def job_shutdown_while_waiting():
    """Rank 0 waits in the arena for rank 1 (3 s late) on a thread and shuts
    down meanwhile: its wait is interrupted after it published. Rank 1 then
    finds rank 0's blob there and may finish that operation (right), but its
    next one names rank 0 as interrupted: from the notice, not the timeout."""
    import threading
    rr, c = _init()
    rr.allreduce(np.ones(4))
    found = []

    def op():
        try:
            found.append(float(rr.allreduce(np.ones(1000, np.float32))[0]))
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            found.append((type(exc).__name__, getattr(exc, "rank", None), str(exc)))
    if rr.rank() == 0:
        waiter = threading.Thread(target=op)
        waiter.start()
        time.sleep(0.5)
        rr.shutdown()
        waiter.join()
    else:
        time.sleep(3)
        op()
        op()
    return {"found": found}


def job_one_cannot_open():
    """Rank 1 cannot open (or see) the arena's file: nobody uses the arena;
    the small path goes on by doubling, right, on every rank."""
    from ringreduce import shm
    if int(os.environ.get("PMI_RANK", "0")) == 1:
        shm._open_offer = lambda *a, **k: -1
    return _no_arena_job()


def job_one_cannot_map():
    """Rank 1 opens a file that its mapping refuses (the wrong size: as if
    mmap failed there): it votes no, the others unmap theirs unused."""
    import tempfile
    from ringreduce import shm
    if int(os.environ.get("PMI_RANK", "0")) == 1:
        def wrong_file(*a, **k):
            fd, path = tempfile.mkstemp()
            os.unlink(path)
            os.ftruncate(fd, 4096)
            return fd
        shm._open_offer = wrong_file
    return _no_arena_job()


def _no_arena_job():
    rr, c = _init()
    before = _sent(c._state.comm)
    got = rr.allreduce(np.full(1000, rr.rank() + 1.0, np.float32))
    return {"arena": c._state.comm.arena_slot, "extra": c._state.world.extra.get("arena"),
            "sent": _sent(c._state.comm) - before, "sum": float(got[0]), "limit": c._state.ring.allreduce_limit,
            "rounds": c._state.comm.small_rounds}


# --------------------------------------------------------------------------- the tests

if __name__ != "__main__":
    from test_mpi import MPIRUN, _missing
    from ranks import REPO
    pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _mpirun(n, mode, tmp_path, env=None, timeout=120, check=True, wrap=()):
    out = tmp_path / mode
    proc = subprocess.run([MPIRUN, "-np", str(n), *wrap, sys.executable, __file__, mode, str(out)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(n):
        path = Path(f"{out}.rank{r}.pkl")
        ranks.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    if check:
        assert proc.returncode == 0 and None not in ranks, report
    return proc, ranks


# split: each rank folds its slice and a second round shares them (forced:
# "auto" splits only where every rank has a core, never on a 2-core machine).
@pytest.mark.parametrize("n,reduce", [(2, "auto"), (3, "auto"), (4, "auto"), (3, "split"), (4, "split")])
def test_arena_over_mpi_matches_numpy_bit_identical_on_every_rank(tmp_path, n, reduce):
    _, ranks = _mpirun(n, "correctness", tmp_path, env={"RINGREDUCE_ARENA_REDUCE": reduce}, timeout=240)
    for r, res in enumerate(ranks):
        assert res["arena"] > 0 and res["limit"] == 256 << 10, (res["arena"], res["limit"])
        bad = [case for case, (ok, _, _) in res["cases"].items() if not ok]
        assert not bad, f"rank {r}: {bad[:5]} differ from numpy"
        differ = [c for c, (_, d, _) in res["cases"].items() if d != ranks[0]["cases"][c][1]]
        assert not differ, f"rank {r}: {differ[:5]} not bit-identical to rank 0"
        # Up to the limit nothing leaves the rank (the arena); one element past it, the ring sends.
        small = [c for c, (_, _, sent) in res["cases"].items() if c[0] != "random" and sent != (
            int(np.prod(c[2])) * np.dtype(make_input(0, 1, c[0], c[1]).dtype).itemsize > res["limit"])]
        assert not small, f"rank {r}: {small[:5]} took the wrong path"
        assert res["inplace"]


@pytest.mark.parametrize("n", [3, 4])
def test_a_mismatch_in_the_arena_names_the_rank_on_every_rank(tmp_path, n):
    _, ranks = _mpirun(n, "mismatch", tmp_path)
    for res in ranks:
        assert res["arena"] > 0
        assert res == ranks[0]  # the same message everywhere
        assert f"rank {n - 1}: (7,)" in res["shape"] and "rank 0: (5,)" in res["shape"], res["shape"]
        assert f"rank {n - 1}: float64" in res["dtype"] and "rank 0: float32" in res["dtype"], res["dtype"]
        assert f"rank {n - 1}" in res["op"] and "max" in res["op"], res["op"]
        assert f"rank {n - 1}: (5000,)" in res["apart"], res["apart"]
        assert f"rank {n - 1}: (1048576,)" in res["long"], res["long"]
        assert res["after"] == [n * (n + 1) / 2] * 5


@pytest.mark.parametrize("reduce", ["auto", "split"])
def test_process_sets_over_mpi_get_their_own_arena(tmp_path, reduce):
    _, ranks = _mpirun(4, "sets", tmp_path, env={"RINGREDUCE_ARENA_REDUCE": reduce})
    for r, res in enumerate(ranks):
        assert res["arenas"] and all(slot > 0 for slot in res["arenas"].values()), (r, res["arenas"])
        assert not res["wrong"], (r, res["wrong"])
    for members in ([0, 2, 3], [0, 1, 2, 3], [1, 3]):
        assert len({ranks[k]["digests"][repr(members)] for k in members}) == 1, f"set {members} differs"


@pytest.mark.parametrize("n", [2, 4])
def test_a_silent_rank_is_named_from_the_arena(tmp_path, n):
    _, ranks = _mpirun(n, "silent", tmp_path, env={"RINGREDUCE_TIMEOUT": "1"})
    for r, res in enumerate(ranks[:-1]):
        assert res["arena"] > 0 and res["sent"] == 0, (r, res)  # it waited in the arena, not on MPI
        assert res["error"] is not None and res["error"][:2] == ("PeerLostError", n - 1), (r, res)
        assert "RINGREDUCE_TIMEOUT" in res["error"][2] or "left the ring" in res["error"][2], (r, res)
        assert res["seconds"] < 2.9, (r, res)  # the timeout, not the sleeper's return


def test_a_dead_rank_is_named_from_the_arena_through_its_pid(tmp_path):
    """The MPI transport's stalled() looks at the pid of the rank waited on
    (ranks on one host): the waiters name rank 1 as dead, or as told by the
    one that saw it, instead of waiting for it (it comes after 3 s)."""
    _, ranks = _mpirun(4, "dead_pid", tmp_path, env={"RINGREDUCE_TIMEOUT": "60"}, timeout=60)
    for r in (0, 2, 3):
        res = ranks[r]
        assert res["arena"] > 0 and res["found"] != "no error", (r, res)
        assert res["found"][0] == 1 and "lost rank 1" in res["found"][1], (r, res)
    assert any("died" in ranks[r]["found"][1] for r in (0, 2, 3)), ranks


def test_a_rank_killed_in_the_arena_ends_the_job(tmp_path):
    """A rank really killed: by default Hydra ends the whole job as soon as a
    process dies, the others included, wherever they wait, usually before
    they notice (its report names a pid, not always the dead one's): no rank
    hangs in the arena (it would for RINGREDUCE_TIMEOUT=60, past the test's
    timeout of 50 s)."""
    proc, ranks = _mpirun(4, "killed", tmp_path, env={"RINGREDUCE_TIMEOUT": "60"}, timeout=50, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and ranks[1] is None and "signal 9" in said, said[-2000:]


def test_arena_bytes_0_keeps_doubling(tmp_path):
    _, ranks = _mpirun(3, "off", tmp_path, env={"RINGREDUCE_ARENA_BYTES": "0"})
    for res in ranks:
        assert res["arena"] == 0 and res["extra"] is False and res["algorithm"] == "doubling", res
        assert res["sent"] > 0 and res["sum"] == 6.0, res


def test_ranks_on_different_hosts_keep_doubling(tmp_path):
    _, ranks = _mpirun(3, "elsewhere", tmp_path)
    for res in ranks:
        assert res == {"arena": 0, "sent": True, "got": [0.0, 6.0, 12.0, 18.0, 24.0]}, res


def test_the_arena_file_is_gone_once_agreed(tmp_path):
    _, ranks = _mpirun(3, "file_gone", tmp_path)
    assert len(ranks[0]["paths"]) == 1 and ranks[0]["exist"] == [False], ranks[0]
    assert not os.path.exists(ranks[0]["paths"][0])
    for res in ranks:
        assert res["arena"] > 0 and res["sum"] == 3.0, res
    assert ranks[1]["paths"] == ranks[2]["paths"] == []


@pytest.mark.parametrize("n,reduce", [(3, "auto"), (4, "split")])
def test_the_arena_over_mpi_gives_the_ring_passs_bits(tmp_path, n, reduce):
    """Rank order, as the ring's small path (docs/architecture.md): not
    recursive doubling's tree, which the ring takes without the arena."""
    _, ranks = _mpirun(n, "bits", tmp_path, env={"RINGREDUCE_ARENA_REDUCE": reduce})
    for r, res in enumerate(ranks):
        assert res.pop("arena") > 0, (r, res)
        assert all(a and b for a, b in res.values()), (r, res)


UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def test_a_rank_in_another_pid_namespace_is_not_judged_by_its_pid(tmp_path):
    if subprocess.run([*UNSHARE, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --user --pid is not allowed here")
    wrap = tmp_path / "wrap.sh"
    wrap.write_text('#!/bin/sh\n[ "$PMI_RANK" = 2 ] && exec ' + " ".join(UNSHARE) + ' "$@"\nexec "$@"\n')
    wrap.chmod(0o755)
    # UCX's shared-memory transports need one pid namespace; TCP does not.
    _, ranks = _mpirun(3, "other_pid_namespace", tmp_path, env={"RINGREDUCE_TIMEOUT": "30", "UCX_TLS": "tcp,self"},
                       wrap=[str(wrap)])
    assert ranks[2]["pid"] == 1, ranks  # the wrapper did put it in a namespace of its own
    for res in ranks:
        assert res["arena"] > 0 and res["given"] == [None] and res["sum"] == 6.0, res


def test_a_process_sets_arena_follows_the_config_init_read(tmp_path):
    _, ranks = _mpirun(3, "env_after_init", tmp_path)
    for r, res in enumerate(ranks):
        assert res["error"] is None, (r, res)
    for res in ranks[:2]:
        assert res["arena"] > 0 and res["sum"] == 2.0, res


def test_a_rank_that_shuts_down_mid_wait_is_named_by_the_next_operation(tmp_path):
    _, ranks = _mpirun(2, "shutdown_while_waiting", tmp_path, env={"RINGREDUCE_TIMEOUT": "60"}, timeout=50)
    (interrupted,) = ranks[0]["found"]
    assert interrupted[0] == "RingReduceError" and "interrupted" in interrupted[2], ranks[0]
    first, second = ranks[1]["found"]
    assert first == 2.0 or first[:2] == ("PeerLostError", 0), ranks[1]
    assert second[:2] == ("PeerLostError", 0) and "interrupted and left the ring" in second[2], ranks[1]


@pytest.mark.parametrize("mode", ["one_cannot_open", "one_cannot_map"])
def test_one_rank_without_the_arena_keeps_every_rank_off_it(tmp_path, mode):
    _, ranks = _mpirun(3, mode, tmp_path, timeout=90)
    for res in ranks:
        assert res["arena"] == 0 and res["extra"] is False, res
        assert res["sent"] > 0 and res["sum"] == 6.0, res  # by doubling, not the arena
    assert len({(res["limit"], res["rounds"]) for res in ranks}) == 1, ranks


def test_pids_are_not_given_where_a_rank_cannot_tell_its_pid_namespace():
    """A rank whose /proc/self/ns/pid cannot be read has namespace 0 (shm.py):
    ranks in different pid namespaces would then look alike, and a live peer
    whose pid is not ours to see would look dead (kill: ESRCH)."""
    from ringreduce import mpi_backend

    class Comm:
        def __init__(self, rows):
            self.rows = rows

        def allgather(self, mine):
            return self.rows

    assert mpi_backend._pids_on_one_host(Comm([("h/1", 7, 100), ("h/1", 7, 101)])) == [100, 101]
    assert mpi_backend._pids_on_one_host(Comm([("h/1", 7, 100), ("h/1", 8, 101)])) is None
    assert mpi_backend._pids_on_one_host(Comm([("h/1", 0, 100), ("h/1", 0, 101)])) is None


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    result = globals()[f"job_{mode}"]()
    from mpi4py import MPI
    with open(f"{out}.rank{MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)
