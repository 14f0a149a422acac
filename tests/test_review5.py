"""Review of the small fast path, the arena's folds and the bfloat16 fold:
each test here failed on the merged code it names, and passes with its fix.
"""
from __future__ import annotations

import pytest

from ranks import run_ranks

# A small allreduce planned on every rank, then thread A runs a ring
# allreduce (a header pass, then the ring: two C calls under the Python
# lock). On rank 0 a second thread's planned small allreduce is started
# between A's two calls; on rank 1 after A ends. Each rank runs the two
# collectives in the same order (A, then the small one) if the small one
# waits for the lock, as it did before the fast path; the fast path ran it
# inside A, so rank 0's small round met rank 1's ring steps: a hang until
# RINGREDUCE_TIMEOUT, or worse.
INTERLEAVED = """
import threading
from ringreduce.core import collectives as C
r = rr.rank()
small = lambda: rr.allreduce(np.full(64, r + 1.0, np.float32), name="small")
small()  # planned on every rank
big = np.full(1 << 20, r + 1.0, np.float32)  # 4 MiB: the ring path
got = {}
def run_small():
    got["small"] = small()
if r == 0:
    real = C.exchange
    def between(*args, **kwargs):  # inside A: after its header pass, before its ring steps
        blobs = real(*args, **kwargs)
        C.exchange = real
        t = threading.Thread(target=run_small)
        t.start()
        t.join(2.0)  # the fast path ran it here; under the lock it waits for A
        got["thread"] = t
        return blobs
    C.exchange = between
got["big"] = rr.allreduce(big, name="big")
if r == 0:
    got["thread"].join(30)
else:
    run_small()
result = (float(got["big"][0]), float(got["big"][-1]), got["small"].tolist() == [3.0] * 64)
"""


def test_a_fast_call_never_runs_inside_another_threads_collective(tmp_path):
    ranks = run_ranks(2, INTERLEAVED, tmp_path, timeout=40, env={"RINGREDUCE_TIMEOUT": "5"})
    assert [x.result for x in ranks] == [(3.0, 3.0, True)] * 2
