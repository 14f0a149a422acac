"""Fixtures for every test.

The whole suite runs by default (`scripts/test.sh`, CI). For a quick loop,
`.venv/bin/python -m pytest -q -m "not slow"` leaves out the tests marked
slow (each over 20 s alone: TensorFlow jobs, elastic jobs, the wheel, the
examples); `-m slow` runs only those.

Multi-rank tests start their ranks with tests/ranks.py run_ranks (fresh
processes) or, when they only run collectives on a healthy world, take the
`world_pool` fixture (tests/world_pool.py: initialized worlds reused while
they stay fit).
"""
import os
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hostcuda_dir(tmp_path_factory):
    """A folder holding the host CUDA driver as libcuda.so.1 (tests/hostcuda.py)."""
    import hostcuda
    why = hostcuda.why_not_buildable()
    if why:
        pytest.skip(f"the host CUDA driver cannot be built: {why}")
    return hostcuda.build(tmp_path_factory.mktemp("hostcuda"))


@pytest.fixture(scope="session")
def world_pool(tmp_path_factory):
    """Initialized worlds reused across tests (tests/world_pool.py):
    `world_pool.run(n, snippet, timeout=..., env=...)` in place of
    run_ranks for a test that only runs collectives on a healthy world."""
    import world_pool as wp
    pool = wp.WorldPool(tmp_path_factory.mktemp("world_pool"))
    yield pool
    pool.close()


@pytest.fixture(scope="session", autouse=True)
def _tf_op_compiled_once_per_run(tmp_path_factory):
    """CXX for the session: tests/cached_cxx.py over the system's c++, so
    each distinct build of the TensorFlow op runs the compiler once per run,
    however many op caches the tests build into (xdist workers share it).
    A test that sets CXX itself keeps its own; with no compiler CXX stays unset."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        yield
        return
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one run's folder, every worker's
    wrapper = Path(__file__).resolve().parent / "cached_cxx.py"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", f"{shlex.join([sys.executable, str(wrapper)])} {cxx}")
        mp.setenv("RR_TEST_CXX_CACHE", str(root / "cxx_cache"))
        yield


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test():
    yield
    import ranks
    ranks.kill_leftovers()


@pytest.fixture(scope="session", autouse=True)
def _no_mpich_segment_outlives_the_session():
    """MPI jobs whose ranks were killed leave MPICH's /dev/shm segments behind:
    those that appeared during the session and no live process holds go at its
    end (tests/shm_leftovers.py); older ones, and those of jobs still running, stay."""
    import shm_leftovers
    before = shm_leftovers.listing()
    yield
    shm_leftovers.remove_orphans(before)
