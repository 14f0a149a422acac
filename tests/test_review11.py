"""review11: silent-wrong-result hunts in the engine (ringreduce/engine/scheduler.py,
negotiation.py) and the compressors.

- RINGREDUCE_FUSION_THRESHOLD set differently per rank: each rank cut its
  own buckets, and the engine died on a shape mismatch naming no tensor
  (or, with zero-size tensors between, paired buffers of other tensors).
  Rank 0's threshold is now negotiated: every rank fuses alike.
- RINGREDUCE_CACHE_CAPACITY set differently per rank: the caches evicted
  differently, one slot bit named different requests on different ranks
  (KeyError, the engine dead; or ranks running different requests). Rank
  0's capacity is now sent in the first pass and holds on every rank.
- A joined rank's stand-in zeros fused with a compressed tensor of its own
  went through its own compressor's state: it sent that tensor's old error
  feedback instead of zeros (silently wrong sums). Stand-ins now always use
  the fresh stand-in compressor's state, and that stand-in (made from the
  negotiated tag) runs the bucket: with its own PowerSGD past its warm-up
  (negotiated as warmup_steps=0) the joined rank took the plain path for
  the stand-in while the others sent factors. A compressor made from the
  tag now runs every compressed bucket on every rank (two models'
  compressors of one tag fused, one past its warm-up, disagreed too).
- Every member refused a request alike while a rank had joined: the joined
  rank's engine died making zeros of the refusal's dtype text.
- A joined rank that hands a tensor over (from another thread) while a pass
  agrees on that name ran it, never negotiated, in place of its zeros: the
  others got its data, in its shape. Only what a rank offered in the pass runs.
"""
import pickle
import secrets
import subprocess
import sys
import textwrap

import numpy as np

import ranks
from ringreduce.engine.negotiation import decode, encode
from ringreduce.engine.response_cache import ResponseCache

DIFFERENT_FUSION = """
from ringreduce.engine import engine
from ringreduce.compression import Int8
r = rr.rank()
e = engine()
out = {}
for mode in ("plain", "int8"):
    C = Int8(block=4) if mode == "int8" else None
    for step in range(3):  # the response cache warm from step 1
        hs = [e.enqueue(f"{mode}{i}", np.full(s, r + 1.0 + i, np.float32), op="sum", compression=C)
              for i, s in enumerate([4, 4, 8, 0, 4])]
        out[mode, step] = [e.wait(h).tobytes() for h in hs]
out["fusion"] = e.fusion_bytes
result = out
"""


def _run_with_envs(body, tmp_path, envs, timeout=90):
    script = tmp_path / "job.py"
    script.write_text(ranks.PRELUDE + "rr.init()\n" + textwrap.dedent(body) + ranks.EPILOGUE)
    port, secret = ranks.free_port(), secrets.token_hex(8)
    procs = []
    for r, extra in enumerate(envs):
        env = ranks.rank_env(r, len(envs), port, secret, dict(extra, RR_TEST_RESULT=str(tmp_path / f"r{r}.pkl")))
        p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        ranks.started.append(p)
        procs.append(p)
    results = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        results.append(pickle.loads((tmp_path / f"r{r}.pkl").read_bytes()))
    return results


def test_fusion_threshold_differing_per_rank_fuses_alike(tmp_path):
    res = _run_with_envs(DIFFERENT_FUSION, tmp_path, [{"RINGREDUCE_FUSION_THRESHOLD": "32"},
                                                      {"RINGREDUCE_FUSION_THRESHOLD": "1000000"}])
    assert res[0]["fusion"] == res[1]["fusion"] == 32, "rank 0's threshold holds on every rank"
    for key in res[0]:
        if key == "fusion":
            continue
        assert res[0][key] == res[1][key], f"{key}: ranks differ"
        for i, (blob, size) in enumerate(zip(res[0][key], [4, 4, 8, 0, 4])):
            got = np.frombuffer(blob, np.float32)
            assert got.shape == (size,)
            if key[0] == "plain":  # exact: 1 + i on rank 0, 2 + i on rank 1
                assert (got == 3.0 + 2 * i).all(), (key, i, got)
            else:
                assert np.allclose(got, 3.0 + 2 * i, rtol=0.05), (key, i, got)


def test_fusion_threshold_rides_the_message_only_when_given():
    cache = ResponseCache(8)
    plain = encode([], False, cache)
    with_fusion = encode([], False, cache, fusion=123456789)
    assert decode(plain).fusion is None
    assert decode(with_fusion).fusion == 123456789
    assert len(with_fusion) == len(plain) + 8


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
    reduced through its own compressor's state for b: it sent b's old
    error feedback (5 at index 0) instead of zeros."""
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
    """A joined rank's tensor handed over while a pass agreed on that name
    (without it: the others' request) ran in place of the stand-in zeros,
    with its own shape and data: rank 0's (4,) got 101s."""
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
    """Every rank with data refused a request (bad dtype) alike while one
    had joined: its engine made stand-in zeros of the refusal's 'dtype' (the
    problem text), died with KeyError, and the job was lost."""
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
    """A joined rank reduced its stand-in (fresh state, step 1) with its own
    compressor's warmup_steps: the plain path, while the others (past their
    warm-up) sent factors: the ranks ran different collectives."""
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
    fuse; the ranks with data ran the bucket with a's warmup_steps (b, at
    its step 2, plain), the joined one with the tag's (b as factors)."""
    res = ranks.run_ranks(2, TWO_POWERSGD_ONE_TAG_WHILE_JOINED, tmp_path, timeout=90)
    m = res[0].result["expect"]
    assert np.allclose(res[0].result["b"], m, rtol=1e-4, atol=1e-4)
    assert res[0].result["a"].tobytes() == res[1].result["a"].tobytes()
    assert np.allclose(res[0].result["a"], 2 * m, rtol=1e-4, atol=1e-4)


DIFFERENT_CACHE_CAPACITY = """
from ringreduce.engine import engine
r = rr.rank()
e = engine()
out = []
for step in range(4):
    names = ["a", "b", "c"] if step % 2 == 0 else ["c", "a"]
    hs = {k: e.enqueue(k, np.full(3, {"a": 1.0, "b": 10.0, "c": 100.0}[k] * (r + 1), np.float32), op="sum")
          for k in names}
    out.append({k: e.wait(h).tolist() for k, h in hs.items()})
result = dict(steps=out, capacity=e.negotiator.cache.capacity)
"""


def test_cache_capacity_differing_per_rank_is_rank_0s(tmp_path):
    res = _run_with_envs(DIFFERENT_CACHE_CAPACITY, tmp_path, [{"RINGREDUCE_CACHE_CAPACITY": "1"}, {}])
    assert res[0]["capacity"] == res[1]["capacity"] == 1
    for step in res[0]["steps"]:
        for k, v in step.items():
            assert v == [3 * {"a": 1.0, "b": 10.0, "c": 100.0}[k]] * 3, (k, v)
    assert res[0]["steps"] == res[1]["steps"]
