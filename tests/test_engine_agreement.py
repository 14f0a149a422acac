"""Engine settings that differ per rank (RINGREDUCE_FUSION_THRESHOLD,
RINGREDUCE_CACHE_CAPACITY) are rank 0's on every rank, sent in the
negotiation: every rank fuses and caches alike, so the same tensors run
together and results stay bit-identical."""
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
