"""tests/shm_leftovers.py, which conftest.py runs at the end of a session:
it removes only segments that are new, private to this user and held by no
live process. Run on a folder of its own, so no real segment is touched."""
import mmap
import os
import subprocess
import sys

import pytest

import shm_leftovers

# A child that holds a segment as MPICH's ranks do: open (the maker, until it
# has sized it), or mapped with the descriptor closed (every rank, after).
HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "mapped":
    m = mmap.mmap(fd, 4096)
    os.close(fd)
print("holding", flush=True)
time.sleep(60)
"""


def _segment(folder, name: str, mode: int = 0o600) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(path, mode)
    return path


@pytest.fixture
def holders():
    procs = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_only_new_private_segments_no_live_process_holds_are_removed(tmp_path, holders):
    folder = str(tmp_path)
    old = _segment(folder, "mpich_shm_0ld_0")
    before = shm_leftovers.listing(folder)
    orphan = _segment(folder, "mpich_shm_dead_0")
    opened, mapped = _segment(folder, "mpich_shm_open_0"), _segment(folder, "mpich_shm_mapd_0")
    shared = _segment(folder, "mpich_shm_shared_0", mode=0o644)   # others could hold it unseen
    other = _segment(folder, "ringreduce-not-mpich")
    for path, how in [(opened, "open"), (mapped, "mapped")]:
        p = subprocess.Popen([sys.executable, "-c", HOLD, path, how], stdout=subprocess.PIPE, text=True)
        holders.append(p)
        assert p.stdout.readline() == "holding\n"
    assert shm_leftovers.held({orphan, opened, mapped}) == {opened, mapped}

    assert shm_leftovers.remove_orphans(before, folder) == [orphan]
    assert not os.path.exists(orphan)
    assert all(os.path.exists(p) for p in (old, opened, mapped, shared, other))

    for p in holders:   # the holders die (killed ranks): their segments are orphans now
        p.kill()
        p.wait()
    assert shm_leftovers.remove_orphans(before, folder) == sorted([opened, mapped])
    assert os.path.exists(old) and os.path.exists(shared)


def test_a_segment_this_process_maps_is_held():
    path = _segment("/tmp", f"mpich_shm_self{os.getpid()}_0")
    try:
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), 4096)
        assert shm_leftovers.held({path}) == {path}
        m.close()
        assert shm_leftovers.held({path}) == set()
    finally:
        os.unlink(path)
