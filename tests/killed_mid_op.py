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
from ringreduce.core import collectives as C
{setup}
before = C.communicator().comm.{counter}()
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


def check_interrupted_rank_overwriting_is_refused(tmp_path, n: int, make_buf: str, counter: str, env: dict) -> None:
    """Rank 1 is interrupted (Ctrl-C) mid-loop and overwrites its buffer at
    once, as a caller's cleanup might: a neighbour that may still be reading
    it must raise PeerLostError, never return a sum with the new bytes.
    make_buf: an expression for the int64 buffer; counter: the Comm method
    counting the path's operations."""
    ranks = run_ranks(n, f"""
import os, signal, threading
from ringreduce.core import collectives as C
buf = {make_buf}
rr.allreduce(buf, out=buf)
before, wrong, outcome = C.communicator().comm.{counter}(), 0, "done"
if rr.rank() == 1:
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    for i in range(200):
        buf[:] = (rr.rank() + 1) * (i + 1)
        rr.allreduce(buf, op="sum", out=buf)
        wrong += int(np.count_nonzero(buf != (i + 1) * rr.size() * (rr.size() + 1) // 2))
except KeyboardInterrupt:
    buf[:] = -(1 << 40)
    outcome = "interrupted"
except rr.RingReduceError as e:
    outcome = type(e).__name__
result = (wrong, outcome, C.communicator().comm.{counter}() - before)
""", tmp_path, timeout=90, env={**env, "RINGREDUCE_TIMEOUT": "20"})
    for r in ranks:
        wrong, outcome, ops = r.result
        assert wrong == 0, (r.rank, r.result)
        assert ops >= 1, (r.rank, f"the path under test did not run ({counter} = 0)")
        assert outcome == ("interrupted" if r.rank == 1 else "PeerLostError"), (r.rank, r.result)
