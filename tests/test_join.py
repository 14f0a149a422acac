"""rr.join(), Horovod's hvd.join(): a rank out of data joins; the others'
allreduces go on with it adding zeros (avg still divides by every rank);
join() returns, on every rank, the rank that joined last. The joined rank's
stand-in zeros stay zeros when fused with tensors of its own and under
compression (TopK's error feedback, PowerSGD's warm-up), and requests every
member refuses while it has joined leave its engine working."""
import os

import numpy as np
import pytest

import ranks
from ranks import run_ranks

UNEVEN_JOB = """
from ringreduce.engine import engine
STEPS = [int(s) for s in os.environ["STEPS"].split(",")]
n, me = rr.size(), rr.rank()
def grad(rank, step, dtype, shape, op):
    sign = -1 if op == "max" else 1   # a joined rank's zeros would win a max of negatives: it adds -inf
    return np.full(shape, sign * (rank + 1) * (step + 1) * 3, dtype=dtype)
wrong, errors = [], {}
for step in range(STEPS[me]):
    handles = {(dt, op): engine().enqueue(f"g/{dt}/{op}", grad(me, step, dt, (5, 3) if dt == "float64" else (17,), op), op=op)
               for dt in ("float64", "int32", "float16") for op in ("avg", "sum", "max")}
    for (dt, op), h in handles.items():
        got = engine().wait(h)
        active = [grad(r, step, dt, got.shape, op) for r in range(n) if STEPS[r] > step]
        total = np.sum(active, axis=0, dtype=np.float64)
        want = {"sum": total, "avg": total / n if dt != "int32" else total // n, "max": np.max(active, axis=0)}[op]
        if not np.array_equal(got, want.astype(dt)):
            wrong.append((step, dt, op, got.ravel()[:3].tolist(), want.ravel()[:3].tolist()))
    if step == min(STEPS):   # somebody has joined by now: only allreduce goes on
        for kind in ("allgather", "broadcast"):
            try:
                engine().wait(engine().enqueue(f"{kind}/{step}", np.ones(3), kind=kind))
                errors[kind] = "ran"
            except rr.MismatchError as e:
                errors[kind] = str(e)
last = rr.join()
after = engine().wait(engine().enqueue("after", np.full(4, me + 1.0), op="sum")).tolist()
result = (wrong, last, errors, after)
"""


@pytest.mark.parametrize("steps,last", [("2,4,6", 2), ("5,1,3", 0), ("3,6,1", 1)])
def test_ranks_run_out_of_data_at_different_steps_and_the_rest_go_on(tmp_path, steps, last):
    ranks = run_ranks(3, UNEVEN_JOB, tmp_path, env={"STEPS": steps}, timeout=180)
    first_out = min(range(3), key=lambda r: int(steps.split(",")[r]))
    for r in ranks:
        wrong, got_last, errors, after = r.result
        assert wrong == [], f"rank {r.rank}: {wrong}"
        assert got_last == last, f"rank {r.rank}: join returned {got_last}, the last to join was {last}"
        assert after == [6.0] * 4, "after every rank joined the engine must work as before"
        if int(steps.split(",")[r.rank]) > int(steps.split(",")[first_out]):
            for kind in ("allgather", "broadcast"):
                assert "joined" in errors[kind] and f"rank(s) {first_out}" in errors[kind], errors


def test_every_rank_joining_at_once_returns_the_same_rank_everywhere(tmp_path):
    ranks = run_ranks(2, "result = (rr.join(), rr.join())", tmp_path, timeout=60)
    assert ranks[0].result == ranks[1].result and all(v in (0, 1) for v in ranks[0].result)


def test_a_direct_allreduce_beside_a_joined_rank_runs_with_its_zeros_and_the_engine_goes_on(tmp_path):
    ranks = run_ranks(2, """
        from ringreduce.engine import engine
        first = None
        if rr.rank() == 0:
            last = rr.join()
        else:
            first = rr.allreduce(np.ones(3)).tolist()   # outside the engine: rank 0 adds zeros
            last = rr.join()
        after = engine().wait(engine().enqueue("x", np.ones(2), op="sum")).tolist()
        result = (first, last, after)
    """, tmp_path, timeout=60)
    assert ranks[1].result[0] == [1.0, 1.0, 1.0]
    for r in ranks:
        _, last, after = r.result
        assert last == 1 and after == [2.0, 2.0], r.result


# rr.join() before init() says what every other call says before init, not
# that the engine stopped after an earlier error.
def test_join_before_init_says_call_init_first():
    import subprocess
    import sys
    from ranks import REPO
    code = ("import ringreduce as rr\n"
            "try:\n    rr.join()\nexcept rr.RingReduceError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGREDUCE_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ringreduce is not initialized: call ringreduce.init() first", out


JOINED_STAND_IN_STATE = """
import time
from ringreduce.engine import engine, join
from ringreduce.compression import TopK
r = rr.rank()
e = engine()
C = TopK(0.25)  # k = 1 of 4: what is not sent stays as error feedback
step1 = {"a": np.array([0, 0, 0, 2], np.float32),
         "b": np.array([5, 0, 0, 7], np.float32) if r == 1 else np.array([0, 0, 0, 1], np.float32)}
for k in ("a", "b"):
    e.wait(e.enqueue(k, step1[k], op="sum", compression=C))
# rank 1 now holds error feedback [5, 0, 0, 0] for b
out = {}
if r == 1:
    h = e.enqueue("a", np.array([0, 0, 0, 3], np.float32), op="sum", compression=C)  # its own, in flight
    out["last"] = join()
    out["a"] = e.wait(h).tolist()
else:
    time.sleep(1.0)  # rank 1 has joined with its "a" in flight: a and b run in one bucket there
    with e._cond:  # both agreed in one cycle
        ha = e.enqueue("a", np.array([0, 0, 0, 3], np.float32), op="sum", compression=C)
        hb = e.enqueue("b", np.array([0, 0, 0, 1], np.float32), op="sum", compression=C)
    out["a"], out["b"] = e.wait(ha).tolist(), e.wait(hb).tolist()
    out["last"] = join()
result = out
"""


def test_joined_rank_stand_in_in_a_bucket_with_its_own_tensor_adds_zeros(tmp_path):
    """A joined rank's stand-in for b, fused with a tensor of its own (a),
    adds zeros: it goes through the fresh stand-in compressor's state, never
    its own compressor's state for b (that would send b's old error
    feedback, 5 at index 0)."""
    res = ranks.run_ranks(2, JOINED_STAND_IN_STATE, tmp_path, timeout=90)
    assert res[0].result["b"] == [0, 0, 0, 1], res[0].result
    assert res[0].result["a"] == res[1].result["a"] == [0, 0, 0, 6]


LATE_HAND_OVER_WHILE_JOINED = """
from ringreduce.engine import engine, join
r = rr.rank()
e = engine()
out = {}
if r == 1:
    orig, late = e.negotiator.negotiate, []

    def negotiate(keys, joined, *args):
        agreement = orig(keys, joined, *args)
        if joined and agreement.run and not late:  # handed over from another thread while this pass ran
            late.append(e.enqueue("x", np.full((2, 2), 100.0, np.float32), op="sum"))
        return agreement

    e.negotiator.negotiate = negotiate
    out["last"] = join()
    out["late"] = e.wait(late[0]).tolist()
else:
    out["x"] = e.wait(e.enqueue("x", np.ones(4, np.float32), op="sum")).tolist()
    out["again"] = e.wait(e.enqueue("x", np.ones((2, 2), np.float32), op="sum")).tolist()
    out["last"] = join()
result = out
"""


def test_joined_rank_hand_over_during_a_pass_is_not_run_unnegotiated(tmp_path):
    """A joined rank's tensor handed over while a pass agrees on that name
    (without it: the others' request) waits for a pass of its own: only
    what a rank offered in the pass runs, so the others get the stand-in
    zeros in their shape, not its data in its shape (rank 0's (4,) as 101s)."""
    res = ranks.run_ranks(2, LATE_HAND_OVER_WHILE_JOINED, tmp_path, timeout=90)
    assert res[0].result["x"] == [1, 1, 1, 1], res[0].result
    assert res[0].result["again"] == res[1].result["late"] == [[101, 101], [101, 101]]


REFUSED_WHILE_JOINED = """
from ringreduce.engine import engine, join
r = rr.rank()
e = engine()
out = {}
if r != 1:
    try:
        e.enqueue("bad", np.zeros(3, np.complex64), op="sum")  # refused alike on ranks 0 and 2
    except (TypeError, ValueError) as exc:
        out["bad"] = type(exc).__name__
    out["ok"] = e.wait(e.enqueue("ok", np.ones(3, np.float32), op="sum")).tolist()
out["last"] = join()
result = out
"""


def test_request_refused_by_every_member_while_a_rank_has_joined(tmp_path):
    """Every rank with data refuses a request (bad dtype) alike while one
    has joined: the joined rank's engine goes on (it must not make stand-in
    zeros of the refusal's 'dtype', the problem text, and die of KeyError)."""
    res = ranks.run_ranks(3, REFUSED_WHILE_JOINED, tmp_path, timeout=90)
    for r in (0, 2):
        assert res[r].result["bad"] in ("TypeError", "ValueError")
        assert res[r].result["ok"] == [2.0, 2.0, 2.0]  # rank 1 adds zeros
    assert len({x.result["last"] for x in res}) == 1


POWERSGD_WARM_UP_OVER_WHILE_JOINED = """
import time
from ringreduce.engine import engine, join
from ringreduce.compression import PowerSGD
r = rr.rank()
e = engine()
C = PowerSGD(rank=1, warmup_steps=1, min_size=16)
u, v = np.arange(1, 9, dtype=np.float32), np.linspace(-1, 1, 8, dtype=np.float32)
b = np.outer(u, v)  # rank 1: PowerSGD of rank 1 holds it exactly
for k in ("a", "b"):  # step 1: the warm-up, plain
    e.wait(e.enqueue(k, b * (r + 1), op="sum", compression=C))
out = {}
if r == 1:
    h = e.enqueue("a", b, op="sum", compression=C)  # its own, in flight, past its warm-up
    out["last"] = join()
    out["a"] = e.wait(h)
else:
    time.sleep(1.0)  # rank 1 has joined with its "a" in flight: a and b (a stand-in there) fuse
    with e._cond:
        ha = e.enqueue("a", b, op="sum", compression=C)
        hb = e.enqueue("b", b, op="sum", compression=C)
    out["a"], out["b"] = e.wait(ha), e.wait(hb)
    out["last"] = join()
out["expect"] = b
result = out
"""


def test_powersgd_past_warm_up_with_a_stand_in_fused_to_an_own_tensor(tmp_path):
    """A joined rank's stand-in (fresh state, step 1) runs as the compressor
    made from the negotiated tag does on every rank: factors, as the others
    past their warm-up send, never its own compressor's warm-up plain path
    (the ranks would run different collectives)."""
    res = ranks.run_ranks(2, POWERSGD_WARM_UP_OVER_WHILE_JOINED, tmp_path, timeout=90)
    b = res[0].result["expect"]
    assert np.allclose(res[0].result["b"], b, rtol=1e-4, atol=1e-4)  # rank 1 adds zeros
    assert res[0].result["a"].tobytes() == res[1].result["a"].tobytes()
    assert np.allclose(res[0].result["a"], 2 * b, rtol=1e-4, atol=1e-4)


TWO_POWERSGD_ONE_TAG_WHILE_JOINED = """
import time
from ringreduce.engine import engine, join
from ringreduce.compression import PowerSGD
r = rr.rank()
e = engine()
A = PowerSGD(rank=1, warmup_steps=3, min_size=16)  # a's: past its warm-up, tagged warmup_steps=0
B = PowerSGD(rank=1, warmup_steps=0, min_size=16)  # b's: the same tag from its first step
u, v = np.arange(1, 9, dtype=np.float32), np.linspace(-1, 1, 8, dtype=np.float32)
m = np.outer(u, v)
for step in range(4):  # step 4 past a's warm-up: a's key (its new tag) takes the lowest slot, before b's
    e.wait(e.enqueue("a", m, op="sum", compression=A))
e.wait(e.enqueue("b", m, op="sum", compression=B))
out = {}
if r == 1:
    h = e.enqueue("a", m, op="sum", compression=A)
    out["last"] = join()
    out["a"] = e.wait(h)
else:
    time.sleep(1.0)  # rank 1 has joined with its "a" in flight: a and b (a stand-in there) fuse
    with e._cond:
        ha = e.enqueue("a", m, op="sum", compression=A)
        hb = e.enqueue("b", m, op="sum", compression=B)
    out["a"], out["b"] = e.wait(ha), e.wait(hb)
    out["last"] = join()
out["expect"] = m
result = out
"""


def test_two_powersgd_of_one_tag_fused_with_a_stand_in(tmp_path):
    """Two compressors of one tag (a's past its warm-up, b's without one)
    fuse: every rank runs the bucket with the compressor made from the tag,
    the joined one and the ranks with data alike (never a's warmup_steps on
    some, b plain at its step 2, and the tag's on the joined one)."""
    res = ranks.run_ranks(2, TWO_POWERSGD_ONE_TAG_WHILE_JOINED, tmp_path, timeout=90)
    m = res[0].result["expect"]
    assert np.allclose(res[0].result["b"], m, rtol=1e-4, atol=1e-4)
    assert res[0].result["a"].tobytes() == res[1].result["a"].tobytes()
    assert np.allclose(res[0].result["a"], 2 * m, rtol=1e-4, atol=1e-4)
