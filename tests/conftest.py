"""Fixtures for every test.

The whole suite runs by default (`scripts/test.sh`, CI: two pytest-xdist
workers, a test file each at a time; tests marked `alone` run while the
other worker runs none). For a quick loop,
`.venv/bin/python -m pytest -q -m "not slow"` leaves out the tests marked
slow (each over 20 s alone: TensorFlow jobs, elastic jobs, the wheel, the
examples); `-m slow` runs only those.

Multi-rank tests start their ranks with tests/ranks.py run_ranks (fresh
processes) or, when they only run collectives on a healthy world, take the
`world_pool` fixture (tests/world_pool.py: initialized worlds reused while
they stay fit).
"""
import contextlib
import fcntl
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


def pytest_collection_modifyitems(config, items):
    """An `alone` test's time limit counts its wait for the other worker's
    test (the wheel's venv, a TensorFlow job: minutes), so it gets the
    budget of both; its jobs keep their own run_ranks timeouts."""
    for item in items:
        if item.get_closest_marker("alone") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(autouse=True)
def _alone_while_it_looks_at_the_machine(request, tmp_path_factory):
    """scripts/test.sh runs the suite on two pytest-xdist workers. A test
    marked `alone` looks at state every process on the machine shares
    (/dev/shm: what is left there, a dead rank's file another rank's init
    sweeps): it runs while the other worker runs no test. A readers-writer
    lock on a file of the run: every other test holds it shared; a turnstile
    the writer holds while it waits keeps new readers from starving it.
    Without xdist there is one process and nothing to wait for."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = tmp_path_factory.getbasetemp().parent  # the run's folder, every worker's
    alone = request.node.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as stack:
        turnstile = stack.enter_context(open(root / "alone.turnstile", "w"))
        lock = stack.enter_context(open(root / "alone.lock", "w"))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
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
