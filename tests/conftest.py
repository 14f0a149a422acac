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


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test():
    yield
    import ranks
    ranks.kill_leftovers()
