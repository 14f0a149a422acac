"""The background engine: negotiation when ranks finish tensors in different
orders, fusion, mismatches, the timeline."""
import json

import numpy as np

from ranks import run_ranks

ORDERED_JOB = """
import random, time
from ringreduce.engine import Engine
eng = Engine(fusion_bytes=1 << 20, timeline_path=os.environ["TIMELINE"])
names = [f"layer{i}/{kind}" for i in range(12) for kind in ("kernel", "bias")]
shapes = {n: ((300, 70) if n.endswith("kernel") else (70,)) for n in names}
order = names[:]
random.Random(rr.rank()).shuffle(order)        # every rank hands over in its own order
handles = {}
for step in range(3):
    for n in order:
        handles[n] = eng.enqueue(n, np.full(shapes[n], rr.rank() + step + 1, dtype=np.float32), op="sum")
        time.sleep(0.002 * random.random())
    results = {n: eng.wait(h) for n, h in handles.items()}
result_ok = all(np.array_equal(results[n], np.full(shapes[n], sum(r + 3 for r in range(rr.size())),
                dtype=np.float32)) for n in names)
eng.shutdown()
result = result_ok
"""


def test_different_orders_on_different_ranks_agree_and_fuse(tmp_path):
    ranks = run_ranks(3, ORDERED_JOB, tmp_path, env={"TIMELINE": str(tmp_path / "trace.json")}, timeout=120)
    assert all(r.result is True for r in ranks)
    events = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in events}
    assert {"QUEUE", "WAIT", "ALLREDUCE"} <= names
    fused = [e for e in events if e.get("name") == "ALLREDUCE" and "fused" in e["args"]["op"]]
    assert fused, "small tensors should travel fused"
    assert "ScatterReduce" in names and "AllGather" in names
    assert (tmp_path / "trace.rank1.json").exists()


def test_a_tensor_that_differs_between_ranks_raises_everywhere(tmp_path):
    ranks = run_ranks(3, """
        from ringreduce.engine import Engine
        eng = Engine()
        h = eng.enqueue("w", np.ones((4, 5 if rr.rank() == 2 else 4), dtype=np.float32))
        try:
            eng.wait(h)
            result = "no error"
        except rr.MismatchError as e:
            # only that tensor fails: the engine and the ring go on
            after = eng.wait(eng.enqueue("v", np.ones(3, dtype=np.float32), op="sum")).tolist()
            result = (str(e), after)
    """, tmp_path, timeout=60)
    for r in ranks:
        message, after = r.result
        assert "'w'" in message and "rank 2" in message and "(4, 5)" in message, message
        assert after == [3.0] * 3, f"rank {r.rank}: the engine stopped after a mismatch"
