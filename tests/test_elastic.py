"""Elastic training (ringrun --elastic, ringreduce.elastic): kill -9 a worker
mid-training, the survivors go on, nothing committed is lost, every rank
ends with the same bits, the worker comes back and the world grows again."""
import json
import os
import signal
import subprocess
import sys
import textwrap
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


RAISES = """
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic
    rr.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 1000:
            rr.allreduce(np.ones(3), name="g")
            state.step += 1
            if state.step == 3 and rr.rank() == {who}:
                raise ValueError("a bug in the training script")
            state.commit()
    train(state)
"""


@pytest.mark.timeout(40)
@pytest.mark.parametrize("who", ["rr.rank()", "1"], ids=["every-rank", "one-rank"])
def test_an_exception_in_the_training_function_ends_the_job(tmp_path, who):
    """A program error is not a lost worker: the job ends at once with the
    error, never restarts it (with back-off, up to 100 times, it would loop
    for ~50 minutes)."""
    job = tmp_path / "raises.py"
    job.write_text(textwrap.dedent(RAISES.replace("{who}", who)))
    started = time.monotonic()
    run = ElasticRun(["-np", "3", "--min-np", "2", sys.executable, str(job)], timeout=30)
    assert run.proc.returncode == 1, run.stderr[-3000:]
    assert time.monotonic() - started < 25
    assert "restarting it" not in run.stderr, run.stderr[-3000:]
    assert "raised ValueError: a bug in the training script" in run.stderr, run.stderr[-3000:]


def test_a_malformed_message_on_the_rendezvous_port_harms_no_one():
    """An authenticated peer that sends nonsense (a bad port, bytes that are
    not JSON, a frame larger than any message) is dropped; the rendezvous
    goes on forming generations (its thread never dies: that would hang the job)."""
    from ringreduce.core import world as _world
    from ringreduce.launch.rendezvous_server import RendezvousServer

    key = b"job secret"
    server = RendezvousServer(key, expected=1, min_np=1, settle=0.1)
    addr = ("127.0.0.1", server.port)
    try:
        def dial():
            return _world.dial(addr, time.monotonic() + 5, key, "rendezvous")
        bad_port = dial()
        _world.send_msg(bad_port, {"register": "evil#1", "port": "not a number"})
        not_json = dial()
        _world.send_msg(not_json, {"register": "evil#2", "port": 1})
        not_json.sendall(b"\x05\x00\x00\x00{{{{{")
        huge = dial()
        _world.send_msg(huge, {"register": "evil#3", "port": 1})
        huge.sendall(b"\xff\xff\xff\x7f" + b"x" * 1000)
        time.sleep(0.5)
        assert server.thread.is_alive(), "the rendezvous thread died"
        # each stray was dropped: the real worker forms a generation of one, alone
        for s in (bad_port, not_json, huge):
            s.settimeout(5)
            assert s.recv(1) == b"", "the stray was not dropped"
        good = dial()
        _world.send_msg(good, {"register": "good#1", "port": 4242, "host": "h"})
        msg = _world.recv_msg(good, time.monotonic() + 5)
        assert msg["assign"]["size"] == 1 and msg["assign"]["ports"] == [4242], msg
        for s in (bad_port, not_json, huge, good):
            s.close()
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_elastic_run_outside_an_elastic_job_fails_fast(tmp_path):
    """Without ringrun --elastic nothing changes: a lost peer inside
    @elastic.run is a PeerLostError, fast, never an attempt to re-form a
    ring (re-running init and waiting for the dead rank, again and again)."""
    from ranks import collect, start_ranks
    body = """
    from ringreduce import elastic
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 100000:
            if rr.rank() == 2 and state.step == 5:
                os._exit(3)
            rr.allreduce(np.ones(5000), name="g")
            state.step += 1
            state.commit()
    try:
        train(state)
    except rr.RingReduceError as exc:
        result = type(exc).__name__
    """
    started = time.monotonic()
    ranks = collect(start_ranks(3, body, tmp_path, env={"RINGREDUCE_START_TIMEOUT": "20", "RINGREDUCE_TIMEOUT": "10"}),
                    timeout=45, check=False)
    assert time.monotonic() - started < 30
    assert [r.returncode for r in ranks] == [0, 0, 3], [r.stderr[-1500:] for r in ranks]
    assert ranks[0].result == ranks[1].result == "PeerLostError", [r.stderr[-1500:] for r in ranks]


@pytest.mark.timeout(120)
def test_keras_callbacks_in_horovods_order_commit_the_epoch_and_batch_they_saved(tmp_path):
    """Horovod's documented order is [CommitStateCallback, UpdateBatchStateCallback,
    UpdateEpochStateCallback]: Keras calls them in that order, and each commit
    must hold each batch's weights with that batch counted, and an epoch's
    weights with that epoch counted (else a restore trains that epoch twice)."""
    from ranks import run_ranks
    body = """
    import keras
    import ringreduce.tensorflow.keras as hvd
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    seen = []

    class Check(keras.callbacks.Callback):  # runs after the three: what the last commit holds by now
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(("batch", state._saved["epoch"], state._saved["batch"]))

    x = np.ones((12, 4), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[
        hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state), Check()])
    trained = [w.copy() for w in model.get_weights()]
    state.restore()  # nothing ran since the last commit: it holds the end of training
    result = (seen, state.epoch, state.batch, all((a == b).all() for a, b in zip(trained, model.get_weights())))
    """
    (r,) = run_ranks(1, body, tmp_path, timeout=100)
    seen, epoch, batch, same = r.result
    # before batch k of epoch e, the last commit is of batch k (k batches done) of epoch e
    assert seen == [("batch", e, k) for e in range(2) for k in range(3)], seen
    assert (epoch, batch, same) == (2, 0, True)


KILLED_IN_RESET = """
    import json, os, signal, sys, time
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic

    def once(mark):  # true in the first process of the whole job to ask
        try:
            os.close(os.open(os.path.join(sys.argv[1], mark), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    rr.init()
    state = elastic.ObjectState(step=0, w=np.zeros(3))

    before = [rr.size()]

    def relearn():
        # a reset callback that runs a collective, as the TensorFlow layer's does; only when the ring
        # shrank (every member a survivor: a newcomer runs no reset callback before its first sync)
        if rr.size() < before[0]:
            if rr.rank() == 1 and once("second"):
                os.kill(os.getpid(), signal.SIGKILL)  # a second loss while the first reset is in progress
            rr.allreduce(np.ones(5000), name="relearn")
        before[0] = rr.size()
    state.register_reset_callbacks([relearn])

    @elastic.run
    def train(state):
        while state.step < 60:
            if state.step == 5 and rr.rank() == 3 and once("first"):
                os.kill(os.getpid(), signal.SIGKILL)
            state.w = state.w + rr.allreduce(np.ones(3), op="avg", name="g")
            state.step += 1
            time.sleep(0.02)
            state.commit()
        while rr.size() < 4:  # until both restarted workers joined (HostsUpdatedInterrupt at a commit)
            time.sleep(0.05)
            state.commit()
    train(state)
    print("done " + json.dumps({"step": state.step, "w": state.w.tolist()}), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_loss_during_a_reset_callback_resets_again(tmp_path):
    """A peer lost while the reset callbacks run (the TensorFlow layer's is a
    collective) is one more lost peer: run() resets again, never lets its
    PeerLostError out (every survivor would die, the state in memory lost)."""
    job = tmp_path / "killed_in_reset.py"
    job.write_text(textwrap.dedent(KILLED_IN_RESET))
    run = ElasticRun(["-np", "4", "--min-np", "2", sys.executable, str(job), str(tmp_path)], timeout=80)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "first").exists() and (tmp_path / "second").exists()
    assert "exited with code" not in run.stderr, run.stderr[-3000:]  # only the two killed ones ended
    assert run.stderr.count("was killed by SIGKILL") == 2, run.stderr[-3000:]
    done = run.done()
    assert len(done) == 4 and all(d == {"step": 60, "w": [60.0] * 3} for d in done), done


RARE_COMMITS = """
    import json, sys, time
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic
    rr.init()
    print("joined", rr.size(), flush=True)
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while rr.size() < 3:  # commits (where newcomers are let in) only every 5 s, e.g. once an epoch
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                rr.allreduce(np.ones(3), name="g")
                time.sleep(0.05)
            state.step += 1
            state.commit()
    train(state)
    print("done " + json.dumps({"size": rr.size(), "step": state.step}), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_newcomer_waits_for_the_next_commit_however_far(tmp_path):
    """A newcomer queued behind a running ring waits for its next commit,
    however long that is, not RINGREDUCE_START_TIMEOUT (it would fail, be
    restarted, and fail again, its host left out, while the ring commits less
    often than that)."""
    job = tmp_path / "rare_commits.py"
    job.write_text(textwrap.dedent(RARE_COMMITS))
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")

    def grow(line):
        if line.rstrip().endswith("] joined 2"):
            hosts.write_text("localhost:3\n")  # a slot appears once the ring of 2 runs: its worker waits
        return None
    run = ElasticRun(["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
                      sys.executable, str(job)], kill_when=grow, timeout=80, env={"RINGREDUCE_START_TIMEOUT": "3"})
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert "exited with code" not in run.stderr, run.stderr[-3000:]
    done = run.done()
    assert len(done) == 3 and all(d["size"] == 3 for d in done), run.stderr[-3000:]


def test_a_malformed_host_list_is_a_message_not_a_traceback(tmp_path):
    """`host:two` from the discovery script (run every second) is said and
    skipped, the last good list kept, never a ValueError ending ringrun's
    watch loop and the whole job; with -H it is refused, not a traceback."""
    from ringreduce.launch import elastic_launcher as el

    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:two\n")
    script.chmod(0o755)
    assert el.discover(str(script)) is None  # failed: keep the last list
    for bad in ("localhost:two", "localhost:-1", ":2"):
        with pytest.raises(ValueError, match="host:slots"):
            el.parse_slots(bad)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "--elastic", "-np", "1", "-H", "localhost:x", "true"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "host:slots" in out.stderr, out.stderr
