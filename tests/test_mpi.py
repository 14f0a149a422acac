"""The ring over MPI, under mpirun -np 2 and -np 4 (each job under a timeout)."""
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ranks import REPO

MPIRUN = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")


def _missing() -> str | None:
    if not os.path.exists(MPIRUN):
        return "no mpirun (pip install 'ringreduce[mpi]')"
    try:
        from ringreduce import _mpi  # noqa: F401
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"MPI transport not built or mpi4py missing ({exc}); build with MPICC=... pip install -e ."
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def mpirun(n, mode, tmp_path, env=None, timeout=240, check=True):
    out = tmp_path / mode
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, str(REPO / "tests" / "mpi_job.py"), mode, str(out)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = []
    for r in range(n):
        path = Path(f"{out}.rank{r}.pkl")
        results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    return proc, results


ALGORITHMS = {"ring": {"RINGREDUCE_SMALL_BYTES": "0"}, "auto": {}}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_matches_numpy_over_mpi(tmp_path, n, algorithm):
    _, ranks = mpirun(n, "correctness", tmp_path, ALGORITHMS[algorithm])
    for r, res in enumerate(ranks):
        assert res["source"] == "MPI communicator"
        bad = [case for case, (ok, *_rest) in res["allreduce"].items() if not ok]
        assert not bad, f"rank {r}: {bad[:5]} differ from numpy"
        differ = [c for c, v in res["allreduce"].items() if v[1] != ranks[0]["allreduce"][c][1]]
        assert not differ, f"rank {r}: {differ[:5]} not bit-identical to rank 0"
        chunk, full = res["reduce_scatter"]
        assert np.array_equal(np.concatenate([x["reduce_scatter"][0] for x in ranks]), full)
        assert np.array_equal(res["allgather"], np.concatenate(
            [np.full((i + 1, 2), i, dtype=np.int32) for i in range(n)]))
        assert (res["broadcast"] == n - 1).all()


def test_process_sets_run_independent_rings(tmp_path):
    _, ranks = mpirun(4, "subcomm", tmp_path)
    evens, odds = [r for r in ranks if r["color"] == 0], [r for r in ranks if r["color"] == 1]
    assert [r["size"] for r in ranks] == [2, 2, 2, 2] and sorted(r["rank"] for r in evens) == [0, 1]
    assert {r["big"] for r in evens} == {1.0 + 3.0} and {r["big"] for r in odds} == {2.0 + 4.0}
    assert {r["small"] for r in evens} == {0 + 2} and {r["small"] for r in odds} == {1 + 3}
    assert all(r["uniform"] for r in ranks)


def test_socket_backend_bootstraps_through_mpi(tmp_path):
    _, ranks = mpirun(3, "socket", tmp_path)
    assert [r["source"] for r in ranks] == ["mpirun"] * 3 and [r["sum"] for r in ranks] == [3.0] * 3


def test_a_rank_that_raises_ends_the_whole_job(tmp_path):
    proc, _ = mpirun(4, "raises", tmp_path, timeout=60, check=False)
    assert proc.returncode != 0
    assert "rank 1 gives up" in proc.stderr


def test_staged_device_ring_over_mpi_meets_host_ranks(tmp_path):
    _, ranks = mpirun(3, "device", tmp_path)
    assert ranks == [[], [], []]


def test_a_rank_waiting_for_a_late_peer_sleeps(tmp_path):
    """Waiting 3 s for a late peer costs little CPU: MPI has no poll(2), so the
    transport naps between tests instead of spinning."""
    _, ranks = mpirun(2, "late_peer", tmp_path, timeout=120)
    waiter = ranks[0]
    assert waiter["sum"] == 2.0 and waiter["wall"] > 2.5, waiter
    assert waiter["cpu"] < 0.5, f"rank 0 burned {waiter['cpu']:.2f} s of CPU in {waiter['wall']:.1f} s of waiting"


def test_failure_mid_ring_leaves_no_request_on_freed_buffers(tmp_path):
    """Both ranks fail with sends and receives in flight, free the buffers and
    go on with MPI: the transport settled its requests first, so nothing
    faults or writes into freed memory, and the job ends cleanly."""
    proc, ranks = mpirun(2, "stalled_mid_ring", tmp_path, {"RINGREDUCE_TIMEOUT": "1"}, timeout=120, check=False)
    report = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and None not in ranks, report
    for r, res in enumerate(ranks):
        assert res["error"] == ("PeerLostError", 1), (r, res, report)  # both blame the stalled rank
        assert res["world_sum"] == 3 and res["big_ok"] and res["canary_ok"], (r, res)
