"""Ctrl-C (or any signal whose Python handler raises) during a blocked
collective: the rank raises at once, not after RINGREDUCE_TIMEOUT, and its
peers raise PeerLostError naming it, over sockets and over MPI."""
import json
import os
import pickle
import secrets
import signal
import subprocess
import sys
import time

import pytest

from ranks import REPO, free_port, rank_env
from test_mpi import MPIRUN, _missing as mpi_missing

TIMEOUT = "60"  # RINGREDUCE_TIMEOUT: far longer than any bound asserted below

# Every rank: the role "absent" only waits for the test to release it; the
# others write their pid, block in an allreduce and report how it ended.
JOB = r"""
import json, os, pickle, signal, sys, time
import numpy as np
import ringreduce as rr

class Stop(Exception):
    pass

def on_term(signum, frame):
    raise Stop("SIGTERM handler")

usr1 = []
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, lambda signum, frame: usr1.append(signum))
rr.init(backend=os.environ["RR_TEST_BACKEND"])
d, roles = os.environ["RR_TEST_DIR"], json.loads(os.environ["RR_TEST_ROLES"])
role = roles.get(str(rr.rank()), "blocked")

def path(name):
    return os.path.join(d, name)

out = {"role": role}
if role == "absent":
    end = time.monotonic() + 90
    while not os.path.exists(path("release")) and time.monotonic() < end:
        time.sleep(0.05)
    if os.environ.get("RR_TEST_ABSENT_JOINS"):
        out["result"] = float(rr.allreduce(np.ones(1000))[0])
else:
    with open(path(f"pid.{rr.rank()}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(path(f"pid.{rr.rank()}.tmp"), path(f"pid.{rr.rank()}"))
    try:
        out["result"] = float(rr.allreduce(np.ones(1000))[0])
    except BaseException as exc:
        out.update(raised=type(exc).__name__, rank=getattr(exc, "rank", None), msg=str(exc),
                   at=time.monotonic())
        try:
            rr.allreduce(np.ones(3))
            out["after"] = "worked"
        except Exception as later:
            out["after"] = type(later).__name__
    out["usr1"] = len(usr1)
with open(path(f"result.{rr.rank()}"), "wb") as f:
    pickle.dump(out, f)
"""


def start(backend, n, roles, tmp_path, extra=None):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {"RR_TEST_BACKEND": backend, "RR_TEST_DIR": str(tmp_path), "RR_TEST_ROLES": json.dumps(roles),
           "RINGREDUCE_TIMEOUT": TIMEOUT, **(extra or {})}
    if backend == "mpi":
        full = {**os.environ, "PYTHONPATH": str(REPO), **env}
        return [subprocess.Popen([MPIRUN, "-np", str(n), sys.executable, str(script)], env=full,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    port, secret = free_port(), secrets.token_hex(16)
    return [subprocess.Popen([sys.executable, str(script)], env=rank_env(r, n, port, secret, env),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]


def wait_for(path, limit, procs):
    end = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > end or any(p.poll() not in (None, 0) for p in procs):
            return False
        time.sleep(0.02)
    return True


def finish(procs, tmp_path, n, limit=60):
    """Releases the absent ranks, waits for every process, returns each rank's report."""
    (tmp_path / "release").touch()
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=limit))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate())
    reports = {}
    for r in range(n):
        f = tmp_path / f"result.{r}"
        reports[r] = pickle.loads(f.read_bytes()) if f.exists() else None
    stderr = "\n".join(err[-3000:] for _, err in logs)
    return reports, stderr


def interrupt(backend, n, roles, tmp_path, target=1, sig=signal.SIGINT, extra=None):
    """Starts the job, sends `sig` to rank `target` once every non-absent rank is
    blocked, returns (reports, seconds from the signal to each raise, stderr)."""
    procs = start(backend, n, roles, tmp_path, extra)
    try:
        blocked = [r for r in range(n) if roles.get(str(r)) != "absent"]
        for r in blocked:
            assert wait_for(tmp_path / f"pid.{r}", 90, procs), f"rank {r} never got to its allreduce"
        time.sleep(1.0)  # into the C wait
        sent = time.monotonic()
        os.kill(int((tmp_path / f"pid.{target}").read_text()), sig)
        wait_for(tmp_path / f"result.{target}", 15, procs)
        for r in blocked:
            wait_for(tmp_path / f"result.{r}", 15, procs)
    finally:
        reports, stderr = finish(procs, tmp_path, n)
    delays = {r: rep["at"] - sent for r, rep in reports.items() if rep and "at" in rep}
    return reports, delays, stderr


BACKENDS = ["socket", pytest.param("mpi", marks=pytest.mark.skipif(mpi_missing() is not None,
                                                                     reason=str(mpi_missing())))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_interrupts_a_blocked_allreduce_at_once(tmp_path, backend):
    reports, delays, stderr = interrupt(backend, 2, {"0": "absent"}, tmp_path)
    me = reports[1]
    assert me and me.get("raised") == "KeyboardInterrupt", (me, stderr)
    assert delays[1] < 3.0, f"KeyboardInterrupt came {delays[1]:.1f} s after SIGINT (timeout {TIMEOUT} s)"
    assert me["after"] == "RingReduceError", me  # the communicator is broken from then on


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_raising_sigterm_handler_interrupts_the_same_way(tmp_path, backend):
    reports, delays, stderr = interrupt(backend, 2, {"0": "absent"}, tmp_path, sig=signal.SIGTERM)
    assert reports[1] and reports[1].get("raised") == "Stop", (reports[1], stderr)
    assert delays[1] < 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handler_that_returns_lets_the_collective_go_on(tmp_path, backend):
    procs = start(backend, 2, {"0": "absent"}, tmp_path, {"RR_TEST_ABSENT_JOINS": "1"})
    try:
        assert wait_for(tmp_path / "pid.1", 90, procs)
        time.sleep(1.0)
        os.kill(int((tmp_path / "pid.1").read_text()), signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        reports, stderr = finish(procs, tmp_path, 2)
    assert reports[1] and reports[1].get("result") == 2.0 and reports[1]["usr1"] == 1, (reports, stderr)
    assert reports[0] and reports[0].get("result") == 2.0, (reports, stderr)


@pytest.mark.parametrize("absent", [0, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_peers_of_an_interrupted_rank_name_it_promptly(tmp_path, backend, absent):
    reports, delays, stderr = interrupt(backend, 3, {str(absent): "absent"}, tmp_path)
    assert reports[1] and reports[1].get("raised") == "KeyboardInterrupt", (reports[1], stderr)
    peer = 2 if absent == 0 else 0
    got = reports[peer]
    assert got and got.get("raised") == "PeerLostError" and got["rank"] == 1, (got, stderr)
    assert delays[peer] < 6.0, f"rank {peer} learned after {delays[peer]:.1f} s (timeout {TIMEOUT} s)"
