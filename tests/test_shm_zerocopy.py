"""The ring's zero-copy path over shared memory (csrc/schedule/ring.c,
ring_steps_zero_copy): it must give numpy's results, bit for bit
those of the copying path, on every rank alike.

Each job runs the same operations twice per case, with the path switched on
and off on every rank (Comm.set_zero_copy, what RINGREDUCE_SHM_ZEROCOPY sets
at init), and checks zero_copy_ops to know the zero-copy path really ran:
it only runs for chunks of 2 MiB and more, so the cases are that large.
"""
import pytest

from killed_mid_op import check_killed_rank_is_named
from ranks import run_ranks

# Helpers every rank runs: `both(fn)` calls fn with the path on, then off,
# and returns both results and how many operations took the path.
PRELUDE = """
from cases import DTYPES, OPS, close_enough, digest, make_input, mean_error_bound, np_dtype, reference
from ringreduce.core import collectives as C

def both(fn, comm=None):
    comm = comm or C.communicator().comm
    got = {}
    for on in (True, False):
        assert comm.set_zero_copy(on) == on, "both links should be shared memory"
        before = comm.zero_copy_ops()
        got[on] = fn()
        got[on, "ops"] = comm.zero_copy_ops() - before
    comm.set_zero_copy(True)
    return got

def chunked(n, esize, extra):
    # elements for chunks just over the 2 MiB the path starts at, odd
    return n * ((2 << 20) // esize) + extra

PERIOD = 65537  # inputs repeat with this prime period, so numpy's reference is cheap

def case(dtype, op, count):
    # (this rank's input, numpy's result): every rank's make_input of PERIOD
    # elements repeated to count; reductions work element by element.
    bases = [make_input(k, (PERIOD,), dtype, op) for k in range(rr.size())]
    return np.resize(bases[rr.rank()], count), np.resize(reference(bases, dtype, op), count)

def matches(got, want, dtype, op):
    # close_enough, but a 16-bit average (a running mean, order-dependent
    # rounding) within cases.mean_error_bound, computed on one period
    if op == "avg" and dtype in ("float16", "bfloat16"):
        bases = [make_input(k, (PERIOD,), dtype, op).astype(np.float64) for k in range(rr.size())]
        exact = np.resize(np.mean(np.stack(bases), axis=0), got.size)
        bound = np.resize(mean_error_bound(bases, dtype), got.size)
        return bool(np.all(np.abs(got.astype(np.float64) - exact) <= bound))
    return close_enough(got, want, dtype, op)
"""


# These test the path through the mappings: Cross Memory Attach, which takes
# precedence where agreed (tests/test_shm_cma.py), stays off.
NO_CMA = {"RINGREDUCE_SHM_CMA": "0"}


def run(n, body, tmp_path, env=None, timeout=80):
    return run_ranks(n, PRELUDE + body, tmp_path, timeout=timeout, env={**NO_CMA, **(env or {})})


def check_cases(ranks):
    """Every case matched numpy on every rank, took the zero-copy path, and
    gave the same bits on and off, and on every rank."""
    first = ranks[0].result
    for r in ranks:
        for case, (ok, same, ops, dig) in r.result.items():
            assert ok, (r.rank, case, "differs from numpy")
            assert same, (r.rank, case, "zero copy on and off differ")
            assert ops >= 1, (r.rank, case, "the zero-copy path did not run")
            assert dig == first[case][3], (r.rank, case, "ranks differ")


# Every dtype and op, out of place and in place.
ALLREDUCE = """
result = {}
dtypes = DTYPES if rr.size() == 2 else ["float16", "bfloat16", "float32", "int8", "int64"]
for dtype in dtypes:
    esize = np_dtype(dtype).itemsize
    for i, op in enumerate(OPS):
        mine, want = case(dtype, op, chunked(rr.size(), esize, 2 * i + 1))
        in_place = i % 2 == 1
        def once():
            if in_place:
                x = mine.copy()
                return rr.allreduce(x, op=op, out=x)
            return rr.allreduce(mine, op=op)
        got = both(once)
        result[dtype, op, in_place] = (matches(got[True], want, dtype, op),
                                       got[True].tobytes() == got[False].tobytes(), got[True, "ops"],
                                       digest(got[True]))
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_dtype_and_op_matches_numpy_and_the_copying_path(tmp_path, n):
    check_cases(run(n, ALLREDUCE, tmp_path))


# A small link whose size is no power of two: every slice wraps around the
# end of the buffer somewhere, and the mapping is often full, so the path
# falls back to reducing into the output and sending from there.
WRAP = """
result = {}
for dtype in ("float32", "float64", "uint8", "float16"):
    esize = np_dtype(dtype).itemsize
    for extra in (0, 1, rr.size() - 1, 65536 // esize + 3):
        mine, want = case(dtype, "sum", chunked(rr.size(), esize, extra))
        got = both(lambda: rr.allreduce(mine, op="sum"))
        result[dtype, extra] = (close_enough(got[True], want, dtype, "sum"),
                                got[True].tobytes() == got[False].tobytes(), got[True, "ops"],
                                digest(got[True]))
"""


@pytest.mark.parametrize("n", [2, 4])
def test_sizes_around_a_small_link_buffer_and_its_wrap_around(tmp_path, n):
    check_cases(run(n, WRAP, tmp_path, env={"RINGREDUCE_SHM_BYTES": str(65536 + 64 * 7)}))


# Running ahead (ZC_SLICE in ring.c, 512 KiB: a rank sends up to a slice
# ahead of what it has received) against mappings below, at and just above a
# slice, none a power of two where it can be: the first step's piece from the
# input then does not fit, or fits with no room to spare, and ranks forward
# through the output while the mapping wraps around. Chunks end just before,
# on and just after a slice boundary, and in a short last slice.
SLICE = 512 << 10
RUN_AHEAD = """
result = {}
SLICE = %d
for dtype in ("float32", "float16"):
    esize = np_dtype(dtype).itemsize
    per_slice = SLICE // esize
    for extra in (1, per_slice - 1, per_slice + 1, 3 * per_slice // 2 + 1):
        # every chunk is 2 MiB (four slices) + about `extra` elements
        mine, want = case(dtype, "sum", rr.size() * ((2 << 20) // esize + extra))
        got = both(lambda: rr.allreduce(mine, op="sum"))
        result[dtype, extra] = (close_enough(got[True], want, dtype, "sum"),
                                got[True].tobytes() == got[False].tobytes(), got[True, "ops"],
                                digest(got[True]))
""" % SLICE


@pytest.mark.parametrize("n, shm_bytes", [
    (2, 3 * SLICE // 4 + 64 * 3),   # below one slice
    (2, SLICE),                     # exactly one slice: the piece fills it
    (4, SLICE + 64 * 5),            # just above: one slice of slack, little more
    (4, 3 * SLICE + 64 * 9),        # three slices
])
def test_running_a_slice_ahead_through_small_and_odd_mappings(tmp_path, n, shm_bytes):
    check_cases(run(n, RUN_AHEAD, tmp_path, env={"RINGREDUCE_SHM_BYTES": str(shm_bytes)}))


# reduce_scatter (ScatterReduce alone) and allgather (AllGather alone, with
# blocks of different sizes) take the path too.
SCATTER_GATHER = """
result = {}
n, r = rr.size(), rr.rank()
count = chunked(n, 4, 5)
mine, want = case("float32", "sum", count)
lo = sum(count // n + (1 if k < count % n else 0) for k in range(r))
hi = lo + count // n + (1 if r < count % n else 0)
got = both(lambda: rr.reduce_scatter(mine))
result["reduce_scatter"] = (close_enough(got[True], want[lo:hi], "float32", "sum"),
                            got[True].tobytes() == got[False].tobytes(), got[True, "ops"], None)
rows = [(2 << 20) + 7 * k + 1 for k in range(n)]  # bytes, different per rank
blocks = [np.frombuffer(np.random.default_rng(k).bytes(rows[k]), np.uint8) for k in range(n)]
got = both(lambda: rr.allgather(blocks[r]))
result["allgather"] = (got[True].tobytes() == np.concatenate(blocks).tobytes(),
                       got[True].tobytes() == got[False].tobytes(), got[True, "ops"], digest(got[True]))
"""


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_and_allgather_take_the_path(tmp_path, n):
    ranks = run(n, SCATTER_GATHER, tmp_path)
    for r in ranks:
        r.result["reduce_scatter"] = r.result["reduce_scatter"][:3] + (None,)
    check_cases(ranks)


PROCESS_SET = """
result = {}
ps = rr.add_process_set([0, 1, 2])
if rr.rank() in (0, 1, 2):
    comm = C.ring_of(ps).comm
    bases = [make_input(k, (PERIOD,), "float32", "avg") for k in range(3)]
    count = chunked(3, 4, 11)
    want = np.resize(reference(bases, "float32", "avg"), count)
    got = both(lambda: rr.allreduce(np.resize(bases[rr.rank()], count), op="avg", process_set=ps), comm)
    result["set"] = (close_enough(got[True], want, "float32", "avg"),
                     got[True].tobytes() == got[False].tobytes(), got[True, "ops"], digest(got[True]))
rr.barrier()
"""


def test_a_process_set_takes_the_path(tmp_path):
    ranks = run(4, PROCESS_SET, tmp_path)
    assert all("set" in r.result for r in ranks[:3]) and ranks[3].result == {}
    check_cases(ranks[:3])


# The switch at init, and a ring that cannot take the path on every rank.
SWITCH = """
mine, want = case("float32", "sum", chunked(rr.size(), 4, 3))
ok = close_enough(rr.allreduce(mine), want, "float32", "sum")
result = (C.communicator().comm.zero_copy_ops(), ok)
"""


@pytest.mark.parametrize("env, taken", [
    ({}, True),
    ({"RINGREDUCE_SHM_ZEROCOPY": "0"}, False),
    # not a multiple of 64: shm.py rounds it up, so windows are still offered (csrc/transport/tcp.c
    # refuses a link file of any other size)
    ({"RINGREDUCE_SHM_BYTES": str((1 << 20) + 8)}, True),
])
def test_the_switch_and_a_link_without_windows(tmp_path, env, taken):
    ranks = run(2, SWITCH, tmp_path, env=env)
    for r in ranks:
        ops, ok = r.result
        assert ok
        assert (ops > 0) == taken, (r.rank, ops)


def test_one_rank_switched_off_turns_the_path_off_everywhere(tmp_path):
    # Ranks vote at init: the two paths send bytes in different orders.
    body = """
import os
if os.environ["RINGREDUCE_RANK"] == "1":
    os.environ["RINGREDUCE_SHM_ZEROCOPY"] = "0"
rr.init()
""" + PRELUDE + SWITCH
    for r in run_ranks(3, body, tmp_path, timeout=60, init=False, env=NO_CMA):
        assert r.result == (0, True), (r.rank, r.result)


def test_a_bad_switch_is_refused_by_name():
    from ringreduce.core.config import Config
    with pytest.raises(ValueError, match="RINGREDUCE_SHM_ZEROCOPY"):
        Config.from_env({"RINGREDUCE_SHM_ZEROCOPY": "yes"})
    assert Config.from_env({}).shm_zerocopy is True


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_killed_mid_transfer_is_named_without_a_hang(tmp_path, n):
    # The zero-copy path waits in tcp.c's wait(), which must see the dead
    # peer's socket close as exchange() does: PeerLostError naming it.
    check_killed_rank_is_named(tmp_path, n, 'x = np.ones(16 << 20, np.float32)\nrr.allreduce(x)', "zero_copy_ops", NO_CMA)


def test_an_odd_shm_size_on_one_rank_keeps_zero_copy_and_the_right_sums(tmp_path):
    # RINGREDUCE_SHM_BYTES=1000 on one rank (not a multiple of the 64 the
    # windows need) is rounded up to 1024: the whole ring keeps the
    # zero-copy path and the right sums.
    ranks = run_ranks(3, """
        r = int(os.environ["RINGREDUCE_RANK"])
        os.environ["RINGREDUCE_SHM_BYTES"] = "1000" if r == 1 else str(1 << 20)
        rr.init()
        from ringreduce.core import collectives as C
        base = (np.arange((3 << 20) + 5) % 7).astype(np.float32)
        y = rr.allreduce(base * (r + 1))
        result = (bool(np.array_equal(y, base * 6)), C.communicator().comm.zero_copy_ops())
        """, tmp_path, init=False, timeout=60, env={"RINGREDUCE_TIMEOUT": "20", "RINGREDUCE_SHM_CMA": "0"})
    for k in ranks:
        assert k.result == (True, 1), (k.rank, k.result)
