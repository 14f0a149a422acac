"""rr.allreduce's fast path for small messages, one at a time: a
small allreduce whose (shape, dtype, op, name) its ring has already run
reuses that call's plan (header, codes, path) and makes one C call. It must
change nothing a user can see: a new shape, dtype, op or name plans afresh;
a rank that disagrees after many agreeing calls is still named on every
rank; bad input still refused on every rank; a moved limit moves the path;
shutdown() still interrupts a call in flight. On the socket backend (host
arena) through tests/ranks.py, and over MPI by recursive doubling.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ranks import REPO, run_ranks

# The body every rank runs (after rr.init()); `result` comes back per rank.
CHECKS = """
from ringreduce.core import collectives as C
n, r = rr.size(), rr.rank()
ring = C.communicator().ring
res = {}

# Headers built by the checked path: the fast path builds none.
built = []
heads = []  # (inline, root) of each allreduce header: a small one says its data rides inline; none names a root
_real_header = C.header
def _counting(*a, **k):
    built.append(a[:5])
    head = _real_header(*a, **k)
    if a[0] == C.ALLREDUCE:
        parsed = C.parse(head)
        heads.append((parsed["inline"], parsed["root"]))
    return head
C.header = _counting

def inputs(shape, dt, k):
    return ((np.arange(int(np.prod(shape))) % 7 + k + 1).astype(dt)).reshape(shape)

def want(shape, dt, op):
    xs = [inputs(shape, dt, k) for k in range(n)]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = {"sum": np.add, "avg": np.add, "max": np.maximum, "prod": np.multiply}[op](acc, x)
    return (acc / acc.dtype.type(n)).astype(dt) if op == "avg" else acc

def same(got, expect):
    return type(got) is np.ndarray and got.dtype == expect.dtype and got.shape == expect.shape and \\
        got.tobytes() == expect.tobytes()

# 1. One plan per (shape, dtype, op, name): changing any one between calls plans afresh, never reuses.
variants = [((1000,), np.float32, "sum", None), ((10, 100), np.float32, "sum", None),
            ((1000,), np.float64, "sum", None), ((1000,), np.float32, "max", None),
            ((1000,), np.float32, "sum", "grad"), ((1000,), np.int32, "prod", None),
            ((1000,), np.float32, "avg", None), ((1001,), np.float32, "sum", None), ((), np.float32, "sum", None)]
wrong = []
for it in range(3):
    for shape, dt, op, name in variants:
        got = rr.allreduce(inputs(shape, dt, r), op=op, name=name)
        if not same(got, want(shape, dt, op)):
            wrong.append((it, shape, np.dtype(dt).name, op, name))
res["wrong"] = wrong
res["built"] = len(built)  # the first round only
res["heads"] = sorted(set(heads))
res["plans"] = len(getattr(ring, "plans", ()))

# 2. out= and in place, valid but unusable as given (the C call declines): the checked path, same results.
x = inputs((64,), np.float32, r)
expect = want((64,), np.float32, "sum")
cases = {}
for it in range(3):
    out = np.zeros(64, np.float32)
    cases.setdefault("out", []).append(same(rr.allreduce(x, out=out), expect) and same(out, expect))
    y = x.copy()
    cases.setdefault("inplace", []).append(rr.allreduce(y, out=y) is y and same(y, expect))
    wide = np.zeros(128, np.float32)
    rr.allreduce(x, out=wide[::2])
    cases.setdefault("strided out", []).append(same(wide[::2].copy(), expect) and not wide[1::2].any())
    cases.setdefault("strided x", []).append(same(rr.allreduce(np.repeat(x, 2)[::2]), expect))
    cases.setdefault("big-endian x", []).append(same(rr.allreduce(x.astype(">f4")), expect))
    ro = np.zeros(64, np.float32)
    ro.flags.writeable = False
    cases.setdefault("read-only x", []).append(same(rr.allreduce(np.frombuffer(x.tobytes(), np.float32)), expect))
res["cases"] = cases

# 3. After many agreeing calls (all on the fast path), the last rank disagrees: named on every rank.
for _ in range(200):
    rr.allreduce(np.ones(32, np.float32))
odd = r == n - 1
mismatch = {}
for what, call in (("shape", lambda: rr.allreduce(np.ones(33 if odd else 32, np.float32))),
                   ("dtype", lambda: rr.allreduce(np.ones(32, np.float64 if odd else np.float32))),
                   ("op", lambda: rr.allreduce(np.ones(32, np.float32), op="max" if odd else "sum")),
                   ("name", lambda: rr.allreduce(np.ones(32, np.float32), name="b" if odd else None)),
                   ("read-only out", lambda: rr.allreduce(np.ones(32, np.float32), out=ro[:32] if odd else None)),
                   ("out shape", lambda: rr.allreduce(np.ones(32, np.float32),
                                                      out=np.empty(33, np.float32) if odd else None))):
    try:
        call()
        mismatch[what] = None
    except rr.MismatchError as exc:
        mismatch[what] = "MismatchError: " + str(exc)
    except (TypeError, ValueError) as exc:
        mismatch[what] = "own " + type(exc).__name__
    rr.allreduce(np.ones(32, np.float32))  # and the ring goes on, on the fast path again
res["mismatch"] = mismatch
res["after"] = rr.allreduce(np.full(32, r + 1.0, np.float32)).tolist()

# 4. The limit moved (autotune sets ring.small_limit): the planned call takes the ring; moved back, the small path.
z = np.ones(2048, np.float32)
for _ in range(3):
    rr.allreduce(z)
ring_bytes = rr.stats()["ring"]
small_limit = ring.small_limit
ring.small_limit = -1
moved = rr.allreduce(z)
res["moved ring bytes"] = rr.stats()["ring"] - ring_bytes
ring.small_limit = small_limit
rr.allreduce(z)
ring_bytes = rr.stats()["ring"]
rr.allreduce(z)
res["back ring bytes"] = rr.stats()["ring"] - ring_bytes
res["moved"] = moved.tolist() == [float(n)] * 2048
result = res
"""


def _check(ranks, n):
    res = [r.result if hasattr(r, "result") else r for r in ranks]
    for i, got in enumerate(res):
        assert got["wrong"] == [], f"rank {i}: {got['wrong']}"
        assert got["built"] == 9, f"rank {i}: {got['built']} headers built for 9 variants x 3 rounds"
        assert got["plans"] >= 9
        assert got["heads"] == [(True, 0)], f"rank {i}: small allreduce headers (inline, root) {got['heads']}"
        for case, oks in got["cases"].items():
            assert all(oks), f"rank {i}: {case} {oks}"
        assert got["after"] == [n * (n + 1) / 2] * 32
        assert got["moved"] and got["moved ring bytes"] > 0 and got["back ring bytes"] == 0, got
        mm = got["mismatch"]
        if i == n - 1:
            assert mm["read-only out"] == mm["out shape"] == "own ValueError", mm
        else:
            assert mm["read-only out"].startswith("MismatchError") and f"rank {n - 1}:" in mm["read-only out"], mm
            assert mm["out shape"].startswith("MismatchError") and f"rank {n - 1}:" in mm["out shape"], mm
        for what, says in (("shape", f"rank {n - 1}: (33,)"), ("dtype", f"rank {n - 1}: float64"),
                           ("op", f"rank {n - 1}: max"), ("name", f"rank {n - 1}: 'b'")):
            assert mm[what] is not None and mm[what].startswith("MismatchError") and says in mm[what], (i, what, mm)
            assert mm[what] == res[0]["mismatch"][what]  # the same message on every rank


@pytest.mark.parametrize("n", [2, 3])
def test_fast_path_plans_per_call_and_keeps_every_check_sockets(tmp_path, n):
    _check(run_ranks(n, CHECKS, tmp_path, timeout=80), n)


def test_shutdown_interrupts_a_fast_path_call_waiting_for_a_late_peer(tmp_path):
    # Rank 0's allreduce (planned: the fast path, without the Python lock)
    # waits for rank 1, which sleeps; shutdown() on another thread must end
    # it at once, as it ends a call holding the lock, not wait for the peer.
    results = run_ranks(2, """
        import threading, time
        for _ in range(3):
            rr.allreduce(np.ones(16, np.float32))
        if rr.rank() == 1:
            time.sleep(6)
            try:
                rr.allreduce(np.ones(16, np.float32))
            except rr.RingReduceError:
                pass
            result = None
        else:
            threading.Timer(0.5, rr.shutdown).start()
            t0 = time.monotonic()
            try:
                rr.allreduce(np.ones(16, np.float32))
                error = None
            except rr.RingReduceError as exc:
                error = type(exc).__name__
            result = error, time.monotonic() - t0
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "30"})
    error, seconds = results[0].result
    assert error is not None and seconds < 4, (error, seconds)


# --------------------------------------------------------------------------- over MPI

def _mpirun(n, body, tmp_path, timeout=80, env=None):
    from test_mpi import MPIRUN, _missing
    if _missing() is not None:
        pytest.skip(str(_missing()))
    import pickle
    script = tmp_path / "job.py"
    script.write_text("import os, pickle\nimport numpy as np\nimport ringreduce as rr\nresult = None\n"
                      "rr.init(backend='mpi')\n" + body +
                      "\nwith open(os.environ['OUT'] + '.rank%d' % rr.rank(), 'wb') as f:\n"
                      "    pickle.dump(result, f)\n")
    out = tmp_path / "out"
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
                                                "OUT": str(out), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [pickle.loads((tmp_path / f"out.rank{r}").read_bytes()) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_fast_path_plans_per_call_and_keeps_every_check_mpi(tmp_path, n):
    _check(_mpirun(n, CHECKS, tmp_path), n)


def test_a_changed_small_algorithm_moves_a_planned_call_mpi(tmp_path):
    # N = 4: 48 KiB is small by recursive doubling (limit 64 KiB) but not
    # around the ring (128 KiB / 3): a plan made under one must not outlive
    # Comm.set_small_algorithm. Without the host arena, which would take
    # both (tests/test_mpi_arena.py).
    ranks = _mpirun(4, """
comm = rr.core.communicator().ring.comm
x = np.ones(12288, np.float32)
seen = []
for algo in ("doubling", "ring", "doubling"):
    comm.set_small_algorithm(algo)
    for _ in range(3):
        before = rr.stats()["ring"]
        ok = rr.allreduce(x).tolist() == [4.0] * 12288
        seen.append((algo, ok, rr.stats()["ring"] - before > 0))
result = seen
""", tmp_path, env={"RINGREDUCE_ARENA_BYTES": "0"})
    for seen in ranks:
        assert all(ok for _, ok, _ in seen), seen
        assert [ring for algo, _, ring in seen] == [algo == "ring" for algo, _, _ in seen], seen


def test_a_forked_child_cannot_use_the_parents_comm_on_the_fast_path(tmp_path):
    # The fork check no longer asks the kernel for the pid on every call
    # (an atfork handler keeps it): a child calling the parent's Comm
    # straight, the planned header in hand, is still refused.
    ranks = run_ranks(2, """
        from ringreduce.core import collectives as C
        x = np.ones(8, np.float32)
        for _ in range(3):
            rr.allreduce(x)
        comm, plan = C.communicator().ring.comm, next(iter(C.communicator().ring.plans.values()))
        if rr.rank() == 1:
            pid = os.fork()
            if pid == 0:
                try:
                    comm.try_allreduce_small(plan.head, x, np.empty_like(x), plan.code, plan.opc)
                    child = "used the parent's ring"
                except rr.RingReduceError as e:
                    child = str(e)
                with open(os.environ["RR_TEST_RESULT"] + ".child", "w") as f:
                    f.write(child)
                os._exit(0)
            os.waitpid(pid, 0)
        result = rr.allreduce(x).tolist()
    """, tmp_path, timeout=60)
    child = next(tmp_path.glob("*rank1.pkl.child")).read_text()
    assert "forked" in child, child
    assert [r.result for r in ranks] == [[2.0] * 8] * 2


def test_fast_path_in_a_process_set_plans_on_the_sets_ring_and_names_world_ranks(tmp_path):
    ranks = run_ranks(3, """
        from ringreduce.core import collectives as C
        evens = rr.add_process_set([0, 2])
        result = None
        if evens.included():
            r = rr.rank()
            ok = all(rr.allreduce(np.full(40, r + 1.0, np.float32), process_set=evens).tolist() == [4.0] * 40
                     for _ in range(50))
            planned = len(C.communicator().sets[evens.process_set_id].plans)
            try:
                rr.allreduce(np.ones(41 if r == 2 else 40, np.float32), process_set=evens)
                mismatch = None
            except rr.MismatchError as exc:
                mismatch = str(exc)
            result = ok, planned, mismatch, len(C.communicator().ring.plans)
        rr.barrier()
    """, tmp_path, timeout=60)
    for r in (0, 2):
        ok, planned, mismatch, world_plans = ranks[r].result
        assert ok and planned == 1 and world_plans == 0, ranks[r].result
        assert mismatch is not None and "world rank 2 (rank 1 of set" in mismatch and "(41,)" in mismatch, mismatch
    assert ranks[1].result is None


# A small allreduce planned on every rank, then thread A runs a ring
# allreduce (a header pass, then the ring: two C calls under the Python
# lock). On rank 0 a second thread's planned small allreduce is started
# between A's two calls; on rank 1 after A ends. Each rank runs the two
# collectives in the same order (A, then the small one) only if the fast
# path, too, waits for the lock: run inside A, rank 0's small round would
# meet rank 1's ring steps (a hang until RINGREDUCE_TIMEOUT, or worse).
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
