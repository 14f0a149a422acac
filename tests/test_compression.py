"""Gradient compression (ringreduce/compression/): each compressor against
the exact average, error feedback, agreement across ranks, bytes saved,
mismatches, the engine and the TensorFlow layer."""
import pytest

from ranks import run_ranks

LINKS_ONLY = {"RINGREDUCE_ARENA_BYTES": "0"}  # bytes are counted on links; one host's arena crosses none

# Every rank holds a different low-noise gradient per step; the exact average
# is known to every rank (each can rebuild the others' from their seeds).
ACCURACY_JOB = """
from ringreduce.compression import PowerSGD, Int8, TopK
N, me = rr.size(), rr.rank()

base = np.random.default_rng(7)
U, V = base.standard_normal((300, 2)), base.standard_normal((2, 201))   # a structure shared by steps and ranks

def grads(rank, step):
    g = np.random.default_rng(1000 * step + rank)
    scale = 1 + 0.2 * g.standard_normal()
    return {"w": (scale * U @ V + 0.05 * g.standard_normal((300, 201))).astype(np.float32),
            "b": g.standard_normal(201).astype(np.float32)}

out = {}
for c in [PowerSGD(rank=4, min_size=1000), Int8(), TopK(ratio=0.05)]:
    errs, sent, true_sum, got_sum, digests = [], [], 0, 0, []
    for step in range(40):
        mine = grads(me, step)
        exact = {k: np.mean([grads(r, step)[k] for r in range(N)], axis=0) for k in mine}
        res = c.allreduce([mine["w"], mine["b"]], ["w", "b"], op="avg")
        errs.append(float(np.linalg.norm(res[0] - exact["w"]) / np.linalg.norm(exact["w"])))
        true_sum = true_sum + exact["w"]
        got_sum = got_sum + res[0]
        digests.append(res[0].tobytes() + res[1].tobytes())
    # error feedback: what went out over all steps is the truth less what the ranks still hold back
    held = np.mean(rr.allgather(c._state[(0, "w")]["error"].reshape(1, 300, 201).astype(np.float64)), axis=0)
    out[c.name] = dict(first=errs[0], last=errs[-1],
                       drift=float(np.linalg.norm(got_sum - true_sum) / np.linalg.norm(true_sum)),
                       ef=float(np.abs(got_sum + held - true_sum).max() / np.abs(true_sum).max()),
                       dtype=str(res[0].dtype), digest=__import__("hashlib").sha256(b"".join(digests)).hexdigest())
result = out
"""


@pytest.mark.parametrize("n", [2, 3])
def test_each_compressor_approximates_the_average_and_error_feedback_keeps_the_sum(tmp_path, n):
    ranks = run_ranks(n, ACCURACY_JOB, tmp_path, timeout=100)
    res = ranks[0].result
    for name, r in res.items():
        assert r["dtype"] == "float32", name
        # bit-identical on every rank, every step
        assert all(x.result[name]["digest"] == r["digest"] for x in ranks), name
        # the cumulative sum sent equals the true one, up to what is held back as error
        assert r["ef"] < 1e-4, (name, r)
    # a rank-2 signal under noise: rank 4 finds it once warm; the error stays small
    assert res["powersgd"]["last"] < 0.05, res["powersgd"]
    # 8-bit: 127 // N levels of the peak; rounding costs ~ (peak / rms) / (levels * sqrt(12)) per rank
    assert res["int8"]["first"] < 3.0 / (127 // n) and res["int8"]["last"] < 3.0 / (127 // n), res["int8"]
    # top-k: each step alone is rough, but the sum over steps drifts little
    assert res["topk"]["drift"] < 0.5, res["topk"]
    assert res["powersgd"]["drift"] < 0.05 and res["int8"]["drift"] < 0.01


BYTES_JOB = """
from ringreduce.compression import PowerSGD, Int8, TopK
g = np.random.default_rng(rr.rank()).standard_normal((1024, 1024)).astype(np.float32)
out = {}
for c in [None, PowerSGD(rank=4), Int8(), TopK(ratio=0.01)]:
    rr.reset_stats()
    for step in range(2):
        rr.allreduce(g, op="avg") if c is None else c.allreduce(g, "w")
    out["none" if c is None else c.name] = rr.stats()["bytes_sent"] / 2
result = out
"""


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_sent_drop_as_each_compressor_promises(tmp_path, n):
    for r in run_ranks(n, BYTES_JOB, tmp_path, timeout=100, env=LINKS_ONLY):
        b = r.result
        plain = 2 * (n - 1) / n * 4 * 1024 * 1024
        assert b["none"] == pytest.approx(plain, rel=0.01)
        assert b["none"] / b["powersgd"] >= 20, b  # 2 x (1024 x 4) floats against 1024 x 1024
        assert b["none"] / b["int8"] == pytest.approx(4, rel=0.05), b
        # n - 1 ranks' (index, value) pairs of 1% of the entries: 8 bytes each
        assert b["topk"] == pytest.approx((n - 1) * 8 * 10486, rel=0.05), b


ENGINE_JOB = """
from ringreduce.compression import PowerSGD, Int8, TopK
from ringreduce.engine import Engine
from ringreduce.errors import MismatchError
eng = Engine(fusion_bytes=1 << 22, timeline_path=os.environ["TIMELINE"])
me = rr.rank()
g = np.random.default_rng(5)
shared = g.standard_normal((256, 3)) @ g.standard_normal((3, 128))
grads = {f"layer{i}/kernel": (shared * (i + 1) + 0.01 * me).astype(np.float32) for i in range(3)}
grads["layer0/bias"] = np.full(128, me, dtype=np.float32)
out = {}
for c in [PowerSGD(rank=4, min_size=1000), Int8(), TopK(ratio=1.0)]:
    for step in range(3):
        hs = {n: eng.enqueue(n, a, op="avg", compression=c) for n, a in reversed(list(grads.items()))}
        res = {n: eng.wait(h) for n, h in hs.items()}
    exact = {n: (shared * (int(n[5]) + 1) + 0.01 * (rr.size() - 1) / 2).astype(np.float32) if "kernel" in n
             else np.full(128, (rr.size() - 1) / 2, dtype=np.float32) for n in grads}
    out[c.name] = dict(err=max(float(np.abs(res[n] - exact[n]).max() / np.abs(exact[n]).max()) for n in grads),
                       digest=__import__("hashlib").sha256(b"".join(res[n].tobytes() for n in sorted(res))).hexdigest())
# different compressors on different ranks: MismatchError on every rank, and the engine goes on
errors = []
for name, c in [("a", PowerSGD(rank=4 + me, min_size=1)), ("b", Int8() if me == 0 else None)]:
    try:
        eng.wait(eng.enqueue(name, np.ones((64, 64), np.float32), compression=c))
    except MismatchError as exc:
        errors.append(str(exc))
try:
    eng.enqueue("c", np.ones(4, np.int32), compression=Int8())
except TypeError as exc:
    errors.append("type: " + str(exc))
out["errors"] = errors
out["after"] = eng.wait(eng.enqueue("after", np.ones(3, np.float32), op="sum")).tolist()
eng.shutdown()
result = out
"""


def test_the_engine_fuses_compressed_tensors_and_mismatched_compressors_raise(tmp_path):
    import json
    ranks = run_ranks(2, ENGINE_JOB, tmp_path, env={"TIMELINE": str(tmp_path / "t.json")}, timeout=100)
    res = ranks[0].result
    for name in ("powersgd", "int8", "topk"):
        assert all(r.result[name]["digest"] == res[name]["digest"] for r in ranks), name
    assert res["powersgd"]["err"] < 1e-3 and res["int8"]["err"] < 0.05, res
    assert res["topk"]["err"] < 1e-6, res  # ratio 1: every entry goes, exact
    for r in ranks:
        errs = r.result["errors"]
        assert len(errs) == 3, errs
        assert "powersgd(min_size=1,rank=4" in errs[0] and "rank=5" in errs[0], errs[0]
        assert "int8(block=1024)" in errs[1], errs[1]
        assert errs[2].startswith("type:") and "int32" in errs[2]
        assert r.result["after"] == [2.0, 2.0, 2.0]
    events = json.loads((tmp_path / "t.json").read_text())
    labels = {e["args"]["op"] for e in events if e.get("name") == "ALLREDUCE"}
    assert any(lbl.startswith("powersgd(") and "fused 4 tensors" in lbl for lbl in labels), labels


KERAS_JOB = """
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf, keras
from sklearn.datasets import load_digits
import ringreduce.tensorflow as rrtf
rrtf.init()
n, r = rrtf.size(), rrtf.rank()
digits = load_digits()
x, y = (digits.data / 16.0).astype(np.float32), digits.target
xs, ys = x[r::n][:800], y[r::n][:800]
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])

out = {}
for label, comp in [("none", rrtf.Compression.none), ("powersgd", rrtf.Compression.powersgd(rank=4)),
                    ("int8", rrtf.Compression.int8), ("topk", rrtf.Compression.topk(ratio=0.1))]:
    model = make_model()
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comp), loss=loss,
                  metrics=["accuracy"])
    rr.reset_stats()
    hist = model.fit(xs, ys, batch_size=32, epochs=3, shuffle=False, verbose=0)
    sent = rr.stats()["bytes_sent"]
    w = model.get_weights()
    state = comp.engine._state if hasattr(comp, "engine") else {}  # the lossy ones: state per tensor key
    out[label] = dict(acc=hist.history["accuracy"][-1], loss=hist.history["loss"], sent=sent,
                      same=all(np.array_equal(a, rr.broadcast(a, root=0)) for a in w),
                      keys=len(state), errors=sum(s.get("error") is not None for s in state.values()))

# DistributedGradientTape, eagerly: names count up every step, the compressor's state stays the variable's
comp = rrtf.Compression.powersgd(rank=2)
model = make_model()
opt = keras.optimizers.SGD(0.1)
losses = []
for step in range(24):
    xb, yb = xs[32 * step:32 * step + 32], ys[32 * step:32 * step + 32]
    with tf.GradientTape() as tape:
        l = loss(yb, model(xb))
    tape = rrtf.DistributedGradientTape(tape, compression=comp)
    opt.apply_gradients(zip(tape.gradient(l, model.trainable_variables), model.trainable_variables))
    losses.append(float(l))
out["tape"] = dict(first=np.mean(losses[:5]), last=np.mean(losses[-5:]), keys=len(comp.engine._state),
                   same=all(np.array_equal(a, rr.broadcast(a, root=0)) for a in model.get_weights()))
result = out
"""


def test_keras_fit_and_the_tape_train_with_each_compressor(tmp_path):
    for r in run_ranks(2, KERAS_JOB, tmp_path, timeout=150, init=False, env=LINKS_ONLY):
        res = r.result
        for label in ("none", "powersgd", "int8", "topk"):
            assert res[label]["same"], f"{label}: weights differ between ranks"
            assert res[label]["loss"][-1] < 0.5 * res[label]["loss"][0], (label, res[label]["loss"])
            assert res[label]["acc"] > res["none"]["acc"] - 0.05, (label, res[label]["acc"], res["none"]["acc"])
        assert res["powersgd"]["sent"] < res["none"]["sent"] / 2, (res["powersgd"]["sent"], res["none"]["sent"])
        assert res["int8"]["sent"] < res["none"]["sent"] / 2.5
        assert res["tape"]["same"] and res["tape"]["last"] < 0.85 * res["tape"]["first"], res["tape"]
        assert res["tape"]["keys"] == 4, "one state per variable, not one per step"
        # under fit (a tf.function, fused buckets) too: error feedback is kept per variable across steps
        for label in ("int8", "topk"):
            assert res[label]["keys"] == 4 and res[label]["errors"] == 4, (label, res[label]["keys"])


# Int8's scales are per block: one rank's outlier coarsens only its own
# block. One block as long as the tensor is the old per-tensor scale, which
# rounds everything but the outlier to zero.
INT8_BLOCK_JOB = """
import hashlib
from ringreduce.compression import Int8
N, me = rr.size(), rr.rank()
def grad(rank):
    g = np.random.default_rng(rank).standard_normal(4196).astype(np.float32) * 1e-3   # 4 blocks and a tail of 100
    if rank == 0:
        g[10] = 1e3
    return g
exact = np.mean([grad(r) for r in range(N)], axis=0)
out = {}
for block in (1024, 4196):
    res = Int8(block=block).allreduce(grad(me), "w", op="avg")
    rest = slice(1024, None)   # every block but the outlier's
    out[str(block)] = dict(err=float(np.linalg.norm(res[rest] - exact[rest]) / np.linalg.norm(exact[rest])),
                      zeros=float(np.mean(res[rest] == 0)), outlier=float(abs(res[10] - exact[10])),
                      digest=hashlib.sha256(res.tobytes()).hexdigest())
result = out
"""


@pytest.mark.parametrize("n", [2, 3])
def test_int8_scales_per_block_so_an_outlier_zeroes_only_its_own_block(tmp_path, n):
    ranks = run_ranks(n, INT8_BLOCK_JOB, tmp_path, timeout=60)
    levels = 127 // n
    for r in ranks:
        blocks, whole = r.result["1024"], r.result["4196"]
        assert all(x.result[k]["digest"] == r.result[k]["digest"] for x in ranks for k in ("1024", "4196"))
        # rounding to L levels of each block's own peak (~3.3 sigma): ~1 / L of the values' rms
        assert blocks["err"] < 3.0 / levels and blocks["zeros"] < 0.1, blocks
        assert whole["zeros"] == 1.0 and whole["err"] == pytest.approx(1.0), whole   # 1e3 / L per level
        assert blocks["outlier"] <= 1e3 / n / levels, blocks   # its own block still carries it


INT8_BYTES_JOB = """
from ringreduce.compression import Int8
g = np.random.default_rng(rr.rank()).standard_normal(1 << 20).astype(np.float32)
out = {}
for block in (16, 1024):
    rr.reset_stats()
    Int8(block=block).allreduce(g, "w")
    out[str(block)] = rr.stats()
result = out
"""


@pytest.mark.parametrize("n", [2, 3])
def test_int8_sends_one_byte_per_value_and_four_per_block(tmp_path, n):
    for r in run_ranks(n, INT8_BYTES_JOB, tmp_path, timeout=60, env=LINKS_ONLY):
        ring = 2 * (n - 1) / n
        # block 16: 65536 float32 scales, 256 KiB, go round the ring beside the 1 MiB of int8 (25% more)
        assert r.result["16"]["ring"] == pytest.approx(ring * ((1 << 20) + 4 * (1 << 16)), rel=0.002), r.result
        # block 1024: 4 KiB of scales, a small allreduce (blobs); the ring carries the int8 values alone
        assert r.result["1024"]["ring"] == pytest.approx(ring * (1 << 20), rel=0.002), r.result
        assert r.result["1024"]["bytes_sent"] < ring * (1 << 20) + (n - 1) * 4096 + 4096, r.result


def test_int8_block_is_part_of_the_tag_and_checked():
    from ringreduce.compression import Int8, from_tag
    assert Int8().tag == "int8(block=1024)" and from_tag(Int8(block=256).tag).block == 256
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="block"):
            Int8(block=bad)


def test_the_speed_benchmark_runs_and_counts_fewer_bytes(tmp_path):
    import json
    import subprocess
    import sys
    from ranks import REPO
    out = tmp_path / "speed.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "compression_speed.py"), "--quick", "--out", str(out),
                    "--steps", "1"], check=True, timeout=100, capture_output=True)
    rows = {r["compression"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["none"]["bytes_per_step"] / rows["powersgd:rank=4"]["bytes_per_step"] > 4
    assert rows["none"]["bytes_per_step"] / rows["int8"]["bytes_per_step"] == pytest.approx(4, rel=0.1)


JOIN_JOB = """
from ringreduce.compression import Int8
from ringreduce.engine import engine
c, eng = Int8(), engine()
steps = 3 if rr.rank() == 0 else 1   # rank 1 runs out of data first
got = []
for step in range(steps):
    got.append(eng.wait(eng.enqueue("w", np.full((64, 64), 1.0 + rr.rank(), np.float32), op="avg",
                                    compression=c)).mean())
last = rr.join()
result = dict(got=[float(g) for g in got], last=last)
"""


def test_a_joined_rank_adds_zeros_to_compressed_allreduces(tmp_path):
    r0, r1 = run_ranks(2, JOIN_JOB, tmp_path, timeout=60)
    assert r1.result["got"] == [pytest.approx(1.5, rel=0.02)]
    # after rank 1 joined, avg still divides by both ranks: (1 + 0) / 2
    assert r0.result["got"][0] == pytest.approx(1.5, rel=0.02)
    assert r0.result["got"][1:] == [pytest.approx(0.5, rel=0.02)] * 2
    assert r0.result["last"] == r1.result["last"] == 0


# A joined rank's stand-in compressor must add exact zeros every step (no error
# feedback of its own) and take the same path as the ranks still training
# (PowerSGD's warm-up is per tensor: plain for the first steps, factors after).
POWERSGD_JOIN_JOB = """
from ringreduce.compression import PowerSGD
from ringreduce.engine import engine
c, eng = PowerSGD(rank=1, warmup_steps=WARMUP, min_size=16), engine()
steps = 5 if rr.rank() == 0 else 2   # rank 1 runs out of data first
got = []
for step in range(steps):   # a rank-1 gradient: PowerSGD's factors carry it exactly
    got.append(eng.wait(eng.enqueue("w", np.full((64, 32), 1.0 + rr.rank(), np.float32), op="avg",
                                    compression=c)).tolist())
last = rr.join()
result = dict(got=got, last=last)
"""


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_a_joined_rank_adds_exact_zeros_to_powersgd_whatever_the_warmup(tmp_path, warmup):
    r0, r1 = run_ranks(2, POWERSGD_JOIN_JOB.replace("WARMUP", str(warmup)), tmp_path, timeout=60)
    import numpy as np
    got = np.array(r0.result["got"])
    np.testing.assert_allclose(got[:2], 1.5, rtol=1e-5)
    np.testing.assert_allclose(got[2:], 0.5, rtol=1e-5)   # (1 + 0) / 2 on each step after rank 1 joined
    assert r1.result["got"] == r0.result["got"][:2]
    assert r0.result["last"] == r1.result["last"] == 0   # rank 0 joined last


# Two models' compressors of one tag fuse in one bucket; each keeps its own
# tensors' error feedback (reset() of one must not touch the other's).
TWO_OWNERS_JOB = """
from ringreduce.compression import Int8
from ringreduce.engine import engine
c1, c2, eng = Int8(), Int8(), engine()
x = np.random.default_rng(rr.rank()).standard_normal(1000).astype(np.float32)
ha = eng.enqueue("a", x, op="avg", compression=c1)
hb = eng.enqueue("b", x, op="avg", compression=c2)
eng.wait(ha), eng.wait(hb)
result = dict(c1=sorted(k[1] for k in c1._state), c2=sorted(k[1] for k in c2._state))
"""


def test_fused_tensors_of_two_compressors_keep_state_in_their_own(tmp_path):
    for r in run_ranks(2, TWO_OWNERS_JOB, tmp_path, timeout=60):
        assert r.result == dict(c1=["a"], c2=["b"]), (r.rank, r.result)


# An fp16 overflow (NaN or inf in one rank's gradient): the step's result is
# not finite on every rank, as an exact allreduce's would not be (a loss
# scaler then skips it), and the next finite step is as good as if the bad
# one never happened: no NaN left behind in error feedback or warm starts.
NONFINITE_JOB = """
from ringreduce.compression import PowerSGD, Int8, TopK
N, me = rr.size(), rr.rank()
def grad(rank, step):
    g = np.random.default_rng(100 * step + rank)
    return (np.outer(g.standard_normal(64), g.standard_normal(48)) + 0.01 * g.standard_normal((64, 48))).astype(np.float32)
out = {}
for bad in (np.nan, np.inf):
    for c in (PowerSGD(rank=2, min_size=16), Int8(), TopK(ratio=0.5)):
        finite, errs = [], []
        for step in range(4):
            g = grad(me, step)
            if step == 1 and me == N - 1:
                g[3, 5] = bad
            res = c.allreduce(g, "w", op="avg")
            finite.append(bool(np.isfinite(res).all()))
            exact = np.mean([grad(r, step) for r in range(N)], axis=0)
            errs.append(float(np.linalg.norm(res - exact) / np.linalg.norm(exact)) if finite[-1] else None)
        out[f"{c.name} {bad}"] = dict(finite=finite, errs=errs)
result = out
"""


def test_a_nan_or_inf_gradient_gives_a_non_finite_step_and_leaves_no_poison(tmp_path):
    ranks = run_ranks(2, NONFINITE_JOB, tmp_path, timeout=60)
    for r in ranks:
        for case, res in r.result.items():
            assert res["finite"] == [True, False, True, True], (r.rank, case, res)
            assert max(res["errs"][2:]) < 1, (r.rank, case, res)  # near the exact average, not garbage


# Called directly (no engine negotiating shapes), ranks whose tensors differ
# in shape but not in size (or, for top-k, not in k) must not get a result.
SHAPE_JOB = """
from ringreduce.compression import PowerSGD, Int8, TopK
from ringreduce.errors import MismatchError
shapes = {"int8": [(10, 20), (20, 10)], "powersgd": [(64, 32), (32, 64)], "topk": [(1000,), (999,)]}
out = {}
for c in (Int8(), PowerSGD(rank=2, min_size=16), TopK(ratio=0.01)):
    try:
        c.allreduce(np.ones(shapes[c.name][rr.rank()], np.float32), "w")
        out[c.name] = "no error"
    except MismatchError as e:
        out[c.name] = "MismatchError" if "ranks disagree on the names, shapes or dtypes" in str(e) else str(e)
result = out
"""


def test_direct_calls_with_different_shapes_raise_mismatch_on_every_rank(tmp_path):
    for r in run_ranks(2, SHAPE_JOB, tmp_path, timeout=60):
        assert r.result == dict(int8="MismatchError", powersgd="MismatchError", topk="MismatchError"), r.result


# A removed process set's id is given to the next set added: a compressor's
# state from the old set (other members) must not flow into the new one.
REUSED_SET_JOB = """
from ringreduce.compression import Int8
c = Int8()
x = np.random.default_rng(rr.rank()).standard_normal(500).astype(np.float32)
old = rr.add_process_set([0, 1])
if rr.rank() in (0, 1):
    c.allreduce(x, "w", process_set=old)      # leaves a rounding error behind on ranks 0 and 1
rr.remove_process_set(old)
new = rr.add_process_set([1, 2])
result = dict(same_id=new.process_set_id == 1)
if rr.rank() in (1, 2):
    got = c.allreduce(x, "w", process_set=new)
    fresh = Int8().allreduce(x, "w", process_set=new)
    result["as_fresh"] = bool(np.array_equal(got, fresh))
"""


def test_state_does_not_leak_into_a_new_process_set_with_a_reused_id(tmp_path):
    for r in run_ranks(3, REUSED_SET_JOB, tmp_path, timeout=60):
        assert r.result["same_id"]
        if r.rank in (1, 2):
            assert r.result["as_fresh"], f"rank {r.rank}: the removed set's error feedback was added in"


# float64 tensors keep float64 precision through top-k: with every entry
# sent (ratio=1) the result is the exact sum, added in rank order.
TOPK_F64_JOB = """
from ringreduce.compression import TopK
xs = [np.random.default_rng(r).standard_normal(301) * (1 + 1e-9 * np.arange(301)) for r in range(rr.size())]
got = TopK(ratio=1.0).allreduce(xs[rr.rank()], "w", op="sum")
want = np.zeros(301)
for x in xs:
    want = want + x
result = dict(dtype=str(got.dtype), same=bool(np.array_equal(got, want)), err=float(np.abs(got - want).max()))
"""


def test_topk_keeps_float64_precision(tmp_path):
    for r in run_ranks(2, TOPK_F64_JOB, tmp_path, timeout=60):
        assert r.result["dtype"] == "float64" and r.result["same"], r.result


def test_one_name_for_two_tensors_is_refused_before_any_collective():
    import numpy as np
    from ringreduce.compression import Int8
    with pytest.raises(ValueError, match=r"\[.w.\] name more than one tensor"):
        Int8().allreduce([np.ones(4, np.float32), np.ones(4, np.float32)], ["w", "w"])


# Called directly, one rank with an integer tensor: TypeError there, and the
# others fail on their first collective (naming that rank), neither hanging
# nor needing the bad rank to exit.
INT_ON_ONE_RANK_JOB = """
from ringreduce.compression import Int8
try:
    Int8().allreduce(np.ones(8, np.float32 if rr.rank() == 0 else np.int32), "w")
    result = "ok"
except Exception as e:
    result = (type(e).__name__, str(e))
rr.barrier()   # the bad rank goes on: its peer must not be waiting on it
"""


def test_an_integer_tensor_on_one_rank_fails_every_rank(tmp_path):
    r0, r1 = run_ranks(2, INT_ON_ONE_RANK_JOB, tmp_path, timeout=60)
    assert r1.result[0] == "TypeError" and "'w' is int32" in r1.result[1]
    assert r0.result[0] == "MismatchError" and "rank 1: Int8(block=1024) compresses floating-point tensors; 'w' is int32" \
        in r0.result[1], r0.result


# QR is unique only up to the signs of its columns, and LAPACK builds differ
# in the ones they pick: a rank whose QR returns (-Q, -R) (a valid QR) must
# still get the same result as the others, and a good one.
QR_SIGN_JOB = """
from ringreduce.compression import PowerSGD
if rr.rank() == 1:
    _qr = np.linalg.qr
    np.linalg.qr = lambda a: tuple(-x for x in _qr(a))
c = PowerSGD(rank=2, min_size=16)
base = np.random.default_rng(3)
U, V = base.standard_normal((64, 2)), base.standard_normal((2, 48))
grads = [(U @ V * (1 + r)).astype(np.float32) for r in range(rr.size())]
res = [c.allreduce(grads[rr.rank()], "w", op="avg") for _ in range(3)]
exact = np.mean(grads, axis=0)
result = dict(digest=__import__("hashlib").sha256(b"".join(r.tobytes() for r in res)).hexdigest(),
              err=float(np.linalg.norm(res[-1] - exact) / np.linalg.norm(exact)))
"""


def test_powersgd_agrees_whatever_signs_a_lapack_gives_its_qr(tmp_path):
    r0, r1 = run_ranks(2, QR_SIGN_JOB, tmp_path, timeout=60)
    assert r0.result["digest"] == r1.result["digest"], (r0.result, r1.result)
    assert r0.result["err"] < 1e-4   # a rank-2 gradient: exact after a step or two


def test_topk_indices_are_int64_only_past_what_int32_holds():
    """Choosing without allocating 8 GiB: the last index of 2**31 elements fits
    int32; one more element would wrap to a negative index."""
    import numpy as np
    from ringreduce.compression import topk
    assert topk.index_dtype(1) == np.int32 and topk.index_dtype(2**31) == np.int32
    assert topk.index_dtype(2**31 + 1) == np.int64 and topk.index_dtype(2**40) == np.int64
    idx = np.array([3, 2**31 - 1, 2**31, 2**33 + 7])   # past int32: exact only as int64
    values = np.array([1.5, -2.0, 3.25, 4.0], np.float32)
    idx_back, values_back = topk.unpack(topk.pack(idx, values, 2**34), 4, 2**34, np.float32)
    assert idx_back.dtype == np.int64 and idx_back.tolist() == idx.tolist()
    assert values_back.tolist() == values.tolist()


# The int64 path end to end on a small tensor: with the int32 limit lowered,
# ranks send int64 indices; the sums and the error left behind are the same
# bits as on the int32 path, and the gathered bytes grow by 4 per pair.
TOPK_WIDE_JOB = """
from ringreduce.compression import TopK, topk
xs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in range(rr.size())]
out = {}
for limit in [2**31, 100]:
    topk.INT32_INDEX_LIMIT = limit
    c = TopK(ratio=0.1)
    rr.reset_stats()
    got = [c.allreduce(xs[rr.rank()] * (s + 1), "w", op="sum") for s in range(3)]
    out[limit] = (b"".join(g.tobytes() for g in got), c._state[(0, "w")]["error"].tobytes(),
                  rr.stats()["bytes_sent"])
result = out
"""


# PowerSGD's warm-up keeps Q warm: each exact warm-up step takes a power-iteration
# step on the exact sum (no bytes), so the first compressed step already projects
# on the gradient's leading subspace. The gradient: a spectrum with a gap after
# the rank (12, 10 | 3, 2.5, 2, 1.5) under noise, a different sample per rank.
WARM_Q_JOB = """
from ringreduce.compression import PowerSGD
N, me = rr.size(), rr.rank()
base = np.random.default_rng(3)
U = np.linalg.qr(base.standard_normal((400, 6)))[0]
V = np.linalg.qr(base.standard_normal((300, 6)))[0]
S = np.array([12, 10, 3, 2.5, 2, 1.5])

def grad(rank, step):
    g = np.random.default_rng(100 * step + rank)
    return ((U * (S * (1 + 0.1 * g.standard_normal(6)))) @ V.T
            + 0.02 * g.standard_normal((400, 300))).astype(np.float32)

out = {}
for warmup in (0, 5):
    c = PowerSGD(rank=2, warmup_steps=warmup, min_size=16)
    for step in range(warmup + 1):
        res = c.allreduce(grad(me, step), "w", op="avg")
    exact = np.mean([grad(r, warmup) for r in range(N)], axis=0).astype(np.float64)
    u, s, vt = np.linalg.svd(exact)
    best = (u[:, :2] * s[:2]) @ vt[:2]   # the best rank-2 approximation
    out[warmup] = dict(err=float(np.linalg.norm(res - exact) / np.linalg.norm(exact)),
                       best=float(np.linalg.norm(best - exact) / np.linalg.norm(exact)),
                       digest=__import__("hashlib").sha256(res.tobytes()).hexdigest())
result = out
"""


def test_topk_with_int64_indices_gives_the_same_bits(tmp_path):
    for r in run_ranks(2, TOPK_WIDE_JOB, tmp_path, timeout=60, env=LINKS_ONLY):
        narrow, wide = r.result[2**31], r.result[100]
        assert wide[:2] == narrow[:2], f"rank {r.rank}: int64 indices changed the result"
        assert wide[2] - narrow[2] == 101 * 3 * 4 * (2 - 1), (wide[2], narrow[2])   # (N-1) copies of 101 pairs x 3 steps, 4 bytes more each


# A compressor of the user's own, defined on every rank (here: in the job),
# is registered under its name, so a joined rank's engine makes its stand-in
# from the tag as for the built-in ones. One without a name of its own (a
# stand-in would be its parent) is refused at enqueue, on every rank alike.
CUSTOM_JOB = """
from ringreduce.compression import Compressor, Int8
from ringreduce.engine import engine

class Scaled(Compressor):   # exact: scales by a power of two before the sum, back after
    name = "scaled"
    def __init__(self, factor=4.0):
        super().__init__()
        self.factor = factor
    def params(self):
        return {"factor": self.factor}
    def _reduce(self, items, n, group, label):
        return [s / self.factor for s in self._plain_sum([a * self.factor for _, a, _ in items], group, label)]

class Renamed(Int8):
    pass

c, eng = Scaled(factor=8.0), engine()
steps = 3 if rr.rank() == 0 else 1   # rank 1 runs out of data first
got = []
for step in range(steps):
    got.append(eng.wait(eng.enqueue("w", np.full((8, 8), 1.0 + rr.rank(), np.float32), op="avg",
                                    compression=c)).tolist())
last = rr.join()
try:
    eng.enqueue("v", np.ones(4, np.float32), compression=Renamed())
    refused = None
except ValueError as e:
    refused = str(e)
result = dict(got=got, last=last, refused=refused, after=rr.allreduce(np.ones(3)).tolist())
"""


def test_a_compressor_of_the_users_own_runs_on_a_joined_rank_too(tmp_path):
    r0, r1 = run_ranks(2, CUSTOM_JOB, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "20"})
    assert r1.result["got"] == [[[1.5] * 8] * 8]
    assert r0.result["got"] == [[[1.5] * 8] * 8] + [[[0.5] * 8] * 8] * 2   # (1 + 0) / 2 once rank 1 joined
    assert r0.result["last"] == r1.result["last"] == 0
    for r in (r0, r1):
        assert "Renamed has no name of its own" in r.result["refused"], r.result
        assert r.result["after"] == [2.0] * 3


def test_from_tag_names_the_tag_and_the_fix_for_an_unknown_compressor():
    from ringreduce.compression import Compressor, TopK, from_tag
    with pytest.raises(ValueError, match=r"no compressor named 'nosuch' \(tag 'nosuch\(x=1\)'\).*"
                                         r"subclass with name = 'nosuch' must be defined on every rank"):
        from_tag("nosuch(x=1)")
    with pytest.raises(ValueError, match=r"TopK cannot be made again from its tag 'topk\(bogus=1\)'"):
        from_tag("topk(bogus=1)")
    with pytest.raises(TypeError, match="compressor name 'topk' is taken by ringreduce.compression.topk.TopK"):
        type("Clash", (Compressor,), {"name": "topk"})
    assert repr(from_tag(TopK(ratio=0.25).tag)) == "TopK(ratio=0.25)"


def test_powersgd_starts_compressing_from_a_q_warmed_up_on_the_exact_steps(tmp_path):
    ranks = run_ranks(2, WARM_Q_JOB, tmp_path, timeout=60)
    res = ranks[0].result
    assert all(r.result == res for r in ranks)   # bit-identical on every rank
    cold, warm = res[0], res[5]
    # from the random Q, one power-iteration step mixes the 3rd..6th directions in
    assert cold["err"] > 1.3 * cold["best"], cold
    # after 5 warm-up steps, the first compressed step is the best rank-2 approximation, nearly
    assert warm["err"] < 1.02 * warm["best"], warm


def test_accuracy_benchmark_saves_another_length_or_learning_rate_under_its_own_task():
    # runs of another epoch count or learning rate must sit beside the stored default runs, never overwrite them
    import argparse
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from compression_accuracy import label
    def args(**kw):
        return argparse.Namespace(**{"quick": False, "epochs": 30, "lr": 0.05, "synthetic_epochs": 1,
                                     "synthetic_lr": 0.01, "decay": "none", **kw})
    assert label(args(), "synthetic") == "synthetic" and label(args(), "digits") == "digits"
    assert label(args(synthetic_epochs=2), "synthetic") == "synthetic:epochs=2"
    assert label(args(synthetic_lr=0.0100001), "synthetic") == "synthetic:lr=0.0100001"
    assert label(args(synthetic_epochs=2, synthetic_lr=0.02), "synthetic") == "synthetic:epochs=2,lr=0.02"
    assert label(args(lr=0.1), "digits") == "digits:lr=0.1" and label(args(lr=0.1), "synthetic") == "synthetic"
    assert label(args(decay="cosine"), "synthetic") == "synthetic:decay=cosine"
    assert label(args(decay="cosine", synthetic_lr=0.0100001), "synthetic") == "synthetic:lr=0.0100001,decay=cosine"
    from compression_accuracy import unnudged  # a learning-rate control pairs with the task it nudges
    assert unnudged("synthetic:lr=0.0100001,decay=cosine") == "synthetic:decay=cosine"
    assert unnudged("synthetic:lr=0.0100001") == "synthetic" and unnudged("synthetic:epochs=2") == "synthetic:epochs=2"
