"""The background engine: negotiation when ranks finish tensors in different
orders, fusion, mismatches, the timeline."""
import json

import pytest

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
    # No host arena: fused buffers up to its 256 KiB would skip the ring phases the timeline shows.
    ranks = run_ranks(3, ORDERED_JOB, tmp_path, env={"TIMELINE": str(tmp_path / "trace.json"),
                                                     "RINGREDUCE_ARENA_BYTES": "0"}, timeout=120)
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


MIXED_JOB = """
import random, threading, time, zlib, hashlib
from ringreduce.engine import Engine
from ringreduce.core.arrays import chunk_bounds
n, me = rr.size(), rr.rank()
eng = Engine(fusion_bytes=4096)
KINDS = ["allreduce-sum", "allgather", "allreduce-avg", "broadcast", "reduce_scatter", "allreduce-max"]

def data(name, rank, rows=None):
    rng = np.random.default_rng([zlib.crc32(name.encode()), rank])
    kind = name.split("/")[1]
    if kind == "allgather":
        return rng.integers(-9, 10, size=(rank + 1 + len(name) % 2, 3)).astype(np.float32)
    if kind == "allreduce-avg":
        return rng.integers(-50, 50, size=(7, 3)).astype(np.int32)
    size = 70_001 if name.endswith("c5") and kind == "allreduce-sum" else 2 * n + 1
    return rng.integers(-20, 21, size=size).astype(np.float64 if kind == "broadcast" else np.float32)

def expected(name):
    kind = name.split("/")[1]
    every = [data(name, r) for r in range(n)]
    if kind == "allgather":
        return np.concatenate(every)
    if kind == "allreduce-avg":
        return np.sum(every, axis=0, dtype=np.int32) // np.int32(n)
    if kind == "allreduce-max":
        return np.max(every, axis=0)
    if kind == "broadcast":
        return every[len(name) % n]
    total = np.sum(every, axis=0, dtype=np.float32)
    if kind == "reduce_scatter":
        lo, hi = chunk_bounds(total.size, n, me)
        return total[lo:hi]
    return total

def issue(name):
    kind = name.split("/")[1]
    x = data(name, me)
    if kind.startswith("allreduce"):
        return eng.enqueue(name, x, op=kind.split("-")[1])
    if kind == "broadcast":
        return eng.enqueue(name, x, kind="broadcast", root=len(name) % n)
    if kind == "reduce_scatter":
        return eng.enqueue(name, x, kind="reduce_scatter", op="sum")
    return eng.enqueue(name, x, kind=kind)

lists = [[f"t{t}/{KINDS[(t + i) % len(KINDS)]}/c{i}" for i in range(8)] for t in range(3)]
found, digests, lock = {}, {}, threading.Lock()

def worker(t):
    rnd = random.Random(me * 10 + t)
    names = lists[(t + me) % 3][:]       # a name is issued by a different thread on each rank
    for step in range(2):
        rnd.shuffle(names)               # and in a different order
        handles = []
        for name in names:
            handles.append((name, issue(name)))
            time.sleep(0.002 * rnd.random())
        for name, h in handles:
            got = eng.wait(h)
            with lock:
                found[(step, name)] = got.dtype == expected(name).dtype and np.array_equal(got, expected(name))
                digests[(step, name)] = hashlib.sha1(got.tobytes()).hexdigest()

threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
for th in threads: th.start()
for th in threads: th.join(timeout=100)
eng.shutdown()
result = (sorted(k for k, ok in found.items() if not ok), len(found), digests)
"""


@pytest.mark.parametrize("n,env", [(2, {}), (3, {}), (3, {"RINGREDUCE_CACHE_CAPACITY": "0"}),
                                   (3, {"RINGREDUCE_CACHE_CAPACITY": "5"})])
def test_mixed_collectives_from_three_threads_in_any_order_meet_by_name(tmp_path, n, env):
    ranks = run_ranks(n, MIXED_JOB, tmp_path, env=env, timeout=180)
    for r in ranks:
        wrong, count, _ = r.result
        assert count == 48 and wrong == [], f"rank {r.rank}: wrong results for {wrong}"
    shared = [k for k in ranks[0].result[2] if "reduce_scatter" not in k[1]]  # a chunk each: differs per rank
    for r in ranks[1:]:
        assert all(r.result[2][k] == ranks[0].result[2][k] for k in shared), "ranks' results differ in bits"


def test_mismatches_of_every_field_fail_that_request_on_every_rank(tmp_path):
    ranks = run_ranks(3, """
        from ringreduce.engine import Engine
        eng = Engine()
        me = rr.rank()
        def attempt(name, x, **kw):
            try:
                got = eng.wait(eng.enqueue(name, x, **kw))
                return ("ok", got.tolist())
            except rr.MismatchError as e:
                return ("mismatch", str(e))
        f32 = np.ones(4, dtype=np.float32)
        out = {}
        out["kind"] = attempt("k", f32, kind="allgather" if me == 2 else "allreduce")
        out["op"] = attempt("o", f32, op="max" if me == 1 else "sum")
        out["root"] = attempt("r", f32, kind="broadcast", root=1 if me else 0)
        out["dtype"] = attempt("d", f32.astype(np.float64) if me == 2 else f32)
        out["trailing"] = attempt("g", np.ones((2, 4 if me == 1 else 3), np.float32), kind="allgather")
        for step in range(3):   # cached by now
            attempt("w", f32, op="sum")
        out["changed"] = attempt("w", np.ones(5 if me == 2 else 4, np.float32), op="sum")
        out["all changed"] = attempt("w", np.ones(5, np.float32), op="sum")
        out["cache"] = [k for k in eng.negotiator.cache._slot_of if k[0] == "w"]
        eng.shutdown()
        result = out
    """, tmp_path, timeout=120)
    for r in ranks:
        out = r.result
        for case, words in {"kind": ["'k'", "rank 2", "allgather", "allreduce"], "op": ["'o'", "rank 1", "op max"],
                            "root": ["'r'", "root 0", "root 1"], "dtype": ["'d'", "rank 2", "float64"],
                            "trailing": ["'g'", "rank 1", "(*, 4)", "(*, 3)"],
                            "changed": ["'w'", "rank 2", "(5,)", "(4,)"]}.items():
            status, text = out[case]
            assert status == "mismatch" and all(w in text for w in words), (r.rank, case, text)
        assert out["all changed"] == ("ok", [3.0] * 5), f"rank {r.rank}: the engine stopped after a mismatch"
        assert out["cache"] == [("w", "allreduce", "float32", (5,), "sum", 0, 0)]


def test_the_cache_makes_a_repeated_cycle_cost_bits_not_names(tmp_path):
    ranks = run_ranks(3, """
        from ringreduce.engine.negotiation import Negotiator
        keys = [(f"layer{i}/kernel", "allreduce", "float32", (300, 70), "avg", 0, 0) for i in range(100)]
        out = {}
        for capacity in (0, 1024):
            neg = Negotiator(capacity)
            runs = []
            for step in range(3):
                before = neg.stats.bytes_sent
                runs.append(neg.negotiate(keys[::-1] if rr.rank() == 1 else keys, False).run)
            out[capacity] = (neg.stats.bytes_sent - before, runs, list(neg.cache._slot_of.items()),
                             all(sorted(run) == sorted(keys) for run in runs))
        result = out
    """, tmp_path, timeout=60)
    for r in ranks:
        off, on = r.result[0], r.result[1024]
        assert off[3] and on[3], "every cycle must agree on all 100 requests"
        assert on[0] * 20 < off[0], f"cached cycle sent {on[0]} bytes, uncached {off[0]}"
        assert on[0] < 200
        assert on[1][0] == ranks[0].result[1024][1][0] and on[1][2] == ranks[0].result[1024][1][2]
        assert on[2] == ranks[0].result[1024][2], "caches differ between ranks"


def test_a_kind_registered_in_a_few_lines_runs_through_negotiation(tmp_path):
    ranks = run_ranks(2, """
        from ringreduce import engine as E
        E.register_kind("max_rows", lambda h: rr.allgather(h.array, name=h.name).max(axis=0), ragged=True)
        eng = E.Engine()
        got = eng.wait(eng.enqueue("m", np.full((rr.rank() + 1, 2), rr.rank() + 5.0), kind="max_rows"))
        try:
            eng.enqueue("bad", np.ones(2), kind="no such kind")
        except ValueError as e:
            bad = str(e)
        eng.shutdown()
        result = (got.tolist(), bad)
    """, tmp_path, timeout=60)
    for r in ranks:
        assert r.result[0] == [6.0, 6.0]
        assert "no such kind" in r.result[1] and "max_rows" in r.result[1]


def test_a_tensor_that_some_ranks_never_submit_fails_everywhere_instead_of_hanging(tmp_path):
    # Step 0 both ranks reduce "a" (so the response cache holds it). Step 1
    # rank 1 has built another model: rank 0's "a" (cached: sent as a bit)
    # never meets rank 1's "b" (new: sent in full). After RINGREDUCE_TIMEOUT
    # each stall is named on every rank, and the engine goes on.
    ranks = run_ranks(2, """
        import time
        from ringreduce.engine import Engine
        eng = Engine()
        eng.wait(eng.enqueue("a", np.ones(4, dtype=np.float32), op="sum"))
        mine = eng.enqueue("a" if rr.rank() == 0 else "b", np.ones(4, dtype=np.float32))
        t0 = time.monotonic()
        try:
            eng.wait(mine)
            out = "no error"
        except rr.MismatchError as e:
            out = (str(e), time.monotonic() - t0)
        after = eng.wait(eng.enqueue("after", np.ones(3, dtype=np.float32), op="sum")).tolist()
        result = (out, after)
    """, tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "2"})
    for r in ranks:
        out, after = r.result
        assert out != "no error", f"rank {r.rank}: its lone tensor ran"
        message, waited = out
        mine, theirs = ("a", "1") if r.rank == 0 else ("b", "0")
        assert f"'{mine}'" in message and f"not by rank(s) {theirs}" in message, message
        assert waited < 30, f"rank {r.rank} waited {waited:.0f} s"
        assert after == [2.0] * 3, f"rank {r.rank}: the engine stopped after a stall"


SETS_JOB = """
import hashlib, random, threading, time
from ringreduce.engine import Engine
me, n = rr.rank(), rr.size()
pair, trio = rr.add_process_set([0, 2]), rr.add_process_set([1, 2, 3])
eng = Engine(fusion_bytes=1 << 16)
sets = [(None, list(range(n))), (pair, [0, 2]), (trio, [1, 2, 3])]
def value(k, name):
    return np.arange(50, dtype=np.float32) * (k + 1) + len(name)
out, digests = {}, {}
def expected(name, kind, ranks, root):
    if kind == "sum":
        return sum(value(k, name) for k in ranks)
    if kind == "allgather":
        return np.concatenate([value(k, name)[:k + 1] for k in ranks])
    return value(root, name)
def run(ps, ranks, tag):
    rnd = random.Random(me * 7 + len(tag))
    names = [f"{tag}/{kind}/{i}" for i in range(6) for kind in ("sum", "allgather", "broadcast")]
    rnd.shuffle(names)                       # a different order on every rank
    handles = []
    for name in names:
        kind = name.split("/")[1]
        root = ranks[-1]
        if kind == "sum":
            h = eng.enqueue(name, value(me, name), op="sum", process_set=ps)
        elif kind == "allgather":
            h = eng.enqueue(name, value(me, name)[:me + 1], kind="allgather", process_set=ps)
        else:
            h = eng.enqueue(name, value(me, name), kind="broadcast", root=root, process_set=ps)
        handles.append((name, kind, root, h))
        time.sleep(0.001 * rnd.random())
    for name, kind, root, h in handles:
        got = eng.wait(h)
        out[name] = bool(np.array_equal(got, expected(name, kind, ranks, root)))
        digests[name] = hashlib.sha1(got.tobytes()).hexdigest()
threads = [threading.Thread(target=run, args=(ps, ranks, f"set{i}"))
           for i, (ps, ranks) in enumerate(sets) if me in ranks]
for th in threads: th.start()
for th in threads: th.join(timeout=100)
errors = {}
def error(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
if me not in [0, 2]:
    errors["nonmember"] = error(lambda: eng.enqueue("x", np.ones(2), process_set=pair))
if me in [0, 2]:
    errors["root_outside"] = error(lambda: eng.enqueue("y", np.ones(2), kind="broadcast", root=1, process_set=pair))
    # a mismatch within a set fails on its members; the engine goes on
    errors["mismatch"] = error(lambda: eng.wait(eng.enqueue("m", np.ones(2 + me), op="sum", process_set=pair)))
    errors["after"] = eng.wait(eng.enqueue("after", np.ones(3), op="sum", process_set=pair.process_set_id)).tolist()
errors["global"] = eng.wait(eng.enqueue("g", np.ones(2), op="sum")).tolist()
eng.shutdown()
result = (out, digests, errors)
"""


def test_process_set_requests_wait_for_members_only_and_run_on_the_sets_ring(tmp_path):
    ranks = run_ranks(4, SETS_JOB, tmp_path, timeout=180)
    members = {0: ["set0", "set1"], 1: ["set0", "set2"], 2: ["set0", "set1", "set2"], 3: ["set0", "set2"]}
    for r in ranks:
        out, digests, errors = r.result
        assert sorted({name.split("/")[0] for name in out}) == members[r.rank]
        assert len(out) == 18 * len(members[r.rank]) and all(out.values()), \
            f"rank {r.rank}: wrong {[k for k, ok in out.items() if not ok]}"
        assert errors["global"] == [4.0, 4.0]
        if r.rank in (1, 3):
            assert errors["nonmember"].startswith("ValueError") and "not a member" in errors["nonmember"]
        else:
            assert "not a member" in errors["root_outside"], errors
            assert errors["mismatch"].startswith("MismatchError") and "'m'" in errors["mismatch"], errors
            assert errors["after"] == [2.0] * 3
    for name, digest in ranks[2].result[1].items():  # bit-identical on every member
        for r in ranks:
            if name in r.result[1]:
                assert r.result[1][name] == digest, (name, r.rank)


# RINGREDUCE_TIMELINE: the trace is valid JSON (json.load reads it, as
# benchmarks/overlap_bench.py does) even when the script simply ends without
# shutting the engine down.
TIMELINE = """
from ringreduce.engine import engine
h = engine().enqueue("g", np.ones(4, np.float32) * (rr.rank() + 1), op="sum")
result = engine().wait(h).tolist()
"""


def test_a_timeline_is_valid_json_when_the_script_just_ends(tmp_path):
    import json
    trace = tmp_path / "trace.json"
    ranks = run_ranks(2, TIMELINE, tmp_path, timeout=60, env={"RINGREDUCE_TIMELINE": str(trace)})
    assert all(x.result == [3.0] * 4 for x in ranks)
    for path in (trace, tmp_path / "trace.rank1.json"):
        events = json.loads(path.read_text())
        assert any(e.get("name") == "ALLREDUCE" for e in events), path


def test_after_a_lost_peer_every_later_request_raises_that_peers_loss_naming_it(tmp_path):
    ranks = run_ranks(3, """
        import time
        from ringreduce import engine as E
        eng = E.engine()
        x = np.ones(1000, np.float32)
        eng.wait(eng.enqueue("w", x, op="sum"))
        if rr.rank() == 1:
            os._exit(0)  # dies without a word
        errors = []
        for i in range(3):  # the one that meets the loss, then two after the engine stopped
            try:
                eng.wait(eng.enqueue(f"w{i}", x, op="sum"))
                errors.append(None)
            except rr.RingReduceError as e:
                errors.append((type(e).__name__, e.rank, str(e)))
        import pickle
        with open(os.environ["RR_TEST_RESULT"], "wb") as f:
            pickle.dump(errors, f)
        os._exit(0)  # no shutdown: its peer is gone
    """, tmp_path, timeout=120, env={"RINGREDUCE_TIMEOUT": "10"}, check=False)
    for r in (ranks[0], ranks[2]):
        first, *later = r.result
        assert first[0] == "PeerLostError" and first[1] == 1, r.result
        for kind, rank, text in later:
            assert kind == "PeerLostError" and rank == 1, r.result
            assert text.startswith("the engine stopped after an earlier error: PeerLostError: ") and "rank 1" in text
