"""Bytes sent, counted in C (csrc/transport/transport.h) and read by rr.stats()."""
import json

import pytest

from ranks import run_ranks

RING_JOB = """
count = 262_147                      # odd: chunks of unequal size
x = np.ones(count, dtype=np.float32)
rr.allreduce(np.ones(8, dtype=np.float32))   # warm: whatever a first call exchanges
rr.reset_stats()
rr.allreduce(x)
s = rr.stats(reset=True)
after_reset = rr.stats()
rr.allgather(np.ones((rr.rank() + 1, 100_000), dtype=np.int8))
g = rr.stats()
result = dict(ring=s, after=after_reset, gather=g, nbytes=x.nbytes)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_ring_allreduce_sends_2_n_minus_1_over_n_of_the_tensor(tmp_path, n):
    # No host arena: its small allgathers would move no bytes on the links at all.
    ranks = run_ranks(n, RING_JOB, tmp_path, timeout=90, env={"RINGREDUCE_ARENA_BYTES": "0"})
    for r in ranks:
        res = r.result
        expected = 2 * (n - 1) / n * res["nbytes"]
        ring = res["ring"]
        # every data byte counted, within one element per chunk of rounding; no alltoall
        assert abs(ring["ring"] - expected) <= 4 * n, (r.rank, ring, expected)
        assert ring["alltoall"] == 0
        # headers, not data, go as blobs: a few hundred bytes at most
        assert ring["blobs"] < 1024, ring
        assert ring["bytes_sent"] == ring["ring"] + ring["blobs"] + ring["alltoall"]
        assert res["after"]["bytes_sent"] == 0, "stats(reset=True) starts counting afresh"
        # an allgather forwards every other rank's block once: sum of all blocks but the receiver's own
        others = sum((q + 1) * 100_000 for q in range(n)) - ((r.rank + 1) % n + 1) * 100_000
        assert abs(res["gather"]["ring"] - others) <= 64 * n, (r.rank, res["gather"], others)
        # what this rank took in is what prev sent it, every byte: the same counts, header pass included
        prev = ranks[(r.rank - 1) % n].result
        assert ring["bytes_received"] == prev["ring"]["bytes_sent"], (ring, prev["ring"])
        # the allgather (blocks of unequal size) alike: taken in, what prev sent
        assert res["gather"]["bytes_received"] == prev["gather"]["bytes_sent"], (res["gather"], prev["gather"])


ENGINE_JOB = """
from ringreduce.engine import engine
rr.reset_stats()
h = engine().enqueue("w", np.ones(100_000, dtype=np.float32), op="sum")
engine().wait(h)
result = rr.stats()
engine().shutdown()
"""


def test_the_engine_counts_negotiation_as_blobs_and_the_timeline_shows_a_counter(tmp_path):
    trace = tmp_path / "trace.json"
    # No host arena: the negotiation's blobs would meet there, crossing no link.
    ranks = run_ranks(2, ENGINE_JOB, tmp_path, env={"RINGREDUCE_TIMELINE": str(trace), "RINGREDUCE_ARENA_BYTES": "0"},
                      timeout=90)
    for r in ranks:
        assert r.result["ring"] == pytest.approx(400_000, abs=8)
        assert r.result["blobs"] > 0  # the engine's negotiation
    events = json.loads(trace.read_text())
    counters = [e for e in events if e.get("ph") == "C" and e.get("name") == "bytes sent"]
    assert counters and counters[-1]["args"]["ring"] >= 400_000


def test_stats_before_init_is_zero():
    import ringreduce as rr
    assert not rr.is_initialized()
    assert rr.stats() == {"ring": 0, "blobs": 0, "alltoall": 0, "bytes_sent": 0,
                          "tcp": 0, "shm": 0, "cma": 0, "arena": 0, "mpi": 0, "bytes_received": 0,
                          "received_tcp": 0, "received_shm": 0, "received_cma": 0, "received_arena": 0,
                          "received_mpi": 0}


ONE_HOST_JOB = """
count = 262_147                      # odd: chunks of unequal size
x = np.ones(count, dtype=np.float32)
rr.allreduce(np.ones(8, dtype=np.float32))   # warm: whatever a first call exchanges
rr.reset_stats()
rr.allreduce(x)
big = rr.stats(reset=True)
rr.allreduce(np.ones(10, dtype=np.float32))  # small: meets in the host arena when there is one
small = rr.stats(reset=True)
result = dict(big=big, small=small, nbytes=x.nbytes)
"""
WAYS = ("tcp", "shm", "cma", "arena", "mpi")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("setting", ["default", "tcp-only"])
def test_a_one_host_job_counts_what_the_ring_sends_by_the_way_it_went(tmp_path, n, setting):
    """On one host the ring's data goes by shared memory (or CMA), headers and
    small allreduces meet in the host arena: all counted, by way, and the
    data bytes are what the ring schedule must send, 2 (N - 1) / N of the tensor."""
    env = {"RINGREDUCE_SHM_BYTES": "0", "RINGREDUCE_ARENA_BYTES": "0"} if setting == "tcp-only" else {}
    ranks = run_ranks(n, ONE_HOST_JOB, tmp_path, timeout=90, env=env)
    for r in ranks:
        big, small, nbytes = r.result["big"], r.result["small"], r.result["nbytes"]
        for s in (big, small):  # the two ways of counting hold the same bytes
            assert sum(s[w] for w in WAYS) == s["bytes_sent"] == s["ring"] + s["blobs"] + s["alltoall"], s
            assert s["mpi"] == 0 and s["alltoall"] == 0, s
        expected = 2 * (n - 1) / n * nbytes
        # the data, within one element per chunk of rounding; the header pass: a few hundred bytes at most
        assert abs(big["ring"] - expected) <= 4 * n, (r.rank, big, expected)
        assert 0 < big["blobs"] < 512 and expected - 4 * n <= big["bytes_sent"] <= expected + 4 * n + 512, big
        assert 0 < small["bytes_sent"] < 512, small  # a header and 40 bytes of data, not nothing
        received = sum(big[f"received_{w}"] for w in WAYS)
        assert received == big["bytes_received"], big
        # the ring's data from prev: what prev's ring sent it, by the same way
        prev = ranks[(r.rank - 1) % n].result["big"]
        assert abs(big["received_shm"] + big["received_cma"] + big["received_tcp"] - prev["ring"]) <= 512, (big, prev)
        if setting == "default":
            assert big["tcp"] == small["tcp"] == 0, (big, small)  # nothing crossed a socket
            assert big["shm"] + big["cma"] == big["ring"] and big["arena"] == big["blobs"], big
            assert small["arena"] == small["bytes_sent"], small
            # a slot written once is read by each other rank of the host: received n - 1 times over
            everyone = [x.result["small"] for x in ranks]
            assert sum(x["received_arena"] for x in everyone) == (n - 1) * sum(x["arena"] for x in everyone)
            assert big["received_tcp"] == small["received_tcp"] == 0, (big, small)
        else:
            assert big["tcp"] == big["bytes_sent"] and small["tcp"] == small["bytes_sent"], (big, small)
            assert big["received_tcp"] == big["bytes_received"] == prev["bytes_sent"], (big, prev)


MPI_SNIPPET = """
import json
import numpy as np, ringreduce as rr
rr.init(backend="mpi")
x = np.ones(262_147, np.float32)
rr.allreduce(np.ones(8, np.float32))
rr.reset_stats()
rr.allreduce(x)
open(f"{OUT}.{rr.rank()}", "w").write(json.dumps(rr.stats()))
"""


def test_the_mpi_transport_is_counted_alike(tmp_path):
    import os
    import subprocess
    import sys
    from test_mpi import MPIRUN, _missing
    from ranks import REPO
    if _missing():
        pytest.skip(_missing())
    script = tmp_path / "job.py"
    script.write_text(f"OUT = {str(tmp_path / 'sent')!r}\n" + MPI_SNIPPET)
    proc = subprocess.run([MPIRUN, "-np", "3", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        s = json.loads((tmp_path / f"sent.{r}").read_text())
        assert abs(s["ring"] - 2 * 2 / 3 * 262_147 * 4) <= 12, s
        assert s["mpi"] >= s["ring"] and s["tcp"] == s["shm"] == s["cma"] == 0, s
        assert s["mpi"] + s["arena"] == s["bytes_sent"], s


SET_JOB = """
ps = rr.add_process_set([0, 1])
rr.reset_stats()
x = np.ones(100_000, np.float32)
if rr.rank() in (0, 1):
    rr.allreduce(x, process_set=ps)
before = rr.stats()["ring"]
rr.remove_process_set(ps)
after = rr.stats()["ring"]
rr.reset_stats()
result = dict(before=before, after=after, reset=rr.stats()["ring"])
"""


def test_bytes_sent_on_a_removed_process_set_still_count_until_reset(tmp_path):
    ranks = run_ranks(3, SET_JOB, tmp_path, timeout=90)
    for r in ranks:
        res = r.result
        if r.rank in (0, 1):  # a 2-rank ring: 2 (N - 1) / N = 1 times the tensor
            assert res["before"] == pytest.approx(400_000, abs=8), res
        assert res["after"] >= res["before"], f"rank {r.rank}: stats went back when the set was removed: {res}"
        assert res["reset"] == 0
