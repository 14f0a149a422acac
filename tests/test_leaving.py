"""How a rank leaves while a collective is in flight, and what a forked
child may do: each way must end this rank promptly and let the peers name
it, never deadlock it or confuse their blame."""
import os
import signal
import subprocess
import sys
import time

from ranks import collect, free_port, rank_env, run_ranks, start_ranks

TIMEOUT = {"RINGREDUCE_TIMEOUT": "60"}  # far longer than any bound below


def _wait_for(path, seconds=60):
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


def _start(n, body, tmp_path, env):
    """Ranks whose stdout/stderr go to files, so a test can signal one while the others run."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys, signal, time\nimport numpy as np\nimport ringreduce as rr\n" + body)
    port, secret = free_port(), "s3cret"
    procs = []
    for r in range(n):
        e = rank_env(r, n, port, secret, {**env, "RR_TEST_DIR": str(tmp_path)})
        procs.append(subprocess.Popen([sys.executable, str(script)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs, seconds):
    try:
        return [p.communicate(timeout=seconds) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_sigterm_handler_that_shuts_down_inside_a_collective_ends_the_rank(tmp_path):
    # The handler runs (from the interrupt hook) on the thread that holds the
    # communicator: shutdown() there must not wait for itself.
    procs = _start(2, """
def on_term(signum, frame):
    rr.shutdown()
    sys.exit(7)
signal.signal(signal.SIGTERM, on_term)
rr.init()
if rr.rank() == 1:
    time.sleep(30)          # never joins in time
open(os.path.join(os.environ["RR_TEST_DIR"], "blocked"), "w").close()
rr.allreduce(np.ones(10))
""", tmp_path, TIMEOUT)
    _wait_for(tmp_path / "blocked")
    time.sleep(0.5)
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    try:
        procs[0].wait(timeout=20)
    finally:
        procs[1].kill()
    assert procs[0].returncode == 7, procs[0].stderr.read()[-2000:]
    assert time.monotonic() - t0 < 10


def test_ctrl_c_while_the_engine_waits_ends_the_rank_and_names_it_on_the_peers(tmp_path):
    # Training waits in Engine.wait while the engine's thread is inside the
    # collective: the KeyboardInterrupt ends the process at once (shutdown at
    # exit interrupts the engine's collective), and the peer names this rank.
    procs = _start(2, """
from ringreduce.engine import engine
rr.init()
d = os.environ["RR_TEST_DIR"]
if rr.rank() == 1:
    while not os.path.exists(os.path.join(d, "interrupted")):
        time.sleep(0.05)
    time.sleep(1.0)
    try:
        rr.allreduce(np.ones(10))
        print("RESULT no error")
    except rr.PeerLostError as e:
        print("RESULT", e.rank)
    sys.exit(0)
h = engine().enqueue("grad", np.ones(100_000, dtype=np.float32))
open(os.path.join(d, "blocked"), "w").close()
engine().wait(h)
""", tmp_path, TIMEOUT)
    _wait_for(tmp_path / "blocked")
    time.sleep(0.5)
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGINT)
    try:
        procs[0].wait(timeout=30)
        rank0_exit = time.monotonic() - t0
    finally:
        (tmp_path / "interrupted").touch()
    (out0, err0, code0), (out1, err1, code1) = _finish(procs, 60)
    assert code0 != 0 and "KeyboardInterrupt" in err0, err0[-2000:]
    assert rank0_exit < 10, f"rank 0 took {rank0_exit:.1f} s to exit after Ctrl-C"
    assert "RESULT 0" in out1, (out1, err1[-2000:])


def test_a_forked_child_that_exits_leaves_the_parents_ring_alone(tmp_path):
    # The child inherits the ring; its exit (atexit shutdown) must not stop
    # the parent's control thread or tell the peers the parent left.
    ranks = run_ranks(3, """
        if rr.rank() == 1:
            pid = os.fork()
            if pid == 0:
                try:
                    rr.allreduce(np.ones(3))
                    child = "used the parent's ring"
                except rr.RingReduceError as e:
                    child = str(e)
                with open(os.environ["RR_TEST_RESULT"] + ".child", "w") as f:
                    f.write(child)
                sys.exit(0)                       # atexit runs shutdown() in the child
            os.waitpid(pid, 0)
        before = rr.allreduce(np.ones(3)).tolist()
        if rr.rank() == 1:
            os._exit(3)                           # a crash, not a goodbye
        try:
            rr.allreduce(np.ones(300_000))
            result = "no error"
        except rr.PeerLostError as e:
            result = (before, e.rank, str(e))
    """, tmp_path, timeout=90, check=False, env={"RINGREDUCE_TIMEOUT": "20"})
    child = next(tmp_path.glob("*rank1.pkl.child")).read_text()
    assert "not initialized" in child, child
    for r in (ranks[0], ranks[2]):
        assert r.result != "no error" and r.result is not None, r.stderr[-2000:]
        before, lost, message = r.result
        assert before == [3.0] * 3 and lost == 1, r.result
        assert "shut down" not in message, f"rank {r.rank} took the crash for a goodbye: {message}"
