"""MPICH's shared-memory segments (/dev/shm/mpich_shm_*) left behind by MPI
test jobs whose ranks were killed: MPICH unlinks a segment once its ranks
have attached, or at MPI_Finalize, so a rank killed in between leaves it
for good. conftest.py removes, at the end of the session, those that

  * appeared during the session (a listing before and after: files that
    were there before are never touched),
  * belong to this user and no one else may open (mode 0600, as MPICH
    makes them),
  * no live process has open or mapped (every /proc/PID/fd and
    /proc/PID/maps this user can read): a segment of a job still running,
    another session's included, is held by its ranks, and its name does
    not say who made it.
"""
from __future__ import annotations

import contextlib
import os
import stat

SHM_DIR = "/dev/shm"
PREFIXES = ("mpich_shm_",)


def listing(shm_dir: str = SHM_DIR) -> set[str]:
    """The names of the segments in shm_dir now."""
    try:
        return {n for n in os.listdir(shm_dir) if n.startswith(PREFIXES)}
    except OSError:
        return set()


def held(paths: set[str]) -> set[str]:
    """Those of paths that some live process has open or mapped."""
    found: set[str] = set()
    for pid in filter(str.isdigit, _proc_entries()):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target in paths:
                        found.add(target)
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").split(maxsplit=5)[5:]  # a mapping's file is its sixth field
                    if path and path[0] in paths:
                        found.add(path[0])
    return found


def _proc_entries() -> list[str]:
    try:
        return os.listdir("/proc")
    except OSError:
        return []


def remove_orphans(before: set[str], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks the segments that are new since `before` (a listing()), ours
    alone, and held by no live process; returns their paths."""
    candidates = set()
    for name in listing(shm_dir) - before:
        path = os.path.join(shm_dir, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                candidates.add(path)
    removed = []
    for path in sorted(candidates - held(candidates)):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed
