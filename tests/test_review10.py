"""review10: hostile-neighbour and lifetime cases of the shared arrays and
the Cross Memory Attach reader's mapped read (csrc/memory/peer_map.c,
csrc/memory/shared_region.c), beyond tests/test_shared_arrays.py.

Rank 0 puts something else at its region's fd number (its array's own
mapping does not need the fd), as a confused or hostile process would: its
neighbour must never map that thing (wrong data, SIGBUS on a shrink) nor
block opening it; it reads by process_vm_readv instead, the same bits.
Then: a forked child's region ids, the reader's cache of freed regions, a
region larger than memory, and freeing a region whose fd number was reused.
"""
import os

import pytest

from test_shared_arrays import run

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
    # A neighbour caches its mappings by (pid, region id). A child of fork()
    # inherited its parent's id counter and handed out the parent's next
    # ids: two siblings forked from one parent, the second given the
    # first's pid once it died, named their first regions alike, and the
    # neighbour read the dead sibling's region from its cache.
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
    # The reader's cache (16 mappings a ring) only dropped an entry when it
    # was the least recently used one: a neighbour that allocates a fresh
    # shared array every step (shared_empty_like(grad)) had its last 16
    # dead arrays kept alive here, 16 times the memory. A miss now drops
    # the entries whose region that neighbour has freed.
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
    # A memfd's pages come at first touch: twice memory and swap was handed
    # out as an array (np.empty refuses it), and writing it killed the
    # process or another.
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
    # back; freeing the inherited array then closed that file.
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
