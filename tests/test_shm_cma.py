"""The ring by Cross Memory Attach (csrc/schedule/cma.c; RINGREDUCE_SHM_CMA): each
rank reads its previous neighbour's chunk straight out of that process's
buffers. It must give numpy's results, bit for bit those of the copying path
and of zero copy through the mappings, on every rank alike; fall back (all
ranks alike) where a probe is refused; and name a rank that dies mid-op.

Each job runs the same operations with the three paths switched on every
rank between operations (Comm.set_zero_copy / set_cma) and checks cma_ops,
so the CMA path really ran: it runs from 1 MiB a chunk (RR_CMA_MIN_CHUNK).
"""
import pytest

from killed_mid_op import check_interrupted_rank_overwriting_is_refused, check_killed_rank_is_named
from ranks import run_ranks

PRELUDE = """
from cases import DTYPES, OPS, close_enough, digest, make_input, mean_error_bound, np_dtype, reference
from ringreduce import collectives as C

def three(fn, comm=None):
    # fn's result by CMA, by zero copy through the mappings, by the copying
    # path; and how many operations took the CMA path
    comm = comm or C._state.comm
    pid = comm.cma_pid
    assert pid, "every rank should have agreed on CMA"
    got = {}
    for path, zc, cma in (("cma", True, pid), ("zc", True, 0), ("copy", False, 0)):
        comm.set_zero_copy(zc)
        assert comm.set_cma(cma) == (path == "cma")
        before = comm.cma_ops()
        got[path] = fn()
        got[path, "ops"] = comm.cma_ops() - before
    comm.set_zero_copy(True)
    comm.set_cma(pid)
    return got

def same(got):
    return got["cma"].tobytes() == got["zc"].tobytes() == got["copy"].tobytes()

PERIOD = 65537

def case(dtype, op, count):
    bases = [make_input(k, (PERIOD,), dtype, op) for k in range(rr.size())]
    return np.resize(bases[rr.rank()], count), np.resize(reference(bases, dtype, op), count)

def matches(got, want, dtype, op):
    if op == "avg" and dtype in ("float16", "bfloat16"):
        bases = [make_input(k, (PERIOD,), dtype, op).astype(np.float64) for k in range(rr.size())]
        exact = np.resize(np.mean(np.stack(bases), axis=0), got.size)
        bound = np.resize(mean_error_bound(bases, dtype), got.size)
        return bool(np.all(np.abs(got.astype(np.float64) - exact) <= bound))
    return close_enough(got, want, dtype, op)
"""

CMA_ON = {"RINGREDUCE_SHM_CMA": "1"}


def run(n, body, tmp_path, env=None, timeout=90):
    return run_ranks(n, PRELUDE + body, tmp_path, timeout=timeout, env={**CMA_ON, **(env or {})})


def check_cases(ranks):
    first = ranks[0].result
    for r in ranks:
        for case, (ok, alike, ops, dig) in r.result.items():
            assert ok, (r.rank, case, "differs from numpy")
            assert alike, (r.rank, case, "the three paths differ")
            assert ops >= 1, (r.rank, case, "the CMA path did not run")
            assert dig == first[case][3], (r.rank, case, "ranks differ")


# Every dtype and op, out of place and in place, chunks just over 1 MiB and odd.
ALLREDUCE = """
result = {}
dtypes = DTYPES if rr.size() == 2 else ["float16", "bfloat16", "float32", "int8", "int64"]
for dtype in dtypes:
    esize = np_dtype(dtype).itemsize
    for i, op in enumerate(OPS):
        count = rr.size() * ((1 << 20) // esize) + 2 * i + 1
        mine, want = case(dtype, op, count)
        in_place = i % 2 == 1
        def once():
            if in_place:
                x = mine.copy()
                return rr.allreduce(x, op=op, out=x)
            return rr.allreduce(mine, op=op)
        got = three(once)
        result[dtype, op, in_place] = (matches(got["cma"], want, dtype, op), same(got), got["cma", "ops"],
                                       digest(got["cma"]))
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_dtype_and_op_matches_numpy_and_the_other_paths(tmp_path, n):
    check_cases(run(n, ALLREDUCE, tmp_path, timeout=150))


# Chunks exactly on the 1 MiB threshold, just over it and odd, and of
# 1.5 MiB: sizes that are no multiple of the segment (the slice each pull takes).
SIZES = """
result = {}
n = rr.size()
for dtype in ("float32", "float64", "uint8", "float16"):
    esize = np_dtype(dtype).itemsize
    for count in (n * ((1 << 20) // esize), n * ((1 << 20) // esize) + n - 1, n * ((3 << 19) // esize) + 7):
        mine, want = case(dtype, "sum", count)
        got = three(lambda: rr.allreduce(mine, op="sum"))
        result[dtype, count] = (close_enough(got["cma"], want, dtype, "sum"), same(got), got["cma", "ops"],
                                digest(got["cma"]))
"""


@pytest.mark.parametrize("n, segment", [(2, 1 << 20), (3, 64 * 1001), (4, 1 << 18)])
def test_odd_sizes_and_segments(tmp_path, n, segment):
    check_cases(run(n, SIZES, tmp_path, env={"RINGREDUCE_SEGMENT_BYTES": str(segment)}))


SCATTER_GATHER = """
result = {}
n, r = rr.size(), rr.rank()
count = n * (1 << 18) + 5
mine, want = case("float32", "sum", count)
lo = sum(count // n + (1 if k < count % n else 0) for k in range(r))
hi = lo + count // n + (1 if r < count % n else 0)
got = three(lambda: rr.reduce_scatter(mine))
result["reduce_scatter"] = (close_enough(got["cma"], want[lo:hi], "float32", "sum"), same(got),
                            got["cma", "ops"], None)
rows = [(1 << 20) + 7 * k + 1 for k in range(n)]  # bytes, different per rank
blocks = [np.frombuffer(np.random.default_rng(k).bytes(rows[k]), np.uint8) for k in range(n)]
got = three(lambda: rr.allgather(blocks[r]))
result["allgather"] = (got["cma"].tobytes() == np.concatenate(blocks).tobytes(), same(got),
                       got["cma", "ops"], digest(got["cma"]))
"""


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_and_allgather_take_the_path(tmp_path, n):
    check_cases(run(n, SCATTER_GATHER, tmp_path))


PROCESS_SET = """
result = {}
ps = rr.add_process_set([0, 2, 3])
if rr.rank() in (0, 2, 3):
    comm = C._ring(ps).comm
    me = [0, 2, 3].index(rr.rank())
    bases = [make_input(k, (PERIOD,), "float32", "avg") for k in range(3)]
    count = 3 * (1 << 18) + 11
    want = np.resize(reference(bases, "float32", "avg"), count)
    got = three(lambda: rr.allreduce(np.resize(bases[me], count), op="avg", process_set=ps), comm)
    result["set"] = (close_enough(got["cma"], want, "float32", "avg"), same(got), got["cma", "ops"],
                     digest(got["cma"]))
rr.barrier()
"""


def test_a_process_set_takes_the_path(tmp_path):
    ranks = run(4, PROCESS_SET, tmp_path)
    assert ranks[1].result == {} and all("set" in ranks[k].result for k in (0, 2, 3))
    check_cases([ranks[k] for k in (0, 2, 3)])


# The switch at init, and the fallback when a probe is refused: all ranks
# then keep zero copy through the mappings, and the results are right.
SWITCH = """
import os
if os.environ["RINGREDUCE_RANK"] == "1" and os.environ.get("REFUSE_ON_ONE"):
    os.environ["RINGREDUCE_SHM_CMA"] = "refused"
rr.init()
comm = C._state.comm
mine, want = case("float32", "sum", rr.size() * (1 << 19) + 3)
got = rr.allreduce(mine)
result = (comm.cma_pid != 0, comm.cma_ops(), comm.zero_copy_ops(), close_enough(got, want, "float32", "sum"))
"""


@pytest.mark.parametrize("n, env, cma", [
    (2, {}, True),
    (2, {"RINGREDUCE_SHM_CMA": "0"}, False),
    (2, {"RINGREDUCE_SHM_CMA": "refused"}, False),
    (3, {"REFUSE_ON_ONE": "1"}, False),                # one rank refused: none takes it
    (2, {"RINGREDUCE_SHM_ZEROCOPY": "0"}, False),      # CMA rides on zero copy
    (2, {"RINGREDUCE_SHM_CMA": "auto"}, True),         # the default: rings of two
    (3, {"RINGREDUCE_SHM_CMA": "auto"}, False),        # ... and not of more (docs/performance.md)
    (3, {"RINGREDUCE_SHM_CMA": "1"}, True),
])
def test_the_switch_and_the_fallback_when_refused(tmp_path, n, env, cma):
    ranks = run_ranks(n, PRELUDE + SWITCH, tmp_path, timeout=60, init=False, env={**CMA_ON, **env})
    zero_copy = env.get("RINGREDUCE_SHM_ZEROCOPY") != "0"
    for r in ranks:
        agreed, cma_ops, zc_ops, ok = r.result
        assert ok, r.rank
        assert agreed == cma and (cma_ops > 0) == cma, (r.rank, r.result)
        assert (zc_ops > 0) == (zero_copy and not cma), (r.rank, r.result)


def test_a_bad_setting_is_refused_by_name():
    from ringreduce.config import Config
    with pytest.raises(ValueError, match="RINGREDUCE_SHM_CMA"):
        Config.from_env({"RINGREDUCE_SHM_CMA": "yes"})
    assert Config.from_env({}).shm_cma == "auto"  # rings of two, where the probe passes


def test_the_probe_reads_this_process_and_refuses_a_wrong_canary():
    import os

    import numpy as np

    from ringreduce import _core
    canary = np.frombuffer(os.urandom(8), np.int64).copy()
    assert _core.Comm.cma_probe(os.getpid(), canary.ctypes.data, canary.tobytes())
    assert not _core.Comm.cma_probe(os.getpid(), canary.ctypes.data, (canary + 1).tobytes())
    assert not _core.Comm.cma_probe(0, canary.ctypes.data, canary.tobytes())


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_rank_killed_mid_op_is_named_without_a_hang(tmp_path, n):
    # Waits for tokens are tcp.c's wait(); a read of a dead rank's memory
    # fails with ESRCH: either way PeerLostError naming rank 1.
    check_killed_rank_is_named(tmp_path, n, 'x = np.ones(16 << 20, np.float32)\nrr.allreduce(x)', "cma_ops", CMA_ON)


@pytest.mark.parametrize("n", [2, 3])
def test_no_rank_returns_while_its_neighbour_still_reads_its_buffer(tmp_path, n):
    # Each rank refills its one buffer with the next iteration's input the
    # moment allreduce returns: had it returned while next was still reading
    # it (the final wait for the tokens), next would sum the new values.
    ranks = run(n, """
from ringreduce import collectives as C
buf = np.empty(n_el := rr.size() * (3 << 18) + 5, np.int64)
bad, before = 0, C._state.comm.cma_ops()
for i in range(30):
    buf[:] = (rr.rank() + 1) * (i + 1)
    rr.allreduce(buf, op="sum", out=buf)
    bad += int(np.count_nonzero(buf != (i + 1) * rr.size() * (rr.size() + 1) // 2))
result = (bad, C._state.comm.cma_ops() - before)
""", tmp_path)
    for r in ranks:
        assert r.result == (0, 30), (r.rank, r.result)


@pytest.mark.parametrize("n", [2, 3])
def test_ctrl_c_then_reuse_of_the_buffer_never_gives_a_neighbour_wrong_data(tmp_path, n):
    # Rank 1 is interrupted mid-loop and its handler overwrites the buffer at
    # once (as a caller's cleanup might): its neighbour, which may still be
    # reading that buffer, must raise, never return a sum with the new bytes.
    check_interrupted_rank_overwriting_is_refused(tmp_path, n, "np.empty(rr.size() * (3 << 18) + 5, np.int64)",
                                                  "cma_ops", CMA_ON)


@pytest.mark.parametrize("n", [2, 3])
def test_a_size_mismatch_is_refused_before_any_read(tmp_path, n):
    # Both sizes take the CMA path; rank 1's is larger: a read past the
    # smaller buffers would fault or be wrong. MismatchError on every rank,
    # and the ring still works after it.
    ranks = run(n, """
count = rr.size() * (1 << 19) + (4096 if rr.rank() == 1 else 0)
try:
    rr.allreduce(np.ones(count, np.float32))
    first = "no error"
except rr.MismatchError as e:
    first = "mismatch"
got = rr.allreduce(np.full(rr.size() * (1 << 19), rr.rank() + 1, np.float32))
result = (first, bool(np.all(got == rr.size() * (rr.size() + 1) // 2)))
""", tmp_path, env={"RINGREDUCE_TIMEOUT": "20"})
    for r in ranks:
        assert r.result == ("mismatch", True), (r.rank, r.result)


@pytest.mark.parametrize("n", [2, 3])
def test_back_to_back_ops_of_every_kind_and_size_leave_no_stale_token(tmp_path, n):
    # CMA operations between others (small, mappings-sized, reduce_scatter,
    # uneven allgather with an empty block): each op's tokens are its own.
    ranks = run(n, """
from ringreduce import collectives as C
n, r = rr.size(), rr.rank()
bad, before = [], C._state.comm.cma_ops()
for i in range(6):
    for count in (7, n * (1 << 18) + 3, n * (1 << 16), n * (3 << 18) + 1):
        x = np.arange(count, dtype=np.int64) * (r + 1) + i
        want = np.arange(count, dtype=np.int64) * (n * (n + 1) // 2) + i * n
        if not np.array_equal(rr.allreduce(x), want):
            bad.append(("allreduce", i, count))
        lo = sum(count // n + (1 if k < count % n else 0) for k in range(r))
        hi = lo + count // n + (1 if r < count % n else 0)
        if not np.array_equal(rr.reduce_scatter(x), want[lo:hi]):
            bad.append(("reduce_scatter", i, count))
    rows = [0 if k == 0 else (1 << 21) + 17 * k + i for k in range(n)]
    blocks = [np.full(rows[k], (k + 3 * i) % 251, np.uint8) for k in range(n)]
    if rr.allgather(blocks[r]).tobytes() != np.concatenate(blocks).tobytes():
        bad.append(("allgather", i))
result = (bad, C._state.comm.cma_ops() - before)
""", tmp_path, timeout=150)
    for r in ranks:
        bad, ops = r.result
        assert bad == [] and ops >= 6 * 3, (r.rank, r.result)


def test_a_rank_in_another_pid_namespace_fails_the_probe_and_all_fall_back(tmp_path):
    # Rank 1 re-runs itself under unshare: its pid means another process (or
    # none) to its neighbours, and theirs none to it. The probe (a random
    # canary) must fail, every rank keep zero copy through the mappings.
    import shutil
    import subprocess
    unshare = shutil.which("unshare")
    if not unshare or subprocess.run([unshare, "--user", "--pid", "--fork", "--map-current-user", "true"]).returncode:
        pytest.skip("no unprivileged pid namespaces here")
    ranks = run_ranks(3, PRELUDE + f"""
import os, sys
if os.environ["RINGREDUCE_RANK"] == "1" and not os.environ.get("IN_NS"):
    os.environ["IN_NS"] = "1"
    os.execv({unshare!r}, [{unshare!r}, "--user", "--pid", "--fork", "--map-current-user", sys.executable] + sys.argv)
rr.init()
comm = C._state.comm
mine, want = case("float32", "sum", rr.size() * (1 << 19) + 3)
got = rr.allreduce(mine)
result = (os.getpid(), comm.cma_pid, comm.cma_ops(), comm.zero_copy_ops(), close_enough(got, want, "float32", "sum"))
""", tmp_path, timeout=60, init=False, env=CMA_ON)
    assert ranks[1].result[0] == 1, "rank 1 should run as pid 1 of its own namespace"
    for r in ranks:
        _, pid, cma_ops, zc_ops, ok = r.result
        assert ok and pid == 0 and cma_ops == 0 and zc_ops > 0, (r.rank, r.result)


@pytest.mark.parametrize("shm_bytes", ["1", "64", "128"])
def test_the_smallest_links_still_carry_the_tokens(tmp_path, shm_bytes):
    # A link of one token (RINGREDUCE_SHM_BYTES=64, or less rounded up) left
    # no room for an operation's first token after the alignment gap the
    # header pass leaves: every rank spun in put_token, past the timeout.
    ranks = run(3, """
from ringreduce import collectives as C
x = np.arange(3 * (1 << 19) + 7, dtype=np.float64) * (rr.rank() + 1)
want = np.arange(x.size, dtype=np.float64) * 6
ok = all(np.array_equal(rr.allreduce(x), want) for _ in range(3))
result = (ok, C._state.comm.cma_ops())
""", tmp_path, env={"RINGREDUCE_SHM_BYTES": shm_bytes, "RINGREDUCE_TIMEOUT": "10"}, timeout=60)
    for r in ranks:
        assert r.result == (True, 3), (r.rank, r.result)
