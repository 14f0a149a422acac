"""Defects found by a hostile review of elastic training (ringrun --elastic,
ringreduce.elastic, the rendezvous), each with the test that showed it."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ranks import REPO
from test_elastic import ElasticRun

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
    """A program error is not a lost worker: restarting it would loop (the
    old code restarted it with back-off, up to 100 times, for ~50 minutes)."""
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
    goes on forming generations (the old code's thread died: a hung job)."""
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
    @elastic.run is the PeerLostError of today, not an attempt to re-form a
    ring (the old code re-ran init and waited for the dead rank, again and again)."""
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
    UpdateEpochStateCallback]: Keras calls them in that order, so the old
    CommitStateCallback saved each batch's weights with the batch count of the
    batch before, and an epoch's weights with the epoch not yet counted (a
    restore then trained that epoch twice)."""
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


@pytest.mark.parametrize("args, says", [
    (["-np", "2", "--max-restarts", "3", "true"], "--max-restarts needs --elastic"),
    (["-np", "2", "--elastic-timeout", "5", "true"], "--elastic-timeout needs --elastic"),
    (["--elastic", "-np", "2", "--max-np", "1", "true"], "-np (2) <= --max-np (1)"),
    (["--elastic", "-np", "2", "--min-np", "two", "true"], "--min-np: invalid int value: 'two'"),
    (["--elastic", "-np", "2", "--max-restarts", "-1", "true"], "must not be negative"),
])
def test_elastic_flags_are_checked(args, says):
    """An elastic flag without --elastic was silently ignored (--max-restarts,
    --elastic-timeout): the user believed the job elastic."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 2 and says in out.stderr, out.stderr


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
    collective) is one more lost peer: the old code let its PeerLostError out
    of run(), so every survivor died and the state in memory was lost."""
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
    however long that is: the old code gave it RINGREDUCE_START_TIMEOUT, then
    it failed, was restarted, and failed again (its host left out) while the
    ring committed less often than that."""
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
    """`host:two` from the discovery script crashed ringrun's watch loop with
    a ValueError (the whole job ended for one bad line of a script that is
    run every second); with -H it was a traceback. Now the script's bad
    output is said and skipped (the last good list kept), and -H is refused."""
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
