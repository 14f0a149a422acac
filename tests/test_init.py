"""init(): what it joins, and what it refuses instead of running a world of
one where the launcher meant N."""
import subprocess
import sys

import pytest

from ranks import REPO, run_ranks
from ringreduce.core import mpi_backend


@pytest.mark.skipif(mpi_backend.available() is not None, reason=str(mpi_backend.available()))
@pytest.mark.parametrize("how", ["rr.init(backend='mpi')", "os.environ['RINGREDUCE_BACKEND'] = 'mpi'; rr.init()"])
def test_the_mpi_backend_without_mpirun_refuses_a_declared_world(tmp_path, how):
    ranks = run_ranks(2, f"""
        try:
            {how}
            result = ("joined", rr.size())
        except rr.RingReduceError as e:
            result = str(e)
    """, tmp_path, init=False, timeout=90)
    for r in ranks:
        assert isinstance(r.result, str), f"rank {r.rank} ran as a world of {r.result[1]}"
        assert "world of 2" in r.result and "MPI sees 1" in r.result and "backend='socket'" in r.result, r.result


def test_init_again_same_arguments_is_a_no_op_different_ones_raise(tmp_path):
    ranks = run_ranks(2, """
        rr.init()
        rr.init(backend="socket")
        same = rr.allreduce(np.ones(3)).tolist()
        try:
            rr.init(backend="mpi")
            result = "ignored"
        except rr.RingReduceError as e:
            result = (same, str(e), rr.allreduce(np.ones(2)).tolist())
    """, tmp_path, init=False, timeout=60)
    for r in ranks:
        assert r.result != "ignored", f"rank {r.rank}: init(backend='mpi') after a socket ring was ignored"
        same, message, after = r.result
        assert same == [2.0] * 3 and after == [2.0] * 2
        assert "already initialized with backend 'socket'" in message and "shutdown()" in message, message


def test_a_single_process_is_a_world_of_one_without_a_launcher():
    out = subprocess.run([sys.executable, "-c", "import ringreduce as rr; rr.init(); print(rr.size())"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


# Rank 0 of a world of 3 whose other ranks never come names the ranks that
# never joined and the setting that waited for them.
def test_rank_0_names_the_ranks_that_never_joined(tmp_path):
    from ranks import free_port, rank_env
    import subprocess
    import sys
    env = rank_env(0, 3, free_port(), "s" * 32, {"RINGREDUCE_START_TIMEOUT": "1.5"})
    code = "import ringreduce as rr\ntry:\n    rr.init()\nexcept rr.RingReduceError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    said = out.stdout.strip()
    assert "rank(s) 1, 2 of 3 never joined" in said and "RINGREDUCE_START_TIMEOUT=1.5 s" in said, out
