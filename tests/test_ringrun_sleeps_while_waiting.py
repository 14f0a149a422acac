"""A waiting ringrun sleeps: while its ranks or workers run (or it waits for
them to start, join, or be restarted) it blocks on their exits, signals and
sockets, and takes a few percent of a core at most, never a busy loop's."""
import os
import signal
import subprocess
import sys
import time

import pytest

from ranks import REPO

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_while_waiting(args, settle=2.0, window=4.0):
    """ringrun's own CPU seconds over `window` s of wall time, `settle` s after its start."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGREDUCE_SECRET", None)
    p = subprocess.Popen([sys.executable, "-m", "ringreduce.run", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        time.sleep(settle)
        assert p.poll() is None, p.stderr.read().decode()
        before, t0 = cpu_seconds(p.pid), time.monotonic()
        time.sleep(window)
        used, wall = cpu_seconds(p.pid) - before, time.monotonic() - t0
        assert p.poll() is None, p.stderr.read().decode()
        return used, wall
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
JOINS_THEN_SLEEPS = [sys.executable, "-c", "import time, ringreduce as rr; rr.init(); time.sleep(60)"]
# exits at once with a code of its own per worker: never all alike, so restarted with back-off, again and again
FAILS_EACH_ITS_OWN_WAY = [sys.executable, "-c", "import os; os._exit(int(os.environ['RINGREDUCE_WORKER_ID']"
                          ".rpartition('#')[2]) % 7 + 1)"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("args", [
    ["-np", "2", *SLEEPER],
    ["--elastic", "-np", "2", *SLEEPER],  # workers not yet at the rendezvous
    ["--elastic", "-np", "2", *JOINS_THEN_SLEEPS],  # a generation formed, its workers busy
    ["--elastic", "-np", "3", "--min-np", "2", *FAILS_EACH_ITS_OWN_WAY],  # restarts due, a host left out
], ids=["plain", "elastic-starting", "elastic-training", "elastic-restarting"])
def test_a_waiting_ringrun_takes_almost_no_cpu(args):
    used, wall = cpu_while_waiting(args)
    # a busy loop takes ~wall; sleeping takes milliseconds a second (a slow, loaded machine: 5 % of wall)
    assert used < 0.05 * wall, f"ringrun used {used:.2f} s of CPU in {wall:.1f} s while waiting"
