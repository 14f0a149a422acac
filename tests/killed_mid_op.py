"""One check for every shared-memory path (tests/test_shm_zerocopy.py,
test_shm_cma.py, test_shared_arrays.py): rank 1 is SIGKILLed in the middle
of a run of 16 MiB allreduces; every other rank raises PeerLostError naming
rank 1 within seconds (not the 20 s timeout), and the path under test really
ran before it (its op counter moved)."""
from __future__ import annotations

import signal

from ranks import run_ranks


def check_killed_rank_is_named(tmp_path, n: int, setup: str, counter: str, env: dict) -> None:
    """setup: code that makes x (16 MiB) and runs one allreduce on it by the
    path; counter: the Comm method counting that path's operations."""
    ranks = run_ranks(n, f"""
import os, signal, threading, time
from ringreduce import collectives as C
{setup}
before = C._state.comm.{counter}()
if rr.rank() == 1:  # dies in the middle of a later allreduce
    threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
t0 = time.time()
try:
    for i in range(50):
        rr.allreduce(x)
    result = "no error"
except rr.PeerLostError as e:
    result = (e.rank, str(e), time.time() - t0, before)
""", tmp_path, timeout=60, env={**env, "RINGREDUCE_TIMEOUT": "20"}, check=False)
    assert ranks[1].returncode == -signal.SIGKILL
    for r in ranks:
        if r.rank == 1:
            continue
        assert r.returncode == 0, r.stderr
        lost, message, elapsed, before = r.result
        assert before >= 1, f"the path under test did not run ({counter} = 0)"
        assert lost == 1 and "rank 1" in message, (r.rank, message)
        assert elapsed < 10, f"rank {r.rank} took {elapsed:.1f} s to notice"
