"""The hierarchical allreduce (RINGREDUCE_HIERARCHICAL, ringreduce/core/hierarchy.py):
reduce-scatter inside each host, a ring across hosts per local slice, allgather
inside the host. On one machine, hosts are faked with the testing hook
RINGREDUCE_HOST_ID (set before init, from each rank's number); across network
namespaces (benchmarks/cluster.py) the hosts are real to ringreduce.

Every result is compared with numpy and across ranks, byte for byte, for every
dtype and op the flat ring takes, and sizes of 0, 1, fewer elements than ranks
and not divisible by them; forced on and off both; the path taken is checked
by where the bytes went (the world ring's own ring sends nothing for a
hierarchical allreduce)."""
import json
import os
import pickle
import secrets
import subprocess
import sys
import types

import numpy as np
import pytest

from ranks import REPO, run_ranks
from test_join_numpy_collectives import README_LOOP

from ringreduce.core import hierarchy
from ringreduce.core.config import Config

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import Cluster, can_build  # noqa: E402

# Hosts faked from the rank: HOSTS_OF maps a rank to its host's name.
FAKE_HOSTS = """
import os
_rank = int(os.environ["RINGREDUCE_RANK"])
os.environ["RINGREDUCE_HOST_ID"] = "host%d" % HOSTS_OF[_rank]
rr.init()
from ringreduce.core.communicator import current as _cur
"""

# Every dtype and op at every size: results, whether each equals numpy, and
# the bytes the world's ring sent by its ring steps (kind "ring") meanwhile.
EVERY_CASE = """
import ml_dtypes
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
          np.int32, np.int64]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [int(s) for s in os.environ["SIZES"].split(",")]
n, me = rr.size(), rr.rank()
def data(rank, dt, op, count):
    rng = np.random.default_rng(1000 * rank + count)
    if op == "prod":
        v = rng.integers(1, 3, count)                     # 2**4 at most: exact in every dtype
    elif np.dtype(dt).kind == "u":
        v = rng.integers(0, 8, count)
    else:
        v = rng.integers(-8, 8, count)
    return v.astype(dt)
wrong, got = [], []
ring_before = _cur.comm.bytes()[0]
for dt in DTYPES:
    for op in OPS:
        for count in SIZES:
            x = data(me, dt, op, count)
            y = rr.allreduce(x, op=op)
            every = np.stack([data(r, dt, op, count).astype(np.float64) for r in range(n)])
            if op == "avg":
                want = every.sum(0) // n if np.dtype(dt).kind in "iu" else every.sum(0) / n
            else:
                want = {"sum": every.sum(0), "prod": every.prod(0), "min": every.min(0), "max": every.max(0)}[op]
            # 16-bit floats average as running means (k = 3 on the flat ring rounds): within their precision
            close = np.allclose(y.astype(np.float64), want, rtol=2 ** -6, atol=2 ** -5) \
                if op == "avg" and np.dtype(dt).itemsize == 2 and np.dtype(dt).kind not in "iu" \
                else np.array_equal(y, want.astype(dt))  # avg: the quotient rounded once to the dtype
            if y.dtype != x.dtype or y.shape != x.shape or not close:
                wrong.append((np.dtype(dt).name, op, count, y[:4].tolist(), want[:4].tolist()))
            got.append(y.tobytes())
# in place (out=x) and a multi-dimensional, non-contiguous input
x = np.arange(60000, dtype=np.float32).reshape(300, 200) * (me + 1)
rr.allreduce(x, out=x)
if not np.array_equal(x, np.arange(60000, dtype=np.float32).reshape(300, 200) * sum(range(1, n + 1))):
    wrong.append("in place")
z = rr.allreduce(np.arange(120000, dtype=np.float64).reshape(400, 300)[:, ::2] * (me + 1))
if not np.array_equal(z, np.arange(120000, dtype=np.float64).reshape(400, 300)[:, ::2] * sum(range(1, n + 1))):
    wrong.append("non-contiguous")
got += [x.tobytes(), z.tobytes()]
result = {"wrong": wrong, "got": got, "world_ring_bytes": _cur.comm.bytes()[0] - ring_before,
          "hierarchy": _cur.world.extra["hierarchy"]}
"""

# every allreduce on the ring path: no small path, no host arena
RING_PATH = {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_ARENA_BYTES": "0"}
SIZES = "0,1,3,5,1001,65537,1300001"  # the last: pipelined in pieces of 4 MiB (2 of float32, 3 of 64-bit)


def hosts_of(layout):
    """HOSTS_OF for ranks laid out as `layout` ranks per host, hosts in rank order."""
    return [h for h, k in enumerate(layout) for _ in range(k)]


def prelude(layout):
    return f"HOSTS_OF = {hosts_of(layout)!r}\n" + FAKE_HOSTS


def check_every_case(ranks):
    for r in ranks:
        assert r.result["wrong"] == [], f"rank {r.rank}: {r.result['wrong'][:5]}"
    first = ranks[0].result["got"]
    for r in ranks[1:]:
        assert len(r.result["got"]) == len(first)
        for i, (a, b) in enumerate(zip(first, r.result["got"])):
            assert a == b, f"case {i}: rank {r.rank} differs from rank 0"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["on", "off"])
def test_two_hosts_of_two_every_dtype_op_and_size_equal_numpy_and_alike_on_every_rank(tmp_path, mode):
    ranks = run_ranks(4, prelude([2, 2]) + EVERY_CASE, tmp_path, init=False, timeout=280,
                      env={**RING_PATH, "RINGREDUCE_HIERARCHICAL": mode, "SIZES": SIZES})
    check_every_case(ranks)
    for r in ranks:
        h = r.result["hierarchy"]
        if mode == "on":
            assert h == {"hosts": 2, "per_host": 2, "mode": "on", "threshold": 0,
                         "host": r.rank // 2, "local": r.rank % 2}
            assert r.result["world_ring_bytes"] == 0, "an allreduce took the world's flat ring"
        else:
            assert h is None
            assert r.result["world_ring_bytes"] > 0


@pytest.mark.timeout(300)
def test_hosts_that_interleave_ranks_two_hosts_of_three(tmp_path):
    # ranks 0, 2, 4 on one host and 1, 3, 5 on the other: the host's ranks need not be contiguous
    body = "HOSTS_OF = [0, 1, 0, 1, 0, 1]\n" + FAKE_HOSTS + EVERY_CASE
    ranks = run_ranks(6, body, tmp_path, init=False, timeout=280,
                      env={**RING_PATH, "RINGREDUCE_HIERARCHICAL": "on", "SIZES": "1,5,7,1001"})
    check_every_case(ranks)
    for r in ranks:
        assert r.result["hierarchy"]["per_host"] == 3 and r.result["hierarchy"]["local"] == r.rank // 2
        assert r.result["world_ring_bytes"] == 0


@pytest.mark.timeout(200)
def test_uneven_hosts_keep_the_flat_ring_even_when_forced(tmp_path):
    ranks = run_ranks(4, prelude([3, 1]) + EVERY_CASE, tmp_path, init=False, timeout=180,
                      env={**RING_PATH, "RINGREDUCE_HIERARCHICAL": "on", "SIZES": "3,1001"})
    check_every_case(ranks)
    for r in ranks:
        assert r.result["hierarchy"] is None
        assert r.result["world_ring_bytes"] > 0


AUTO = """
big = hierarchy.crossover_bytes(2, 2)
before = _cur.comm.bytes()[0]
small = rr.allreduce(np.ones(big // 4 - 1024, np.float32))
after_small = _cur.comm.bytes()[0]
large = rr.allreduce(np.ones(big // 4 + 1024, np.float32))
after_large = _cur.comm.bytes()[0]
result = (_cur.world.extra["hierarchy"], big, after_small > before, after_large == after_small,
          bool((small == 4).all() and (large == 4).all()))
"""


@pytest.mark.timeout(120)
def test_auto_on_two_hosts_takes_the_hierarchy_from_the_cost_models_crossover(tmp_path):
    ranks = run_ranks(4, prelude([2, 2]) + "from ringreduce.core import hierarchy\n" + AUTO, tmp_path,
                      init=False, timeout=100)
    for r in ranks:
        h, big, small_flat, large_hier, right = r.result
        assert h["mode"] == "auto" and h["threshold"] == big == hierarchy.crossover_bytes(2, 2)
        assert small_flat, "below the crossover the flat ring runs"
        assert large_hier, "from the crossover the hierarchy runs"
        assert right


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", [False, True], ids=["declared-one-host", "one-host-id"])
def test_auto_keeps_the_flat_ring_on_one_host(tmp_path, hook):
    body = (prelude([4]) if hook else "rr.init()\nfrom ringreduce.core.communicator import current as _cur\n") + """
y = rr.allreduce(np.ones(4 << 20, np.float32))
result = (_cur.world.extra["hierarchy"], bool((y == 4).all()))
"""
    for r in run_ranks(4, body, tmp_path, init=False, timeout=100):
        assert r.result == (None, True)


def test_the_setting_is_validated():
    assert Config.from_env({}).hierarchical == "auto"
    for mode in ("auto", "on", "off"):
        assert Config.from_env({"RINGREDUCE_HIERARCHICAL": mode}).hierarchical == mode
    for bad in ("yes", "1", "ON ", "hier"):
        if bad.strip() in ("auto", "on", "off"):
            continue
        with pytest.raises(ValueError, match="RINGREDUCE_HIERARCHICAL"):
            Config.from_env({"RINGREDUCE_HIERARCHICAL": bad})


@pytest.mark.timeout(60)
def test_init_refuses_a_bad_setting(tmp_path):
    body = """
try:
    rr.init()
    result = "initialized"
except ValueError as exc:
    result = str(exc)
"""
    for r in run_ranks(2, body, tmp_path, init=False, timeout=50, env={"RINGREDUCE_HIERARCHICAL": "always"}):
        assert "RINGREDUCE_HIERARCHICAL" in r.result and "auto, on or off" in r.result


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_setting_fail_alike_naming_them(tmp_path):
    body = """
os.environ["RINGREDUCE_HOST_ID"] = "host%d" % (int(os.environ["RINGREDUCE_RANK"]) // 2)
os.environ["RINGREDUCE_HIERARCHICAL"] = "off" if os.environ["RINGREDUCE_RANK"] == "3" else "on"
try:
    rr.init()
    result = "initialized"
except ValueError as exc:
    result = str(exc)
result = (result, rr.is_initialized())
"""
    for r in run_ranks(4, body, tmp_path, init=False, timeout=100):
        message, initialized = r.result
        assert "must be alike on every rank" in message and "rank 3: off" in message and "rank 0: on" in message
        assert not initialized


def test_the_cost_model():
    assert hierarchy.crossover_bytes(1, 8) is None and hierarchy.crossover_bytes(8, 1) is None
    two_by_two, two_by_four = hierarchy.crossover_bytes(2, 2), hierarchy.crossover_bytes(2, 4)
    assert 0 < two_by_four < two_by_two < 16 << 20  # more ranks per host: the flat ring loses more
    # a link far faster than shared memory: the host's phases cost more than the link saves
    assert hierarchy.crossover_bytes(2, 4, link_bw=10 * hierarchy.SHM_BW) is None
    # the crossover is where the model's two times meet
    for hosts, per_host in ((2, 2), (2, 4), (4, 8)):
        at = hierarchy.crossover_bytes(hosts, per_host)
        flat, hier = hierarchy.model_seconds(at, hosts, per_host)
        assert hier < flat
        flat, hier = hierarchy.model_seconds(at - 1, hosts, per_host)
        assert hier >= flat


@pytest.mark.timeout(300)
def test_a_joined_rank_takes_the_same_path_as_the_ranks_with_data(tmp_path):
    # rr.join beside direct allreduces (tests/test_join_numpy_collectives.py's loop) with the hierarchy on:
    # the joined rank's stand-in must take the hierarchy too, or the ranks would wait on different rings
    ranks = run_ranks(4, prelude([2, 2]) + README_LOOP, tmp_path, init=False, timeout=280,
                      env={"STEPS": "2,3,1,3", "RINGREDUCE_HIERARCHICAL": "on", "RINGREDUCE_ARENA_BYTES": "0"})
    for r in ranks:
        wrong, last, _ = r.result
        assert wrong == [], f"rank {r.rank}: {wrong}"
        assert last in (1, 3)


CLUSTER_JOB = """
import hashlib, json
import numpy as np, ringreduce as rr
rr.init()
from ringreduce.core.communicator import current
n, me = rr.size(), rr.rank()
out = []
for dt in (np.float32, np.int32, np.float16):
    for count in (3, 1001, 3_000_001):
        x = (np.arange(count) % 7 + me).astype(dt)
        y = rr.allreduce(x)
        want = sum((np.arange(count) % 7 + r).astype(np.float64) for r in range(n))
        out.append((bool(np.array_equal(y.astype(np.float64), want)), hashlib.sha256(y.tobytes()).hexdigest()))
print("RESULT " + json.dumps({"hierarchy": current.world.extra["hierarchy"], "out": out}), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(can_build() is not None, reason=f"cannot make network namespaces here: {can_build()}")
def test_two_namespaces_of_two_ranks_build_the_hierarchy_by_themselves():
    with Cluster(2) as cluster:
        secret, port = secrets.token_hex(16), 29511
        procs = []
        for rank in range(4):
            host = rank // 2
            env = cluster.ring_env(host, port, secret, size=4)
            env.update(RINGREDUCE_RANK=str(rank), RINGREDUCE_LOCAL_RANK=str(rank % 2), RINGREDUCE_LOCAL_SIZE="2",
                       PYTHONPATH=str(REPO))
            env.pop("RINGREDUCE_HOST_ID", None)
            procs.append(cluster.popen(host, [sys.executable, "-c", CLUSTER_JOB], env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=100) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
    assert cluster.leftovers() == []
    got = [json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]) for out, _ in outs]
    for rank, g in enumerate(got):
        h = g["hierarchy"]
        assert h is not None and (h["hosts"], h["per_host"], h["mode"]) == (2, 2, "auto"), g
        assert (h["host"], h["local"]) == (rank // 2, rank % 2), g
        assert all(right for right, _ in g["out"]), g
    assert len({json.dumps([d for _, d in g["out"]]) for g in got}) == 1, "ranks differ"


DIES_IN_THE_CROSS_PHASE = """
import signal, time
class Dying:
    def allreduce(self, *args):
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(_real_cross, name)
x = np.ones(4 << 20, np.float32)
rr.allreduce(x)
if rr.rank() == 3:   # dies between its host's reduce-scatter and the cross ring
    _real_cross = _cur.ring.hierarchy.cross
    _cur.ring.hierarchy.cross = Dying()
t0 = time.time()
try:
    rr.allreduce(x)
    result = "no error"
except rr.RingReduceError as e:
    elapsed = time.time() - t0
    try:
        rr.allreduce(x)
        after = "usable"
    except rr.RingReduceError as e2:
        after = str(e2)
    result = (type(e).__name__, getattr(e, "rank", None), str(e), elapsed, after)
"""


@pytest.mark.timeout(120)
def test_a_rank_lost_mid_schedule_fails_every_survivor_promptly(tmp_path):
    import signal
    ranks = run_ranks(4, prelude([2, 2]) + DIES_IN_THE_CROSS_PHASE, tmp_path, init=False, timeout=100, check=False,
                      env={"RINGREDUCE_HIERARCHICAL": "on", "RINGREDUCE_TIMEOUT": "30"})
    assert ranks[3].returncode == -signal.SIGKILL
    for r in ranks[:3]:
        assert r.returncode == 0, r.stderr[-2000:]
        kind, lost, message, elapsed, after = r.result
        assert elapsed < 15, f"rank {r.rank} took {elapsed:.1f} s to notice (RINGREDUCE_TIMEOUT is 30)"
        if r.rank in (1, 2):  # rank 3's partners: its cross ring's and its host ring's
            assert kind == "PeerLostError" and lost == 3 and "world rank 3" in message, (r.rank, message)
        assert after != "usable", f"rank {r.rank}: the world ring went on without rank 3"


BYTES = """
h = _cur.ring.hierarchy
S = 8 << 20
x = np.ones(S // 4, np.float32)
before = (tuple(h.intra.bytes()), tuple(h.cross.bytes()), tuple(_cur.comm.bytes()))
rr.allreduce(x)
after = (tuple(h.intra.bytes()), tuple(h.cross.bytes()), tuple(_cur.comm.bytes()))
result = [[a - b for a, b in zip(x1, x0)] for x0, x1 in zip(before, after)]
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [[2, 2], [4, 4]], ids=["2x2", "2x4"])
def test_bytes_each_ring_carries_are_the_schedules(tmp_path, layout):
    """The host ring moves 2(L-1)/L of the tensor (reduce-scatter, then
    allgather), the cross ring 2(H-1)/H of the rank's 1/L slice: a host's
    link carries L of those, 2(H-1)/H of the tensor, against the flat
    ring's 2(N-1)/N (docs/architecture.md, bytes per operation)."""
    hosts, per_host = len(layout), layout[0]
    S = 8 << 20
    ranks = run_ranks(sum(layout), prelude(layout) + BYTES, tmp_path, init=False, timeout=100,
                      env={"RINGREDUCE_HIERARCHICAL": "on"})
    for r in ranks:
        intra, cross, world = r.result
        assert intra[0] == 2 * (per_host - 1) * S // per_host, (r.rank, intra)   # kind "ring": data steps
        assert cross[0] == 2 * (hosts - 1) * (S // per_host) // hosts, (r.rank, cross)
        assert world[0] == 0, (r.rank, world)  # the world's ring carried only the header pass


TUNED = """
x = np.ones(3 << 20, np.float32) * (rr.rank() + 1)
result = (_cur.world.extra["hierarchy"], bool((rr.allreduce(x) == 10).all()))
"""


@pytest.mark.timeout(240)
def test_autotune_times_the_threshold_agrees_caches_and_reads_it_back(tmp_path):
    from ringreduce.core import autotune
    env = {"RINGREDUCE_AUTOTUNE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    ranks = run_ranks(4, prelude([2, 2]) + TUNED, tmp_path, init=False, timeout=220, env=env)
    thresholds = {r.result[0]["threshold"] for r in ranks}
    assert len(thresholds) == 1 and all(r.result[1] for r in ranks)
    threshold = thresholds.pop()
    assert threshold in (*autotune.HIER_PROBES, autotune.NEVER)
    files = list((tmp_path / "cache" / "ringreduce" / "autotune").glob("*.hierarchy.json"))
    assert len(files) == 1
    cached = json.loads(files[0].read_text())
    assert cached["threshold"] == threshold and len(cached["flat_seconds"]) == len(autotune.HIER_PROBES)
    # a second init takes rank 0's cached threshold without timing anything
    other = autotune.NEVER if threshold != autotune.NEVER else autotune.HIER_PROBES[0]
    files[0].write_text(json.dumps({**cached, "threshold": other}))
    again = run_ranks(4, prelude([2, 2]) + TUNED, tmp_path, init=False, timeout=220, env=env)
    assert [r.result for r in again] == [({**r.result[0], "threshold": other}, True) for r in ranks]


def test_the_autotuned_threshold_rule():
    from ringreduce.core.autotune import HIER_PROBES, NEVER, hierarchy_threshold
    flat = np.array([1.0, 4.0, 16.0])
    assert hierarchy_threshold(flat, np.array([0.5, 2.0, 8.0])) == HIER_PROBES[0]
    assert hierarchy_threshold(flat, np.array([1.2, 2.0, 8.0])) == HIER_PROBES[1]
    assert hierarchy_threshold(flat, np.array([0.5, 4.5, 8.0])) == HIER_PROBES[2]  # must win at every larger size
    assert hierarchy_threshold(flat, np.array([0.5, 2.0, 15.5])) == NEVER  # within MARGIN at the largest: flat


@pytest.mark.timeout(300)
def test_over_mpi_two_hosts_of_two_equal_numpy_and_alike_on_every_rank(tmp_path):
    from test_mpi import MPIRUN, _missing as mpi_missing
    if mpi_missing() is not None:
        pytest.skip(str(mpi_missing()))
    script = tmp_path / "job.py"
    script.write_text("import os, pickle, sys\nimport numpy as np\nfrom mpi4py import MPI\n"
                      "os.environ['RINGREDUCE_HOST_ID'] = 'host%d' % (MPI.COMM_WORLD.Get_rank() // 2)\n"
                      "import ringreduce as rr\nrr.init()\nresult = None\n"
                      "from ringreduce.core.communicator import current as _cur\n" + EVERY_CASE
                      + "\npickle.dump(result, open(sys.argv[1] + '.%d' % rr.rank(), 'wb'))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RINGREDUCE_HIERARCHICAL": "on", "SIZES": "1,3,1001,65537",
           **RING_PATH}
    proc = subprocess.run([MPIRUN, "-np", "4", sys.executable, str(script), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [pickle.loads((tmp_path / f"out.{r}").read_bytes()) for r in range(4)]
    check_every_case([types.SimpleNamespace(rank=r, result=res) for r, res in enumerate(results)])
    for r, res in enumerate(results):
        assert res["hierarchy"]["hosts"] == 2 and res["hierarchy"]["local"] == r % 2
        assert res["world_ring_bytes"] == 0
