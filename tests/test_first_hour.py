"""The mistakes a new user makes in the first hour, each a clear error on
every rank (naming the rank at fault), never a hang or silently wrong data."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ringreduce as rr

from ranks import REPO, run_ranks

# Bad input on one rank only: that rank raises its own TypeError/ValueError
# before any data moves. The others must not pair their collective with that
# rank's next one (it ran ahead): they raise MismatchError naming it, and the
# ring stays usable for the next collective on every rank.
ONE_RANK_MISTAKES = {
    "unknown op": "rr.allreduce(np.ones(3), op='mean' if bad else 'sum')",
    "unsupported dtype": "rr.allreduce(np.ones(3, np.complex64 if bad else np.float32))",
    "wrong out": "rr.allreduce(np.ones(3), out=np.ones(4) if bad else None)",
    "read-only out": "rr.allreduce(np.ones(3), out=ro if bad else None)",
    "ragged list": "rr.allreduce([[1.0], [2.0, 3.0]] if bad else np.ones(2))",
    "large unsupported dtype": "rr.allreduce(np.ones(100_000, np.uint32 if bad else np.float32))",
    "reduce_scatter op": "rr.reduce_scatter(np.ones(4), op='avg ' if bad else 'avg')",
    "allgather object": "rr.allgather(np.array([None], object) if bad else np.ones(1))",
    "broadcast root": "rr.broadcast(np.ones(3), root=7 if bad else 0)",
    "alltoall 0-d": "rr.alltoall(np.float32(1) if bad else np.ones(rr.size()))",
    "alltoall float splits": "rr.alltoall(np.ones(2), splits=[1.0, 1.0] if bad else [1, 1])",
}


@pytest.mark.parametrize("mistake", sorted(ONE_RANK_MISTAKES))
def test_bad_input_on_one_rank_raises_on_every_rank(tmp_path, mistake):
    call = ONE_RANK_MISTAKES[mistake]
    results = run_ranks(2, f"""
        bad = rr.rank() == 1
        ro = np.ones(3)
        ro.flags.writeable = False
        try:
            {call}
            first = "no error"
        except rr.MismatchError as e:
            first = "MismatchError: " + str(e)
        except (TypeError, ValueError) as e:
            first = "own: " + type(e).__name__
        after = rr.allreduce(np.full(2, rr.rank() + 1.0), name="after").tolist()
        result = first, after
    """, tmp_path, timeout=60)
    (good, good_after), (bad, bad_after) = (r.result for r in results)
    assert bad.startswith("own: "), bad
    assert good.startswith("MismatchError: ") and "rank 1" in good, good
    assert good_after == bad_after == [3.0, 3.0]


def test_same_bad_input_on_every_rank_raises_the_same_error_everywhere(tmp_path):
    results = run_ranks(2, """
        try:
            rr.allreduce(np.ones(3), op="mean")
        except ValueError as e:
            first = str(e)
        result = first, rr.allreduce(np.ones(2)).tolist()
    """, tmp_path, timeout=60)
    assert [r.result for r in results] == [("unknown op 'mean'; choose one of sum, prod, min, max, avg", [2.0, 2.0])] * 2


# --------------------------------------------------------------------------- the environment


@pytest.mark.parametrize("env", [{"RINGREDUCE_SIZE": "4"},
                                 {"RINGREDUCE_ADDR": "127.0.0.1:29500", "RINGREDUCE_SIZE": "2"},
                                 {"RINGREDUCE_LOCAL_RANK": "1"}])
def test_a_half_set_world_is_an_error_not_a_world_of_one(env):
    """RINGREDUCE_SIZE=4 without RINGREDUCE_RANK meant 4 ranks: each process
    training alone as a world of one would be silently wrong."""
    from ringreduce.core import world
    with pytest.raises(rr.RingReduceError, match="RINGREDUCE_RANK"):
        world.discover(env)


def test_no_launcher_at_all_is_a_world_of_one():
    from ringreduce.core import world
    w = world.discover({"HOME": "/root", "RINGREDUCE_SECRET": "s"})
    assert (w.rank, w.size, w.source) == (0, 1, "single process")


def test_a_misspelt_setting_is_warned_about_with_the_name_meant(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_TIMOUT", "5")
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "65536")
    for name in [n for n in os.environ if n.startswith(("RINGREDUCE_RANK", "RINGREDUCE_SIZE", "RINGREDUCE_ADDR"))]:
        monkeypatch.delenv(name)
    rr.shutdown()
    with pytest.warns(UserWarning, match="RINGREDUCE_TIMOUT.*RINGREDUCE_TIMEOUT") as caught:
        rr.init()
    rr.shutdown()
    assert not any("SEGMENT" in str(w.message) for w in caught)


# --------------------------------------------------------------------------- ringrun


def ringrun(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGREDUCE_SECRET", None)
    return subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class _Ended:
    """A rank's process that has already ended with `code`."""

    def __init__(self, code):
        self.returncode, self.stdin, self.pid = code, None, -1

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode


def test_ringrun_names_the_rank_that_failed_first_not_the_lowest(capsys):
    """Rank 2 fails; ranks 0 and 1 fail a few ms later (PeerLostError), inside
    one of ringrun's 50 ms polls: ringrun must blame rank 2, whose output says
    why, not rank 0, whose output only says it lost a peer."""
    from ringreduce.launch import ringrun as run
    job = run.Job()
    job.ranks = [run.Rank(i, False, _Ended(code)) for i, code in enumerate([1, 1, 3])]
    for i in (2, 0, 1):  # the order they ended in
        job.wait_for(job.ranks[i])
    assert run.watch(job).code == 3
    assert capsys.readouterr().err == "ringrun: rank 2 exited with code 3; no rank left to stop\n"


@pytest.mark.parametrize("args, says", [(["--timeout", "-1"], "--timeout"), (["-H", "localhost:x"], "-H"),
                                        (["-H", "localhost:0"], "-H"), (["-H", ":2"], "-H")])
def test_ringrun_refuses_bad_arguments_up_front(args, says):
    out = ringrun("-np", "2", *args, sys.executable, "-c", "pass")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "ringrun: error:" in out.stderr and says in out.stderr, out.stderr


def test_srun_without_a_world_is_an_error_not_n_worlds_of_one():
    """`srun -n 4 python train.py` (no PMI for MPI): every task would train alone."""
    from ringreduce.core import world
    with pytest.raises(rr.RingReduceError, match="srun"):
        world.discover({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"})
    w = world.discover({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})  # a batch script's own step
    assert (w.rank, w.size) == (0, 1)


def test_srun_with_pmix_gives_the_size_of_the_step():
    """srun --mpi=pmix sets PMIX_RANK but no PMI_SIZE: rank 3 must not be a rank of a world of one."""
    from ringreduce.core import world
    w = world.discover({"PMIX_RANK": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"})
    assert (w.rank, w.size, w.source) == (3, 4, "mpirun")


def test_ringrun_with_a_script_but_no_interpreter_says_to_add_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = ringrun("-np", "2", str(script))
    assert out.returncode == 127
    assert "ringrun -np N python" in out.stderr, out.stderr


ENGINE_MISTAKES = {
    "unsupported dtype": "e.enqueue('g', np.ones(3, np.complex64 if bad else np.float32), op='avg')",
    "unknown op": "e.enqueue('g', np.ones(3), op='mean' if bad else 'avg')",
    "broadcast root": "e.enqueue('g', np.ones(3), kind='broadcast', root=5 if bad else 0)",
}


@pytest.mark.parametrize("mistake", sorted(ENGINE_MISTAKES))
def test_bad_input_on_one_rank_fails_at_once_in_the_engine(tmp_path, mistake):
    """The same through the background engine (the TF layer's path): the
    others fail that tensor at once, naming the rank, not after waiting
    RINGREDUCE_TIMEOUT for a tensor "never submitted"."""
    results = run_ranks(2, f"""
        import time
        from ringreduce.engine import engine
        e = engine()
        bad = rr.rank() == 1
        t0 = time.monotonic()
        try:
            e.wait({ENGINE_MISTAKES[mistake]})
            first = "no error"
        except rr.MismatchError as exc:
            first = "MismatchError: " + str(exc)
        except (TypeError, ValueError) as exc:
            first = "own: " + type(exc).__name__
        took = time.monotonic() - t0
        after = e.wait(e.enqueue("after", np.full(2, rr.rank() + 1.0), op="sum")).tolist()
        result = first, took, after
    """, tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "30"})
    (good, took, good_after), (bad, _, bad_after) = (r.result for r in results)
    assert bad.startswith("own: "), bad
    assert good.startswith("MismatchError: ") and "rank 1" in good, good
    assert took < 15, took
    assert good_after == bad_after == [3.0, 3.0]


def test_the_same_bad_input_on_every_rank_leaves_the_engine_working(tmp_path):
    results = run_ranks(2, """
        from ringreduce.engine import engine
        e = engine()
        try:
            e.enqueue("g", np.ones(3), op="mean")
        except ValueError as exc:
            first = str(exc)
        result = first, e.wait(e.enqueue("g", np.ones(2), op="sum")).tolist()
    """, tmp_path, timeout=60)
    assert [r.result for r in results] == [("unknown op 'mean'; choose one of sum, prod, min, max, avg", [2.0, 2.0])] * 2


def test_bad_input_on_one_member_of_a_process_set_raises_on_the_others(tmp_path):
    results = run_ranks(3, """
        ps = rr.add_process_set([0, 1])
        if ps.included():
            try:
                rr.allreduce(np.ones(3, np.complex64 if rr.rank() == 1 else np.float32), process_set=ps)
                first = "no error"
            except rr.MismatchError as exc:
                first = "MismatchError: " + str(exc)
            except TypeError:
                first = "own"
        else:
            first = "not a member"
        result = first, rr.allreduce(np.ones(2)).tolist()
    """, tmp_path, timeout=60)
    got = [r.result for r in results]
    assert got[0][0].startswith("MismatchError: ") and "rank 1" in got[0][0], got
    assert [g[0] for g in got[1:]] == ["own", "not a member"]
    assert all(g[1] == [3.0, 3.0] for g in got)


def test_every_setting_the_code_reads_is_a_known_name():
    """A new RINGREDUCE_* variable must join config.KNOWN_NAMES, or setting it warns as a typo."""
    import re
    from ringreduce.core import config
    sources = [*(REPO / "ringreduce").rglob("*.py"), REPO / "setup.py"]
    read = {m for p in sources for m in re.findall(r"[\"'](RINGREDUCE_[A-Z0-9_]+)[\"']", p.read_text())}
    assert read and read <= config.KNOWN_NAMES, sorted(read - config.KNOWN_NAMES)
