"""Elastic training (ringrun --elastic, ringreduce.elastic): kill -9 a worker
mid-training, the survivors go on, nothing committed is lost, every rank
ends with the same bits, the worker comes back and the world grows again."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ranks import REPO, run_ranks

JOB = str(REPO / "tests" / "elastic_job.py")


class ElasticRun:
    """ringrun --elastic under a timeout; `kill_when(line)` picks a pid to kill -9."""

    def __init__(self, args, kill_when=None, timeout=60, env=None, prefix=()):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "RINGRUN_VERBOSE": "1",
               **(env or {})}
        env.pop("RINGREDUCE_SECRET", None)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "ringreduce.launch.ringrun", "--elastic", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.lines, self.kills = [], []
        err = []
        t = threading.Thread(target=lambda: err.extend(self.proc.stderr), daemon=True)
        t.start()
        timer = threading.Timer(timeout, lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                pid = kill_when(line) if kill_when else None
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    self.kills.append((pid, time.time()))
            self.proc.wait()
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
            t.join(5)
        self.stderr = "".join(err)
        assert not timed_out, f"elastic job timed out after {timeout} s\n{self.stderr[-3000:]}"

    def commits(self):
        """(step, generation, rank, size, pid) of every `committed` line."""
        out = []
        for line in self.lines:
            words = line.split("] ", 1)[-1].split()
            if words[:1] == ["committed"]:
                out.append((int(words[1]), int(words[3]), int(words[5]), int(words[7]), int(words[9])))
        return out

    def done(self):
        return [json.loads(line.split("] done ", 1)[1]) for line in self.lines if "] done " in line]


def killer(step: int, rank: int, times: int = 1):
    """kill -9 the worker that committed `step` as `rank` (once per count)."""
    left = [times]

    def pick(line):
        words = line.split("] ", 1)[-1].split()
        if left[0] and words[:1] == ["committed"] and int(words[1]) == step and int(words[5]) == rank:
            left[0] -= 1
            return int(words[9])
        return None
    return pick


def check_recovered(run: ElasticRun, steps: int, n_final: int):
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert run.kills, "nothing was killed"
    done = run.done()
    assert len(done) == n_final, run.stderr[-3000:]
    # every rank ends with the same bits, and they are what the committed history says
    assert len({d["sha"] for d in done}) == 1
    for d in done:
        assert d["steps"] == steps and len(d["sizes"]) == steps and d["uniform"]
        assert d["w0"] == d["expected"], d
    sizes = done[0]["sizes"]
    assert 3 in sizes, "training went on with the 3 survivors"
    assert sizes[-1] == 4 and done[0]["size"] == 4, "the restarted worker joined: the world is 4 again"
    # no committed step lost or repeated: each generation starts right after the newest commit before it
    commits = run.commits()
    by_gen: dict = {}
    for step, gen, rank, size, pid in commits:
        by_gen.setdefault(gen, []).append(step)
    gens = sorted(by_gen)
    assert len(gens) >= 3, f"expected a shrink and a grow, got generations {gens}"
    for a, b in zip(gens, gens[1:]):
        assert min(by_gen[b]) == max(by_gen[a]) + 1, (a, b, by_gen[a][-5:], by_gen[b][:5])
    # no descriptor or thread leaks across resets (the survivors went through two)
    for d in done:
        fds = [r[0] for r in d["resources"]]
        threads = [r[1] for r in d["resources"]]
        assert max(fds) - fds[0] <= 0 and max(threads) - threads[0] <= 0, d["resources"]
    return sizes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim, links", [(1, "shm"), (0, "tcp")], ids=["rank1-shm", "rank0-tcp"])
def test_kill_a_worker_training_goes_on_and_the_world_grows_back(victim, links):
    steps = 80
    run = ElasticRun(["-np", "4", "--min-np", "2", sys.executable, JOB, str(steps), "0.03"],
                     kill_when=killer(10, victim), env={"RINGREDUCE_SHM_BYTES": "0"} if links == "tcp" else {})
    check_recovered(run, steps, 4)
    assert all(d["links"] == {"next": links, "prev": links} for d in run.done()), "the links re-formed as such"
    assert "was killed by SIGKILL; restarting it in 1 s" in run.stderr


def test_stale_generation_is_refused_on_every_rank(tmp_path):
    body = """
    from ringreduce.core import collectives
    if rr.rank() == 1:
        collectives.communicator().generation = 7  # as if it came from another ring
    result = []
    for n in (5, 50_000):  # inline in the header pass, and the ring's path
        try:
            rr.allreduce(np.ones(n), name=f"x{n}")
            result.append("paired")
        except rr.StaleGenerationError as exc:
            result.append(str(exc))
    """
    ranks = run_ranks(2, body, tmp_path, timeout=30)
    for r in ranks:
        assert len(r.result) == 2
        for text in r.result:
            assert "generation 7" in text and "refused" in text, r.result


@pytest.mark.timeout(40)
def test_below_min_np_exits_non_zero_saying_why():
    run = ElasticRun(["-np", "2", "--min-np", "2", "--max-restarts", "0", "--elastic-timeout", "2",
                      sys.executable, JOB, "100000", "0.01"], kill_when=killer(5, 1))
    assert run.proc.returncode == 1
    assert "1 worker(s) left, below --min-np 2, for 2 s (--elastic-timeout 2)" in run.stderr, run.stderr[-2000:]
    assert "not restarted (--max-restarts 0 used)" in run.stderr


def test_elastic_flags_need_elastic():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", "--min-np", "1", "true"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 2 and "--min-np needs --elastic" in out.stderr
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "--elastic", "-np", "2", "--min-np", "3", "true"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 2 and "--min-np (3) <= -np (2)" in out.stderr


@pytest.mark.timeout(90)
def test_keras_fit_with_the_callbacks_survives_a_kill():
    pytest.importorskip("tensorflow")
    epochs, spe = 4, 12
    run = ElasticRun(["-np", "3", "--min-np", "2", sys.executable, str(REPO / "tests" / "elastic_keras_job.py"),
                      str(epochs), str(spe), "3"], kill_when=killer(spe + 3, 1), timeout=85)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    done = run.done()
    assert len(done) == 3, run.stderr[-3000:]
    assert len({d["sha"] for d in done}) == 1 and all(d["finite"] for d in done)
    assert all(d["epoch"] == epochs and d["size"] == 3 for d in done)
    assert 2 in {size for _, _, _, size, _ in run.commits()}, "trained on with 2"
    survivors = [d for d in done if d["lr_sizes"]]
    assert survivors and all(d["lr_sizes"][:1] == [2] and d["lr_sizes"][-1] == 3 for d in survivors)
    assert all(abs(d["lr"] - 0.03) < 1e-7 for d in done), "the reset callback scaled the rate by the new size"
    # nothing committed was lost: after each reset training resumes at or after the newest commit's epoch start
    by_gen: dict = {}
    for step, gen, *_ in run.commits():
        by_gen.setdefault(gen, []).append(step)
    gens = sorted(by_gen)
    for a, b in zip(gens, gens[1:]):
        assert min(by_gen[b]) >= max(by_gen[a]) // spe * spe, (a, b)


@pytest.mark.timeout(60)
def test_a_host_the_discovery_script_adds_joins_at_the_next_commit(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    steps = 150

    def grow(line):
        words = line.split("] ", 1)[-1].split()
        if words[:2] == ["committed", "5"]:
            hosts.write_text("localhost:3\n")  # a slot appears: ringrun starts a worker there
        return None
    run = ElasticRun(["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
                      sys.executable, JOB, str(steps), "0.02"], kill_when=grow)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    done = run.done()
    assert len(done) == 3 and len({d["sha"] for d in done}) == 1
    assert all(d["w0"] == d["expected"] and d["steps"] == steps for d in done)
    sizes = done[0]["sizes"]
    assert sizes[0] == 2 and sizes[-1] == 3, "the ring grew from 2 to 3"
    by_gen: dict = {}
    for step, gen, *_ in run.commits():
        by_gen.setdefault(gen, []).append(step)
    gens = sorted(by_gen)
    for a, b in zip(gens, gens[1:]):
        assert min(by_gen[b]) == max(by_gen[a]) + 1, "a grow loses or repeats no step"
    assert "host discovery" not in run.stderr  # the script never failed


def test_sync_takes_the_state_of_the_newest_commit(tmp_path):
    body = """
    from ringreduce import elastic
    state = elastic.ObjectState(w=np.zeros(3), note="start")
    for i in range(1 + 2 * (rr.rank() == 2)):  # rank 2 is two commits ahead (others lost the step after)
        state.w = state.w + 1 + i
        state.note = f"commit {i + 1} of rank {rr.rank()}"
        state.commit()
    state.w = state.w * 100  # uncommitted: rolled back
    state.restore()
    state.sync()
    result = (state.w.tolist(), state.note, state.commits)
    """
    ranks = run_ranks(3, body, tmp_path, timeout=30)
    assert {tuple(r.result[0]) for r in ranks} == {(6.0, 6.0, 6.0)}
    assert {r.result[1:] for r in ranks} == {("commit 3 of rank 2", 3)}


def test_restart_back_off_doubles_and_a_failing_host_is_left_out():
    from ringreduce.launch import elastic_launcher as el

    job = el.ElasticJob(el.Options(np=2, min_np=1, max_np=2, max_restarts=10, hosts_spec="localhost:2"), ["true"])
    try:
        class Dead:
            returncode = -9

            def poll(self):
                return -9
        now = 1000.0
        for i in range(3):
            job.failed(el.Worker(i, f"localhost#{i}", "localhost", Dead(), now), -9, now + i)
        delays = [when - (now + i) for i, (when, _) in enumerate(job.pending)]
        assert delays == [1.0, 2.0, 4.0]
        host = job.hosts["localhost"]
        assert host.left_out_until == now + 2 + el.BLACKLIST_SECONDS
        assert job.free_host("localhost", now + 3) is None  # left out for a while
        assert job.free_host("localhost", now + 3 + el.BLACKLIST_SECONDS) == "localhost"
    finally:
        job.server.close()


@pytest.mark.timeout(60)
def test_a_stopped_worker_is_dropped_and_the_others_go_on():
    steps = 150
    stopped = []

    def stop(line):
        words = line.split("] ", 1)[-1].split()
        if not stopped and words[:1] == ["committed"] and int(words[1]) == 10 and int(words[5]) == 1:
            stopped.append(int(words[9]))
            os.kill(stopped[0], signal.SIGSTOP)  # alive but silent: seen only by RINGREDUCE_TIMEOUT
        return None
    run = ElasticRun(["-np", "3", "--min-np", "2", "--timeout", "2", sys.executable, JOB, str(steps), "0.01"],
                     kill_when=stop)
    assert stopped and run.proc.returncode == 0, run.stderr[-3000:]
    done = run.done()
    assert len(done) == 2 and len({d["sha"] for d in done}) == 1, run.stderr[-3000:]
    assert all(d["w0"] == d["expected"] and d["steps"] == steps and d["size"] == 2 for d in done)
    assert "did not come back within 2 s: dropped" in run.stderr
