"""RINGREDUCE_TIMELINE: every engine path that runs a ring allreduce shows
its ScatterReduce and AllGather phases inside the tensor's ALLREDUCE (plain,
fused, each compressor's ring allreduces, a joined rank's zeros); the
one-pass small allreduces and top-k's gather show none, and their ALLREDUCE
says so (args.path)."""
import json

import pytest

from ranks import run_ranks

ENGINE_JOB = """
from ringreduce.compression import Int8, PowerSGD, TopK
from ringreduce.engine import engine
eng = engine()
big = np.arange(400_000, dtype=np.float32).reshape(800, 500) / 1e5   # 1.6 MB: past the small path and the arena
steps = [[("plain", big, None)], [("fused/a", big[:400], None), ("fused/b", big[400:], None)],  # one bucket
         [("int8", big, Int8())], [("powersgd", big, PowerSGD(rank=2))], [("topk", big, TopK(ratio=0.1))],
         [("tiny", np.ones(8, np.float32), None)]]
for step in steps:
    for h in [eng.enqueue(name, a, op="avg", compression=c) for name, a, c in step]:
        eng.wait(h)
if rr.rank() == 1:   # rank 1 out of data: its engine adds zeros to rank 0's allreduce
    rr.join()
else:
    eng.wait(eng.enqueue("beside joined", big, op="sum"))
    rr.join()
eng.shutdown()
"""


def _rows(trace):
    """tensor name -> {event name: [events]} of one rank's trace."""
    events = json.loads(trace.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    rows = {}
    for e in events:
        if e.get("ph") in ("X", "B") and e.get("tid") in names:
            rows.setdefault(names[e["tid"]], {}).setdefault(e["name"], []).append(e)
    return rows


def _phases_inside(row):
    """Each ScatterReduce is followed by its AllGather, both inside the ALLREDUCE."""
    (op,) = row["ALLREDUCE"]
    start, end = op["ts"], op["ts"] + op["dur"]
    pairs = list(zip(row.get("ScatterReduce", []), row.get("AllGather", [])))
    assert len(pairs) == len(row.get("ScatterReduce", [])) == len(row.get("AllGather", []))
    for sr, ag in pairs:
        assert start <= sr["ts"] and sr["ts"] + sr["dur"] <= ag["ts"] + 1 and ag["ts"] + ag["dur"] <= end + 1
    return len(pairs)


@pytest.mark.parametrize("arena", [True, False])
def test_every_path_that_runs_the_ring_shows_its_phases(tmp_path, arena):
    trace = tmp_path / "trace.json"
    env = {"RINGREDUCE_TIMELINE": str(trace), **({} if arena else {"RINGREDUCE_ARENA_BYTES": "0"})}
    run_ranks(2, ENGINE_JOB, tmp_path, env=env, timeout=150)
    for path in (trace, tmp_path / "trace.rank1.json"):
        rows = _rows(path)
        for name in ("int8", "plain", "fused/a", "fused/b"):
            assert _phases_inside(rows[name]) >= 1, (path.name, name, sorted(rows[name]))
            assert rows[name]["ALLREDUCE"][0]["args"]["path"] == "ring"
        assert "fused 2 tensors" in rows["fused/a"]["ALLREDUCE"][0]["args"]["op"]
        assert rows["int8"]["ALLREDUCE"][0]["args"]["op"].startswith("int8(")
        # a gather of (index, value) pairs; PowerSGD's P and Q of rank 2 and the tiny tensor: one-pass small
        for name in ("topk", "powersgd", "tiny"):
            assert _phases_inside(rows[name]) == 0, (path.name, name)
            assert rows[name]["ALLREDUCE"][0]["args"]["path"].startswith("no ring"), rows[name]["ALLREDUCE"]
    # rank 1 joined: its zeros travelled the ring in rank 0's allreduce, and its trace shows that op too
    assert _phases_inside(_rows(tmp_path / "trace.rank1.json")["beside joined"]) == 1
    assert _phases_inside(_rows(trace)["beside joined"]) == 1


def test_powersgd_on_the_ring_shows_a_pair_of_phases_per_ring_allreduce(tmp_path):
    # Every allreduce on the ring (RINGREDUCE_SMALL_BYTES=0, no arena): PowerSGD reduces P, then Q, each
    # a ring allreduce of its own, both in the tensor's one ALLREDUCE.
    trace = tmp_path / "trace.json"
    run_ranks(2, """
        from ringreduce.compression import PowerSGD
        from ringreduce.engine import engine
        a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
        engine().wait(engine().enqueue("w", a, compression=PowerSGD(rank=2, min_size=1)))
        engine().shutdown()
    """, tmp_path, env={"RINGREDUCE_TIMELINE": str(trace), "RINGREDUCE_ARENA_BYTES": "0",
                        "RINGREDUCE_SMALL_BYTES": "0"}, timeout=100)
    assert _phases_inside(_rows(trace)["w"]) == 2


TAPE_JOB = """
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
import ringreduce.tensorflow as rrtf
rrtf.init()
big = tf.Variable(tf.ones((800, 500)), name="big")    # its int8 sum (400 KB) takes the ring
small = tf.Variable(tf.ones((16,)), name="small")     # alone: the one-pass small allreduce
for step in range(2):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(big * float(rr.rank() + 1)) + tf.reduce_sum(small * small)
    tape = rrtf.DistributedGradientTape(tape, compression=rrtf.Compression.int8)
    grads = tape.gradient(loss, [big, small])
rrtf.shutdown()
"""


def test_a_gradient_tape_with_int8_shows_the_ring_phases_of_its_large_gradients(tmp_path):
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    trace = tmp_path / "trace.json"
    run_ranks(2, TAPE_JOB, tmp_path, env={"RINGREDUCE_TIMELINE": str(trace)}, init=False, timeout=150)
    for path in (trace, tmp_path / "trace.rank1.json"):
        ops = {}
        for name, row in _rows(path).items():
            if "ALLREDUCE" in row:
                ops[name] = (row["ALLREDUCE"][0]["args"], _phases_inside(row))
        ring = [(n, args["op"]) for n, (args, k) in ops.items() if k >= 1 and args["path"] == "ring"]
        bare = [(n, args["op"]) for n, (args, k) in ops.items() if k == 0 and args["path"].startswith("no ring")]
        assert ring and all(op.startswith("int8(") for _, op in ring), ops   # the kernel's gradient, each step
        assert len(ring) + len(bare) == len(ops), ops   # the bias's alone: small, no phases
