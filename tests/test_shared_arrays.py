"""Arrays in shared memory (ringreduce.shared_empty; csrc/memory/shared_region.h)
and the CMA reader's mapped read (csrc/memory/peer_map.h, csrc/schedule/cma.c): a rank whose
buffer lies in a shared region says so in its Cross Memory Attach token, and
its neighbour reduces straight out of a read-only mapping of it.

The results must be numpy's, bit for bit those of process_vm_readv on plain
arrays, of zero copy through the links and of the copying path, on every
rank alike, and the mapped read must really run (Comm.mapped_ops). Each
reader decides per token, so mixed jobs (one rank's arrays shared, or only
src) work too. Chunks pass RR_CMA_MIN_CHUNK (1 MiB) where the path must run.

Hostile neighbours and lifetimes too: a region's fd number naming something
else, a forked child's region ids, the reader's cache of freed regions, a
region larger than memory, freeing a region whose fd number was reused.
"""
import gc
import os

import numpy as np
import pytest

from killed_mid_op import check_interrupted_rank_overwriting_is_refused, check_killed_rank_is_named
from ranks import run_ranks

PRELUDE = """
from cases import DTYPES, OPS, close_enough, digest, make_input, mean_error_bound, np_dtype, reference
from ringreduce.core import collectives as C

def paths(fn, comm=None):
    # fn(shared) by CMA on shared arrays (the mapped read), by CMA on plain
    # arrays (process_vm_readv), by zero copy through the links, by the
    # copying path; and the mapped operations each took
    comm = comm or C.communicator().comm
    pid = comm.cma_pid
    assert pid, "every rank should have agreed on CMA"
    got = {}
    for path, shared, zc, cma in (("mapped", True, True, pid), ("cma", False, True, pid),
                                  ("zc", True, True, 0), ("copy", True, False, 0)):
        comm.set_zero_copy(zc)
        assert comm.set_cma(cma) == bool(cma)
        before = comm.mapped_ops()
        got[path] = fn(shared)
        got[path, "mapped"] = comm.mapped_ops() - before
    comm.set_zero_copy(True)
    comm.set_cma(pid)
    return got

def alike(got):
    return got["mapped"].tobytes() == got["cma"].tobytes() == got["zc"].tobytes() == got["copy"].tobytes()

def put(a, shared):
    # a copied into a shared array (shared) or a plain one
    out = rr.shared_empty_like(a) if shared else np.empty_like(a)
    out[...] = a
    return out

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


def run(n, body, tmp_path, env=None, timeout=120, check=True):
    return run_ranks(n, PRELUDE + body, tmp_path, timeout=timeout, env={**CMA_ON, **(env or {})}, check=check)


def check_cases(ranks, must_map=True):
    first = ranks[0].result
    for r in ranks:
        for case, (ok, same, mapped, dig) in r.result.items():
            assert ok, (r.rank, case, "differs from numpy")
            assert same, (r.rank, case, "the paths differ")
            if must_map:
                assert mapped >= 1, (r.rank, case, "the mapped read did not run")
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
        def once(shared):
            x = put(mine, shared)
            if in_place:
                return rr.allreduce(x, op=op, out=x)
            got = rr.allreduce(x, op=op)
            assert np.array_equal(x.view(np.uint8), mine.view(np.uint8)), "the input changed"
            return got
        got = paths(once)
        result[dtype, op, in_place] = (matches(got["mapped"], want, dtype, op), alike(got), got["mapped", "mapped"],
                                       digest(got["mapped"]))
"""


@pytest.mark.parametrize("n", [2, 3])
def test_every_dtype_and_op_matches_numpy_and_the_other_paths(tmp_path, n):
    check_cases(run(n, ALLREDUCE, tmp_path, timeout=240))


# Sizes below the path (0, 1, fewer than N, not divisible by N) must be right
# on shared arrays too; those past 1 MiB a chunk must map.
SIZES = """
result = {}
n = rr.size()
for dtype in ("float32", "float64", "uint8", "bfloat16"):
    esize = np_dtype(dtype).itemsize
    for count in (0, 1, n - 1, 7 * n + 1, 1000003, n * ((3 << 20) // esize) + n - 1, n * ((5 << 20) // esize) + 7):
        mine, want = case(dtype, "sum", count)
        got = paths(lambda shared: rr.allreduce(put(mine, shared), op="sum"))
        big = count // n * esize >= (1 << 20)
        result[dtype, count] = (close_enough(got["mapped"], want, dtype, "sum"), alike(got),
                                got["mapped", "mapped"] if big else 1, digest(got["mapped"]))
        if not big:
            assert got["mapped", "mapped"] == 0, (dtype, count, "a small operation took the mapped read")
"""


@pytest.mark.parametrize("n, segment", [(2, 1 << 20), (3, 64 * 1001)])
def test_odd_sizes_and_segments(tmp_path, n, segment):
    check_cases(run(n, SIZES, tmp_path, env={"RINGREDUCE_SEGMENT_BYTES": str(segment)}, timeout=240))


# One rank's arrays shared, the others' not; src shared and the output
# plain, or the other way round: each reader maps only what its token says.
MIXED = """
n, r = rr.size(), rr.rank()
comm = C.communicator().comm
count = n * (1 << 19) + 3
mine, want = case("float32", "sum", count)
result = {}
def job(name, src_shared, out_shared):
    before, cbefore = comm.mapped_ops(), comm.cma_ops()
    x = put(mine, src_shared)
    if out_shared is None:  # in place
        got = rr.allreduce(x, out=x)
    else:
        got = rr.allreduce(x, out=put(np.zeros_like(mine), out_shared))
    result[name] = (got.tobytes() == want.tobytes(), comm.mapped_ops() - before, comm.cma_ops() - cbefore)
job("rank 0 shared", r == 0, None)
job("src shared, out plain", True, False)
job("src plain, out shared", False, True)
job("none shared", False, False)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_mixed_shared_and_plain_arrays(tmp_path, n):
    ranks = run(n, MIXED, tmp_path)
    for r in ranks:
        res = r.result
        assert all(ok and cma == 1 for ok, _, cma in res.values()), (r.rank, res)
        # rank 1 reads rank 0's (shared) array; the others read a plain one
        assert res["rank 0 shared"][1] == (1 if r.rank == 1 else 0), (r.rank, res)
        assert res["src shared, out plain"][1] == 1, (r.rank, res)  # the first step reads src
        assert res["src plain, out shared"][1] == 1, (r.rank, res)  # the later ones read the output
        assert res["none shared"][1] == 0, (r.rank, res)


# Arrays freed and new ones made between operations, more than the cache
# holds (16), some kept alive and reused round-robin: a cached mapping is
# found by region id, so every result must still be this operation's.
CHURN = """
import gc
n, r = rr.size(), rr.rank()
comm = C.communicator().comm
bad, before = [], comm.mapped_ops()
kept = [rr.shared_empty(n * (1 << 18) + k, np.int64) for k in range(20)]
for i in range(40):
    if i % 2:
        x = kept[(7 * i) % len(kept)]
    else:
        x = rr.shared_empty(n * (1 << 18) + (i % 5), np.int64)
    x[:] = np.arange(x.size, dtype=np.int64) * (r + 1) + i
    want = np.arange(x.size, dtype=np.int64) * (n * (n + 1) // 2) + i * n
    if i % 3 == 0:
        got = rr.allreduce(x, out=x)
    else:
        got = rr.allreduce(x)
    if not np.array_equal(got, want):
        bad.append(i)
    del x, got
    gc.collect()
result = (bad, comm.mapped_ops() - before)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_freed_and_new_arrays_between_operations(tmp_path, n):
    for r in run(n, CHURN, tmp_path, timeout=180):
        assert r.result == ([], 40), (r.rank, r.result)


def test_the_default_takes_the_mapped_read_in_a_ring_of_two(tmp_path):
    # RINGREDUCE_SHM_CMA unset: auto, rings of two take CMA, so the mapped read.
    ranks = run_ranks(2, PRELUDE + """
comm = C.communicator().comm
x = rr.shared_empty(2 * (1 << 20) + 1, np.float32)
x[:] = rr.rank() + 1
got = rr.allreduce(x, op="avg")
result = (bool(np.all(got == 1.5)), comm.mapped_ops())
""", tmp_path, timeout=60, env={"RINGREDUCE_SHM_CMA": "auto"})
    for r in ranks:
        assert r.result == (True, 1), (r.rank, r.result)


@pytest.mark.parametrize("n", [2, 3])
def test_no_rank_returns_while_its_neighbour_still_reads_its_shared_buffer(tmp_path, n):
    # In place on one shared buffer, refilled the moment allreduce returns:
    # the neighbour reads it through its mapping, so only the lockstep of
    # tokens keeps it from summing the next iteration's values.
    ranks = run(n, """
buf = rr.shared_empty(rr.size() * (3 << 18) + 5, np.int64)
bad, before = 0, C.communicator().comm.mapped_ops()
for i in range(30):
    buf[:] = (rr.rank() + 1) * (i + 1)
    rr.allreduce(buf, op="sum", out=buf)
    bad += int(np.count_nonzero(buf != (i + 1) * rr.size() * (rr.size() + 1) // 2))
result = (bad, C.communicator().comm.mapped_ops() - before)
""", tmp_path)
    for r in ranks:
        assert r.result == (0, 30), (r.rank, r.result)


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_killed_mid_op_is_named_without_a_hang(tmp_path, n):
    # Reading a mapping never fails when prev dies (the mapping keeps its
    # pages): the token waits and prev_alive after each step name it.
    check_killed_rank_is_named(tmp_path, n, 'x = rr.shared_empty(16 << 20, np.float32)\nx[:] = 1\nrr.allreduce(x, out=x)', "mapped_ops", CMA_ON)


def test_without_cma_shared_arrays_take_the_other_paths(tmp_path):
    ranks = run_ranks(2, PRELUDE + """
comm = C.communicator().comm
x = rr.shared_empty(2 * (1 << 20), np.float32)
x[:] = rr.rank() + 1
got = rr.allreduce(x)
result = (bool(np.all(got == 3)), comm.cma_ops(), comm.mapped_ops())
""", tmp_path, timeout=60, env={"RINGREDUCE_SHM_CMA": "0"})
    for r in ranks:
        assert r.result == (True, 0, 0), (r.rank, r.result)


# The API itself, in this process (no init).

def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_shared_arrays_before_init_are_zeroed_writable_and_freed_with_the_array():
    import ringreduce as rr
    from ringreduce import _core
    assert not rr.is_initialized()
    gc.collect()
    fds = open_fds()
    a = rr.shared_empty((3, 5), np.float64)
    assert a.shape == (3, 5) and a.dtype == np.float64 and a.flags.c_contiguous and a.flags.writeable
    assert not a.any() and a.ctypes.data % 4096 == 0
    a[:] = 7
    assert rr.is_shared(a) and rr.is_shared(a[1:]) and not rr.is_shared(a.copy()) and not rr.is_shared(a[:, 1])
    assert open_fds() == fds + 1  # its memfd
    address, nbytes = a.ctypes.data, a.nbytes
    view = a[1]
    del a
    gc.collect()
    assert _core.SharedRegion.region_of(address, nbytes) != 0, "a view keeps the region alive"
    assert np.all(view == 7)
    del view
    gc.collect()
    assert _core.SharedRegion.region_of(address, nbytes) == 0 and open_fds() == fds


def test_every_dtype_shape_and_the_like_variants():
    import ml_dtypes

    import ringreduce as rr
    for dt in [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
               np.int32, np.int64, np.complex64, np.dtype("V3")]:
        a = rr.shared_zeros(5, dt)
        assert a.shape == (5,) and a.dtype == np.dtype(dt) and rr.is_shared(a)
    assert rr.shared_empty(()).shape == ()
    assert rr.shared_empty(np.int64(4)).shape == (4,)
    z = rr.shared_empty((0, 3), np.int32)
    assert z.shape == (0, 3) and z.size == 0
    b = rr.shared_empty_like(np.ones((2, 3), np.int16))
    assert b.shape == (2, 3) and b.dtype == np.int16 and rr.is_shared(b)
    assert rr.shared_empty_like(b, dtype=np.float64).dtype == np.float64
    ids = {rr.shared_empty(1).base.base.id for _ in range(50)}
    assert len(ids) == 50 and 0 not in ids  # never reused


@pytest.mark.parametrize("shape, dtype, error", [
    (-1, np.float32, ValueError),
    ((3, -2), np.float32, ValueError),
    (2.5, np.float32, TypeError),
    ("abc", np.float32, TypeError),
    (3, object, TypeError),
    (3, "no such dtype", TypeError),
    ((1 << 40, 1 << 40), np.float32, ValueError),
])
def test_bad_arguments_are_refused(shape, dtype, error):
    import ringreduce as rr
    with pytest.raises(error):
        rr.shared_empty(shape, dtype)


def test_a_region_of_negative_size_is_refused_by_the_core():
    from ringreduce import _core
    with pytest.raises(ValueError, match="nbytes"):
        _core.SharedRegion(-1)


# A neighbour that cannot map the region reads by process_vm_readv, for that
# operation, with no error: rank 0 puts something else at its region's fd
# number (the array's own mapping does not need the fd): /dev/null (not a
# regular file) or a memfd of the same size that is not sealed against
# shrinking (a read could fault past a shrunk end).
FALLBACK = """
import os
comm = C.communicator().comm
n, r = rr.size(), rr.rank()
x = rr.shared_empty(n * (1 << 19) + 3, np.float64)
region = x.base.base
if r == 0:
    if os.environ["REPLACE_WITH"] == "devnull":
        other = os.open(os.devnull, os.O_RDONLY)
    else:
        other = os.memfd_create("unsealed")
        os.ftruncate(other, region.length)
    os.dup2(other, region.fd)
    os.close(other)
result = []
for i in range(3):
    x[:] = np.arange(x.size) * (r + 1) + i
    before, cbefore = comm.mapped_ops(), comm.cma_ops()
    got = rr.allreduce(x, out=x)
    want = np.arange(x.size, dtype=np.float64) * (n * (n + 1) // 2) + i * n
    result.append((got.tobytes() == want.tobytes(), comm.mapped_ops() - before, comm.cma_ops() - cbefore))
"""


@pytest.mark.parametrize("replace_with", ["devnull", "unsealed"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_region_that_cannot_be_mapped_is_read_by_process_vm_readv(tmp_path, n, replace_with):
    ranks = run(n, FALLBACK, tmp_path, env={"REPLACE_WITH": replace_with})
    for r in ranks:
        assert r.result == [(True, 0 if r.rank == 1 else 1, 1)] * 3, (r.rank, r.result)


@pytest.mark.parametrize("n", [2, 3])
def test_ctrl_c_then_reuse_of_the_shared_buffer_never_gives_a_neighbour_wrong_data(tmp_path, n):
    # Rank 1 is interrupted mid-loop and its handler overwrites its shared
    # buffer at once: its neighbour reads that buffer through a mapping,
    # which never fails, so only rank 1's gave-up mark (prev_alive) keeps
    # it from returning a sum with the new bytes: it must raise.
    check_interrupted_rank_overwriting_is_refused(tmp_path, n, "rr.shared_empty(rr.size() * (3 << 18) + 5, np.int64)",
                                                  "mapped_ops", CMA_ON)


# Rank 0 puts something else at its region's fd number (its array's own
# mapping does not need the fd), as a confused or hostile process would: its
# neighbour must never map that thing (wrong data, SIGBUS on a shrink) nor
# block opening it; it reads by process_vm_readv instead, the same bits.
REPLACED = """
import os, tempfile
comm = C.communicator().comm
n, r = rr.size(), rr.rank()
x = rr.shared_empty(n * (1 << 19) + 3, np.float64)
region = x.base.base
keep = []
if r == 0:
    what = os.environ["REPLACE_WITH"]
    if what == "regular_file":
        # a plain file (F_GET_SEALS fails on it: -1 has every bit set),
        # as long as the region and full of garbage
        f = tempfile.TemporaryFile(dir=os.environ["RR_TMP"])
        f.write(b"\\x7f" * region.length)
        f.flush()
        other = os.dup(f.fileno())
        keep.append(f)
    elif what == "fifo":
        # a named FIFO with no writer: opening it for reading through
        # /proc/<pid>/fd blocks until a writer comes, i.e. for ever
        path = os.path.join(os.environ["RR_TMP"], "fifo")
        os.mkfifo(path)
        other = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    else:
        # another live shared region of the same size, sealed, with
        # other bytes: the fd names a region, just not this one
        y = rr.shared_empty(x.size, np.float64)
        y[:] = -1.0
        keep.append(y)
        other = os.dup(y.base.base.fd)
    os.dup2(other, region.fd)
    os.close(other)
result = []
for i in range(3):
    x[:] = np.arange(x.size) * (r + 1) + i
    before = comm.mapped_ops()
    got = rr.allreduce(x, out=x)
    want = np.arange(x.size, dtype=np.float64) * (n * (n + 1) // 2) + i * n
    result.append((got.tobytes() == want.tobytes(), comm.mapped_ops() - before))
"""


@pytest.mark.parametrize("replace_with", ["regular_file", "fifo", "other_region"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_region_fd_naming_something_else_is_never_mapped(tmp_path, n, replace_with):
    ranks = run(n, REPLACED, tmp_path, env={"REPLACE_WITH": replace_with, "RR_TMP": str(tmp_path)}, timeout=60)
    for r in ranks:
        # rank 1 reads rank 0's buffer: by process_vm_readv (no mapped op);
        # the others map their neighbour's region as before
        assert r.result == [(True, 0 if r.rank == 1 else 1)] * 3, (r.rank, r.result)


def test_a_forked_child_draws_region_ids_of_its_own():
    # A neighbour caches its mappings by (pid, region id): a child of fork()
    # draws ids of its own (new random high bits), so two siblings forked
    # from one parent, the second given the first's pid once it died, never
    # name their regions alike (the neighbour would read the dead sibling's
    # region from its cache).
    import ringreduce as rr
    a = rr.shared_empty(4)  # the parent has drawn its ids
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, str(rr.shared_empty(4).base.base.id).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_id = int(f.read())
    os.waitpid(pid, 0)
    mine = rr.shared_empty(4).base.base.id
    assert child_id != mine
    assert child_id >> 32 != a.base.base.id >> 32, "the child should draw new random high bits"
    assert rr.is_shared(a)


def test_a_neighbour_allocating_a_new_array_each_step_is_not_held_sixteen_times(tmp_path):
    # The reader's cache (16 mappings a ring) drops, on a miss, the entries
    # whose region the neighbour has freed: a neighbour that allocates a
    # fresh shared array every step (shared_empty_like(grad)) must not have
    # its last 16 dead arrays kept alive here, 16 times the memory.
    ranks = run(2, """
import gc
comm = C.communicator().comm
n, r = rr.size(), rr.rank()
ok = True
for i in range(20):
    t = rr.shared_empty(n * (1 << 18) + 1, np.float64)
    t[:] = r + i
    before = comm.mapped_ops()
    rr.allreduce(t, out=t)
    ok = ok and bool(np.all(t == 2 * i + 1)) and comm.mapped_ops() - before == 1
    del t
    gc.collect()
# the neighbour's regions mapped here read-only (ours are read-write)
with open("/proc/self/maps") as f:
    held = sum(1 for line in f if "ringreduce-shared" in line and line.split()[1] == "r--s")
result = (ok, held)
""", tmp_path)
    for r in ranks:
        ok, held = r.result
        assert ok, (r.rank, r.result)
        # the last array's region, and the one before (a miss never drops
        # the entry returned last: the operation may be reading it)
        assert held <= 2, (r.rank, "dead regions of the neighbour still mapped here", held)


def test_a_region_larger_than_memory_and_swap_is_a_memory_error():
    # A memfd's pages come at first touch: twice memory and swap is a
    # MemoryError up front, as np.empty's (handed out, writing it would kill
    # this process or another).
    import numpy as np

    import ringreduce as rr
    with open("/proc/meminfo") as f:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in f}
    too_big = 2 * (kib["MemTotal"] + kib["SwapTotal"]) * 1024
    with pytest.raises(MemoryError):
        rr.shared_empty(too_big, np.uint8)
    assert rr.shared_empty(1 << 20, np.uint8).nbytes == 1 << 20


def test_freeing_an_array_never_closes_a_file_that_took_its_fd_number(tmp_path):
    # A forked child that closes what it inherited (os.closerange) and
    # opens its own files (its ring's sockets) gets the regions' fd numbers
    # back: freeing the inherited array must leave that file open.
    import gc

    import numpy as np

    import ringreduce as rr
    a = rr.shared_empty(16, np.float64)
    fd = a.base.base.fd
    os.close(fd)
    f = open(tmp_path / "other", "wb")
    assert f.fileno() == fd  # the lowest free number
    del a
    gc.collect()
    os.fstat(fd)  # EBADF before: the region closed it
    f.write(b"still open")
    f.close()
