"""Small allreduces over MPI by recursive doubling (csrc/schedule/recursive_doubling.c),
under mpirun -np 2, 3, 4, 5 (3 and 5: the fold of the extra ranks), with the
host arena off (RINGREDUCE_ARENA_BYTES=0; the arena: tests/test_mpi_arena.py).

This file is also the job each test starts: `mpirun -np N python
tests/test_small_mpi.py MODE OUT` writes each rank's findings to
OUT.rank<r>.pkl.
"""
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import DTYPES, OPS, close_enough, digest, make_input, reference  # noqa: E402

MPIRUN = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")


# --------------------------------------------------------------------------- the job, on every rank


def _sizes(n: int, limit: int, itemsize: int) -> list:
    """0, 1, fewer than ranks, odd, a 3-d shape, and the small path's largest."""
    return [0, 1, max(n - 1, 1), 2 * n + 1, 1001, (3, 5, 7), limit // itemsize]


def job_correctness():
    import ringreduce as rr
    from ringreduce.core.communicator import current as _state
    rr.init(backend="mpi")
    n, r, ring = rr.size(), rr.rank(), _state.ring
    out = {"algorithm": ring.comm.small_algorithm, "cases": {}}
    for dtype in DTYPES:
        for op in OPS:
            itemsize = np.dtype(make_input(0, 1, dtype, op).dtype).itemsize
            for shape in _sizes(n, ring.allreduce_limit, itemsize):
                shape = shape if isinstance(shape, tuple) else (shape,)
                inputs = [make_input(i, shape, dtype, op) for i in range(n)]
                got = rr.allreduce(inputs[r], op=op)
                out["cases"][(dtype, op, shape)] = (close_enough(got, reference(inputs, dtype, op), dtype, op, inputs),
                                                    digest(got))
    # Sums whose value depends on the order of reduction: the same bits on every rank.
    rng = np.random.default_rng(r)
    for dtype in ("float32", "float16", "float64"):
        x = (rng.standard_normal(4099) * 10 ** rng.uniform(-3, 3, 4099)).astype(dtype)
        out["cases"][("random", dtype)] = (True, digest(rr.allreduce(x)))
    inplace = np.full(513, r + 1.0, dtype=np.float32)
    rr.allreduce(inplace, out=inplace)
    out["inplace"] = bool((inplace == n * (n + 1) / 2).all())
    out["stats"] = rr.stats()  # every case above was small: no ring data step
    rr.barrier()
    return out


def job_nan():
    """NaNs with a different payload on each rank: every rank must agree bit for bit."""
    import ringreduce as rr
    rr.init(backend="mpi")
    r = rr.rank()
    out = {}
    for dtype, bits in (("float32", np.uint32), ("float16", np.uint16), ("bfloat16", np.uint16)):
        from cases import np_dtype
        dt = np_dtype(dtype)
        quiet = {np.uint32: 0x7FC00000, np.uint16: 0x7E00 if dtype == "float16" else 0x7FC0}[bits]
        x = np.arange(37, dtype=np.float32).astype(dt)
        raw = x.view(bits)
        raw[::3] = bits(quiet | (r + 1))  # a payload per rank
        for op in ("sum", "prod", "min", "max"):
            out[(dtype, op)] = rr.allreduce(x, op=op).view(bits).tobytes()
    return out


def job_mismatch():
    """Rank N-1 disagrees: on shape, then on dtype; then everyone agrees again."""
    import ringreduce as rr
    from ringreduce.errors import MismatchError
    rr.init(backend="mpi")
    n, r = rr.size(), rr.rank()
    out = {}
    odd = r == n - 1
    for what, x in (("shape", np.ones(7 if odd else 5, np.float32)),
                    ("dtype", np.ones(5, np.float64 if odd else np.float32)),
                    ("apart", np.ones(5000 if odd else 5, np.float32)),  # its partial goes unpacked
                    ("long", np.ones(100_000 if odd else 5, np.float32))):  # the odd one takes the ring
        try:
            rr.allreduce(x)
            out[what] = None
        except MismatchError as exc:
            out[what] = str(exc)
    out["after"] = rr.allreduce(np.full(5, r + 1.0)).tolist()
    return out


def job_mixed_limits():
    """RINGREDUCE_SMALL_BYTES differs between ranks: one sends its data with
    its header, the others take the ring; the headers decide, alike."""
    import ringreduce as rr
    rr.init(backend="mpi")
    n, r = rr.size(), rr.rank()
    x = np.arange(3001, dtype=np.float32) + r
    want = np.arange(3001, dtype=np.float32) * n + sum(range(n))
    return {"allreduce": bool(np.array_equal(rr.allreduce(x), want)),
            "avg16": rr.allreduce(x.astype(np.float16), op="avg").tobytes(),
            "allgather": bool(np.array_equal(rr.allgather(np.full(3, r))[3 * (n - 1):], np.full(3, n - 1))),
            "after": rr.allreduce(np.ones(3)).tolist()}


def job_lost_peer():
    """The last rank stops (SIGSTOP) before a small allreduce; with
    RINGREDUCE_TIMEOUT=1 every other rank raises PeerLostError naming it."""
    import signal
    import threading
    import time
    from mpi4py import MPI
    import ringreduce as rr
    from ringreduce.errors import RingReduceError
    rr.init(backend="mpi")
    world = MPI.COMM_WORLD
    n, r = rr.size(), rr.rank()
    pids = world.allgather(os.getpid())
    rr.allreduce(np.ones(4))
    world.Barrier()
    def wake():
        time.sleep(3.0)
        os.kill(pids[n - 1], signal.SIGCONT)
    waker = threading.Thread(target=wake, daemon=True)
    if r == 0:
        waker.start()
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        rr.allreduce(np.ones(1000, np.float32))
        error = None
    except RingReduceError as exc:
        error = (type(exc).__name__, exc.rank, str(exc))
    seconds = time.monotonic() - start
    if r == 0:
        waker.join()  # the sleeper must wake before this rank leaves
    return {"error": error, "seconds": seconds}


# --------------------------------------------------------------------------- the tests

if __name__ != "__main__":
    from test_mpi import _missing
    from ranks import REPO
    pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


# Recursive doubling itself: without the host arena, which every rank of
# these one-host jobs would otherwise take first (tests/test_mpi_arena.py).
NO_ARENA = {"RINGREDUCE_ARENA_BYTES": "0"}


def _mpirun(n, mode, tmp_path, env=None, timeout=60):
    out = tmp_path / mode
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, __file__, mode, str(out)], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **NO_ARENA, **(env or {})})
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(n):
        path = Path(f"{out}.rank{r}.pkl")
        ranks.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    assert proc.returncode == 0 and None not in ranks, report
    return ranks


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_small_allreduce_by_doubling_matches_numpy_bit_identical_on_every_rank(tmp_path, n):
    ranks = _mpirun(n, "correctness", tmp_path)
    for r, res in enumerate(ranks):
        assert res["algorithm"] == "doubling"
        bad = [case for case, (ok, _) in res["cases"].items() if not ok]
        assert not bad, f"rank {r}: {bad[:5]} differ from numpy"
        differ = [c for c, (_, d) in res["cases"].items() if d != ranks[0]["cases"][c][1]]
        assert not differ, f"rank {r}: {differ[:5]} not bit-identical to rank 0"
        assert res["inplace"]
        assert res["stats"]["ring"] == 0 and res["stats"]["blobs"] > 0, res["stats"]


@pytest.mark.parametrize("n", [3, 4])
def test_nan_payloads_agree_on_every_rank(tmp_path, n):
    ranks = _mpirun(n, "nan", tmp_path)
    for r, res in enumerate(ranks[1:], start=1):
        assert res == ranks[0], f"rank {r} differs from rank 0 in {[k for k in res if res[k] != ranks[0][k]]}"


@pytest.mark.parametrize("n", [3, 4])
def test_a_mismatch_names_the_rank_on_every_rank(tmp_path, n):
    ranks = _mpirun(n, "mismatch", tmp_path)
    for res in ranks:
        assert res == ranks[0]  # the same message everywhere
        assert f"rank {n - 1}: (7,)" in res["shape"] and "rank 0: (5,)" in res["shape"], res["shape"]
        assert f"rank {n - 1}: float64" in res["dtype"] and "rank 0: float32" in res["dtype"], res["dtype"]
        assert f"rank {n - 1}: (5000,)" in res["apart"], res["apart"]
        assert f"rank {n - 1}: (100000,)" in res["long"], res["long"]
        assert res["after"] == [n * (n + 1) / 2] * 5


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_with_different_small_limits_agree_over_mpi(tmp_path, n):
    # One rank's allreduce takes the doubling, the others' the ring: they
    # meet in the same doubling rounds, see the headers differ only in the
    # inline flag, and all take the ring.
    env = {"RINGREDUCE_SMALL_BYTES": "0"}
    script = tmp_path / "limits.py"
    script.write_text(f"import os\nos.environ['RINGREDUCE_SMALL_BYTES'] = str(32 << 20) if "
                      f"os.environ.get('PMI_RANK') == '1' else '0'\nimport runpy, sys\nsys.argv = {[__file__]} + "
                      "sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = tmp_path / "mixed_limits"
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, str(script), "mixed_limits", str(out)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), **NO_ARENA, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [pickle.loads(Path(f"{out}.rank{r}.pkl").read_bytes()) for r in range(n)]
    for res in ranks:
        assert res["allreduce"] and res["allgather"] and res["after"] == [float(n)] * 3, res
        assert res["avg16"] == ranks[0]["avg16"]


@pytest.mark.parametrize("n", [2, 4])
def test_a_stopped_peer_is_named_on_every_rank(tmp_path, n):
    ranks = _mpirun(n, "lost_peer", tmp_path, env={"RINGREDUCE_TIMEOUT": "1"}, timeout=60)
    for r, res in enumerate(ranks[:-1]):
        assert res["error"] is not None and res["error"][:2] == ("PeerLostError", n - 1), (r, res)
        assert res["seconds"] < 2.9, (r, res)  # the timeout, not the sleeper's return



def _mpi_missing() -> str | None:
    try:
        from ringreduce import _mpi  # noqa: F401
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"MPI transport not built or mpi4py missing ({exc})"
    return None if os.path.exists(MPIRUN) else "no mpirun"


def mpirun(n: int, body: str, tmp_path: Path, timeout: float = 60) -> list[str]:
    """Runs body on n MPI ranks; returns what each rank passed to say() (a file
    per rank: mpirun interleaves the ranks' stdout)."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nimport numpy as np\nfrom mpi4py import MPI\nR = MPI.COMM_WORLD.Get_rank()\n"
                      f"def say(text):\n    open({str(tmp_path)!r} + f'/said{{R}}', 'w').write(str(text))\n"
                      + textwrap.dedent(body))
    proc = subprocess.run([MPIRUN, "-np", str(n), sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    said = [tmp_path / f"said{r}" for r in range(n)]
    assert all(f.exists() for f in said), proc.stdout[-2000:] + proc.stderr[-2000:]
    return [f.read_text() for f in said]


@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_small_algorithm_differing_across_mpi_ranks_raises_on_every_rank(tmp_path):
    # RINGREDUCE_SMALL_ALGORITHM differing across ranks is a ValueError on
    # every rank naming each rank's choice, never ranks running different
    # algorithms and waiting for messages never sent.
    lines = mpirun(3, """
        os.environ["RINGREDUCE_SMALL_ALGORITHM"] = "ring" if R == 0 else "doubling"
        import ringreduce as rr
        try:
            rr.init(backend="mpi")
            rr.allreduce(np.ones(10, np.float32))
            say("no error")
        except ValueError as exc:
            say(exc)
        """, tmp_path, timeout=30)
    for line in lines:
        assert line.startswith("RINGREDUCE_SMALL_ALGORITHM must be alike"), line
        assert "rank 0: 'ring', rank 1: 'doubling'" in line, line


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    result = globals()[f"job_{mode}"]()
    from mpi4py import MPI
    with open(f"{out}.rank{MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)
