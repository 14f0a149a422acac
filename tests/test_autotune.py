"""RINGREDUCE_AUTOTUNE=1: the init calibration (segment size, small limit),
its cache per world shape, and the engine's fusion threshold tuned from
its cycles (ringreduce/core/autotune.py)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ranks import run_ranks
import ringreduce
from ringreduce.core import autotune
from ringreduce.core.config import Config

# What every rank reports: the choice, the limit the world's ring uses, and a
# correctness check at sizes on both sides of every candidate small limit.
REPORT = """
from ringreduce.core import collectives as _c
w = _c.communicator().world
ok = True
for n in (1, 3, 1000, 2731, 10923, 16385, 65537, 300001):
    x = np.random.default_rng(n * 7 + rr.rank()).standard_normal(n).astype(np.float32)
    want = sum(np.random.default_rng(n * 7 + r).standard_normal(n).astype(np.float32).astype(np.float64)
               for r in range(rr.size()))
    got = rr.allreduce(x)
    ok = ok and np.allclose(got, want, rtol=1e-5, atol=1e-4)
    ok = ok and bool(np.all(rr.allgather(got[None]) == got))  # bit-identical on every rank
result = dict(tune=w.extra.get("autotune"), limit=_c.communicator().ring.small_limit, seg=w.config.segment_bytes,
              small=w.config.small_bytes, ok=ok)
"""


def _key(n, backend="socket", shm_links=None):
    """The cache key of n ranks all on this machine, this version and build."""
    one = autotune.fingerprint(autotune.this_machine(), ringreduce.__version__, autotune.this_build())
    return autotune.shape_key(n, n, backend, n if shm_links is None else shm_links, autotune.world_digest([one] * n))


def _env(tmp_path, **extra):
    # No host arena: these check the ring's small limit, the one autotune tunes (the arena's is its own).
    return {"RINGREDUCE_AUTOTUNE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"), "RINGREDUCE_ARENA_BYTES": "0",
            **extra}


def _same_on_every_rank(ranks):
    first = ranks[0].result
    for r in ranks:
        assert r.result["ok"], f"rank {r.rank}: wrong allreduce with tuned values"
        assert (r.result["seg"], r.result["small"], r.result["limit"]) == \
            (first["seg"], first["small"], first["limit"]), f"rank {r.rank} disagrees with rank 0"
    return first


@pytest.mark.parametrize("n", [2, 3])
def test_calibration_picks_candidates_agreed_and_cached(tmp_path, n):
    ranks = run_ranks(n, REPORT, tmp_path, timeout=60, env=_env(tmp_path))
    first = _same_on_every_rank(ranks)
    assert first["tune"]["calibrated"]
    assert first["seg"] in autotune.SEGMENT_CANDIDATES and first["small"] in autotune.SMALL_CANDIDATES
    assert first["limit"] == Config(small_bytes=first["small"]).small_limit(n)
    files = list((tmp_path / "cache" / "ringreduce" / "autotune").glob("*.json"))
    assert [f.name for f in files] == [first["tune"]["key"] + ".json"]
    assert first["tune"]["key"] == _key(n)
    cached = json.loads(files[0].read_text())
    assert (cached["segment_bytes"], cached["small_bytes"]) == (first["seg"], first["small"])

    # a second init reads the cache: no calibration, the same values
    again = run_ranks(n, REPORT, tmp_path, timeout=60, env=_env(tmp_path))
    second = _same_on_every_rank(again)
    assert not second["tune"]["calibrated"]
    assert (second["seg"], second["small"]) == (first["seg"], first["small"])


def test_cached_values_are_used(tmp_path):
    """A cache written by hand decides: proof the read path is taken."""
    key = _key(2)
    path = tmp_path / "cache" / "ringreduce" / "autotune" / f"{key}.json"
    autotune.store(path, autotune.Choice(64 << 10, 512 << 10), key)
    ranks = run_ranks(2, REPORT, tmp_path, timeout=60, env=_env(tmp_path))
    first = _same_on_every_rank(ranks)
    assert not first["tune"]["calibrated"] and first["tune"]["key"] == key
    assert (first["seg"], first["small"], first["limit"]) == (64 << 10, 512 << 10, 512 << 10)


@pytest.mark.parametrize("junk", ["{not json", '{"version": 1, "segment_bytes": 12345, "small_bytes": 65536}',
                                  '["a list"]'])
def test_corrupt_cache_is_ignored_and_replaced(tmp_path, junk):
    key = _key(2)
    path = tmp_path / "cache" / "ringreduce" / "autotune" / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(junk)
    ranks = run_ranks(2, REPORT, tmp_path, timeout=60, env=_env(tmp_path))
    first = _same_on_every_rank(ranks)
    assert first["tune"]["calibrated"] and first["tune"]["key"] == key
    assert "ignoring" in ranks[0].stderr
    assert autotune.load_cached(path) == autotune.Choice(first["seg"], first["small"])


def test_one_slow_rank_still_agrees(tmp_path):
    """Rank 1 competes for its GIL with a busy thread through the whole
    calibration: its timings differ from rank 0's, the choice must not."""
    body = """
import threading
stop = threading.Event()
if int(os.environ["RINGREDUCE_RANK"]) == 1:
    def burn():
        while not stop.is_set():
            sum(range(2000))
    threading.Thread(target=burn, daemon=True).start()
rr.init()
stop.set()
""" + REPORT
    ranks = run_ranks(3, body, tmp_path, timeout=90, env=_env(tmp_path), init=False)
    assert _same_on_every_rank(ranks)["tune"]["calibrated"]


def test_autotune_off_leaves_defaults(tmp_path):
    ranks = run_ranks(2, REPORT, tmp_path, timeout=60, env=_env(tmp_path, RINGREDUCE_AUTOTUNE="0"))
    first = _same_on_every_rank(ranks)
    d = Config()
    assert first["tune"] is None and (first["seg"], first["small"]) == (d.segment_bytes, d.small_bytes)
    assert first["limit"] == d.small_limit(2)
    assert not (tmp_path / "cache" / "ringreduce").exists()


def test_explicit_variables_are_kept(tmp_path):
    ranks = run_ranks(2, REPORT, tmp_path, timeout=60,
                      env=_env(tmp_path, RINGREDUCE_SEGMENT_BYTES="100000", RINGREDUCE_SMALL_BYTES="4096"))
    first = _same_on_every_rank(ranks)
    assert (first["seg"], first["small"], first["limit"]) == (100000, 4096, 4096)


def test_bad_autotune_value_is_refused(tmp_path):
    ranks = run_ranks(1, "", tmp_path, timeout=30, env=_env(tmp_path, RINGREDUCE_AUTOTUNE="yes"), check=False)
    assert ranks[0].returncode != 0 and "RINGREDUCE_AUTOTUNE='yes'" in ranks[0].stderr


def test_choice_rules():
    # segment: least sum of times relative to the best at each size
    times = np.array([[1.0, 10.0], [1.1, 8.0], [2.0, 7.9]])
    assert autotune.best_segment(times) == 1
    # small: the limit whose rule costs least; the small path wins up to index 2
    small = np.array([1.0, 2.0, 3.0, 9.0, 20.0])
    ring = np.array([5.0, 5.0, 5.0, 6.0, 7.0])
    assert autotune.best_small(small, ring) == 2
    assert autotune.best_small(np.full(5, 9.0), ring) == 0  # never better: the least limit
    # the default stays unless beaten by more than MARGIN
    assert autotune.best_segment(np.array([[1.0, 1.0], [1.03, 1.03]]), prefer=1) == 1
    assert autotune.best_segment(np.array([[1.0, 1.0], [1.2, 1.2]]), prefer=1) == 0
    assert autotune.best_small(small, ring, prefer=3) == 2  # costs 19 vs 22: more than 5% better
    assert autotune.best_small(small, np.full(5, 3.05), prefer=1) == 1  # 12.15 vs 12.1: within 5%
    assert autotune.best_small(small, np.full(5, 3.05)) == 2


def test_engine_tunes_fusion_from_its_cycles(tmp_path):
    body = """
from ringreduce import engine as _e
eng = _e.engine()
tuner = eng._fusion_tuner
seen = set()
rng = np.random.default_rng(rr.rank())
ok = True
for step in range(len(tuner.candidates) * tuner.window + 5):
    seen.add(eng.fusion_bytes)
    grads = [rng.standard_normal(n).astype(np.float32) for n in (1000, 250000, 7)]
    hs = [eng.enqueue(f"g{i}", g, op="sum") for i, g in enumerate(grads)]
    outs = [eng.wait(h) for h in hs]
    all_grads = rr.allgather(np.concatenate(grads)[None])
    ok = ok and np.allclose(np.concatenate(outs), all_grads.sum(axis=0), rtol=1e-5, atol=1e-4)
result = dict(chosen=tuner.chosen, scores=tuner.scores, seen=sorted(seen), final=eng.fusion_bytes, ok=ok)
"""
    ranks = run_ranks(2, body, tmp_path, timeout=90, env=_env(tmp_path))
    first = ranks[0].result
    assert all(r.result["ok"] for r in ranks)
    assert first["chosen"] in autotune.FUSION_CANDIDATES and first["final"] == first["chosen"]
    assert first["seen"] == sorted(autotune.FUSION_CANDIDATES)  # every candidate was tried
    assert len(first["scores"]) == len(autotune.FUSION_CANDIDATES)
    for r in ranks:
        assert (r.result["chosen"], r.result["scores"]) == (first["chosen"], first["scores"])


MPI_JOB = """
import pickle, sys
import numpy as np, ringreduce as rr
from ringreduce.core import collectives as _c
rr.init(backend="mpi")
x = np.arange(300001, dtype=np.float32) + rr.rank()
ok = bool(np.allclose(rr.allreduce(x), sum(np.arange(300001, dtype=np.float64) + r for r in range(rr.size()))))
with open(f"{sys.argv[1]}.rank{rr.rank()}.pkl", "wb") as f:
    pickle.dump(dict(tune=_c.communicator().world.extra.get("autotune"), limit=_c.communicator().ring.small_limit, ok=ok), f)
"""


def test_over_mpi_calibrates_then_reads_the_cache(tmp_path):
    import pickle
    import subprocess
    import sys

    from test_mpi import MPIRUN, _missing
    if _missing():
        pytest.skip(_missing())
    script = tmp_path / "job.py"
    script.write_text(MPI_JOB)
    env = {**os.environ, **_env(tmp_path)}
    runs = []
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        proc = subprocess.run([MPIRUN, "-np", "3", sys.executable, str(script), str(out)], capture_output=True,
                              text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append([pickle.loads(Path(f"{out}.rank{r}.pkl").read_bytes()) for r in range(3)])
    for results, calibrated in zip(runs, (True, False)):
        assert all(r["ok"] for r in results)
        same = [(r["tune"]["segment_bytes"], r["tune"]["small_bytes"], r["tune"]["calibrated"], r["limit"])
                for r in results]
        assert same == [same[0]] * 3, "ranks disagree"  # the seconds are each rank's own
        assert results[0]["tune"]["calibrated"] is calibrated and results[0]["tune"]["key"] == _key(3, "mpi", 0)
    assert runs[1][0]["tune"]["small_bytes"] == runs[0][0]["tune"]["small_bytes"]


def test_process_sets_made_later_use_the_tuned_values(tmp_path):
    key = _key(3)
    autotune.store(tmp_path / "cache" / "ringreduce" / "autotune" / f"{key}.json",
                   autotune.Choice(64 << 10, 512 << 10), key)
    body = """
from ringreduce.core import collectives as _c
pair = rr.add_process_set([0, 2])
x = np.arange(200003, dtype=np.float32) * (rr.rank() + 1)
got = rr.allreduce(x, process_set=pair) if rr.rank() in (0, 2) else None
limit = _c.communicator().sets[pair.process_set_id].small_limit if rr.rank() in (0, 2) else None
result = dict(ok=got is None or bool(np.allclose(got, x / (rr.rank() + 1) * 4)), limit=limit,
              tune=_c.communicator().world.extra["autotune"])
"""
    ranks = run_ranks(3, body, tmp_path, timeout=60, env=_env(tmp_path))
    assert all(r.result["ok"] and not r.result["tune"]["calibrated"] for r in ranks)
    assert [r.result["limit"] for r in ranks] == [512 << 10, None, 512 << 10]  # 512 KiB / (2 - 1); default 128 KiB


def test_autotune_on_one_rank_only_fails_on_every_rank_not_hangs(tmp_path):
    body = """
if int(os.environ["RINGREDUCE_RANK"]) == 1:
    os.environ["RINGREDUCE_AUTOTUNE"] = "1"
try:
    rr.init()
    rr.allreduce(np.ones(4))
    result = "ok"
except Exception as e:
    result = (type(e).__name__, str(e))
"""
    ranks = run_ranks(2, body, tmp_path, timeout=60, env={"XDG_CACHE_HOME": str(tmp_path)}, init=False)
    assert [r.result[0] for r in ranks] == ["MismatchError", "MismatchError"]
    for r in ranks:  # the message names the setting at fault and the rank that has it, not a dtype
        assert "RINGREDUCE_AUTOTUNE=1 on rank(s) 1 only" in r.result[1], r.result[1]


@pytest.mark.parametrize("who", ["0", "1"])
def test_a_fusion_threshold_set_on_one_rank_only_does_not_split_the_tuning(tmp_path, who):
    # rank 0 speaks for all (as for the segment and the small limit): rank 1's variable must
    # not leave it out of the tuner's window allreduces while rank 0 runs them
    body = """
if os.environ["RINGREDUCE_RANK"] == "WHO":
    os.environ["RINGREDUCE_FUSION_THRESHOLD"] = str(8 << 20)
rr.init()
from ringreduce import engine as _e
eng = _e.engine()
ok = True
for step in range(45):
    grads = [np.full(n, rr.rank() + 1.0, np.float32) for n in (1000, 250000, 7)]
    outs = [eng.wait(eng.enqueue(f"g{i}", g, op="sum")) for i, g in enumerate(grads)]
    ok = ok and all(np.all(o == 3.0) for o in outs)
result = dict(ok=ok, tuning=eng._fusion_tuner is not None, fusion=eng.fusion_bytes)
"""
    ranks = run_ranks(2, body.replace("WHO", who), tmp_path, timeout=90, env=_env(tmp_path), init=False)
    assert all(r.result["ok"] for r in ranks)
    assert [r.result["tuning"] for r in ranks] == [who == "1"] * 2  # rank 0's variable decides
    assert ranks[0].result["fusion"] == ranks[1].result["fusion"]
    if who == "0":
        assert ranks[1].result["fusion"] == 8 << 20


def test_stats_after_init_do_not_count_the_calibration(tmp_path):
    body = """
after_init = rr.stats()["bytes_sent"]
rr.allreduce(np.ones(1000, np.float32))
result = dict(after_init=after_init, after_one=rr.stats()["ring"], calibrated=_c.communicator().world.extra["autotune"]["calibrated"])
"""
    for r in run_ranks(2, "from ringreduce.core import collectives as _c\n" + body, tmp_path, timeout=60, env=_env(tmp_path)):
        assert r.result["calibrated"] and r.result["after_init"] == 0, r.result
        assert r.result["after_one"] <= 4000 + 64, r.result  # the one allreduce, not the probes' megabytes


def test_fingerprint_covers_machine_version_and_build():
    import socket
    machine, build = autotune.this_machine(), autotune.this_build()
    assert socket.gethostname() not in machine  # like machines share one cache
    assert f"{os.cpu_count()} cores" in machine
    assert len(build) == 16 and build == autotune.this_build()
    base = autotune.fingerprint(machine, "0.1.0", build)
    others = {autotune.fingerprint("Other CPU; 96 cores; aarch64", "0.1.0", build),
              autotune.fingerprint(machine, "0.2.0", build), autotune.fingerprint(machine, "0.1.0", "f" * 16)}
    assert base >= 0 and len(others) == 3 and base not in others
    # every rank counts, in rank order: one unlike rank changes the world's digest
    assert autotune.world_digest([base, base]) != autotune.world_digest([base, min(others)])


# Patched before init on the named ranks: what a cache copied to another machine, or kept
# across an upgrade or a rebuild, would meet.
CHANGES = {
    "machine": "autotune.this_machine = lambda: 'Other CPU; 96 cores; aarch64'",
    "version": "import ringreduce.version; ringreduce.version.__version__ = '9.9.9'",
    "build": "autotune.this_build = lambda: 'f' * 16",
}


@pytest.mark.parametrize("change, on_ranks", [("machine", (1,)), ("version", (0, 1)), ("build", (0, 1))])
def test_a_changed_machine_version_or_build_recalibrates(tmp_path, change, on_ranks):
    key = _key(2)
    path = tmp_path / "cache" / "ringreduce" / "autotune" / f"{key}.json"
    autotune.store(path, autotune.Choice(64 << 10, 512 << 10), key)  # what this machine and build cached
    body = f"""
from ringreduce.core import autotune
if int(os.environ["RINGREDUCE_RANK"]) in {on_ranks!r}:
    {CHANGES[change]}
rr.init()
""" + REPORT
    ranks = run_ranks(2, body, tmp_path, timeout=60, env=_env(tmp_path), init=False)
    first = _same_on_every_rank(ranks)
    assert first["tune"]["calibrated"], "the cache of another machine, version or build was reused"
    assert first["tune"]["key"] != key and all(r.result["tune"]["key"] == first["tune"]["key"] for r in ranks)
    written = json.loads((path.parent / f"{first['tune']['key']}.json").read_text())
    assert written["ringreduce"] == ("9.9.9" if change == "version" else ringreduce.__version__)
    assert autotune.load_cached(path) == autotune.Choice(64 << 10, 512 << 10)  # the other one is left alone


def test_rules_for_a_fresh_recheck():
    assert autotune.still_beats(np.array([1.0, 5.0, 1.2]), 0, 2)       # 1.0 vs 1.2: by more than MARGIN
    assert not autotune.still_beats(np.array([1.0, 5.0, 1.04]), 0, 2)  # within MARGIN: the default stays
    assert list(autotune.small_costs(np.array([1.0, 9.0]), np.array([5.0, 5.0]))) == [6.0, 10.0]


# The probes' timings scripted (the real ones are load noise here): the first table
# says 64 KiB segments and a 32 KiB small limit beat the defaults by far; the fresh
# recheck of just those against the defaults either agrees or finds them equal.
RECHECK = """
from ringreduce.core import autotune, collectives as _c
from ringreduce.core.config import Config
seg_n, small_n, per = len(autotune.SEGMENT_CANDIDATES), len(autotune.SMALL_CANDIDATES), len(autotune.SEGMENT_PROBES)
first = np.concatenate([np.repeat([0.5] + [1.0] * (seg_n - 1), per), np.tile([9.0, 5.0], small_n)])
agrees = np.concatenate([[0.5] * per + [1.0] * per, np.tile([9.0, 5.0], small_n)])
equal = np.ones(2 * per + 2 * small_n)
seen = []
def scripted(tables):
    def fake(ring, probes, segment, arrays):
        seen.append(len(probes))
        out = tables.pop(0)
        assert len(out) == len(probes)
        return out
    return fake
d = Config()
result = {}
for name, tables, recheck in [("noise", [first, equal], True), ("real", [first, agrees], True),
                              ("no recheck", [first], False)]:
    autotune.time_probes = scripted(list(tables))
    c = autotune.calibrate(_c.communicator().ring, rr.size(), autotune.SEGMENT_CANDIDATES, autotune.SMALL_CANDIDATES,
                           d.segment_bytes, d.small_bytes, recheck=recheck)
    result[name] = (c.segment_bytes, c.small_bytes)
result["calls"] = seen
"""


def test_a_change_of_default_must_win_again_in_fresh_rounds(tmp_path):
    d = Config()
    ranks = run_ranks(2, RECHECK, tmp_path, timeout=60)
    for r in ranks:
        assert r.result["noise"] == (d.segment_bytes, d.small_bytes), r.result  # a lucky first round only
        assert r.result["real"] == (64 << 10, 32 << 10), r.result
        assert r.result["no recheck"] == (64 << 10, 32 << 10), r.result  # what the old calibration kept
        n_probes = len(autotune.SEGMENT_CANDIDATES) * len(autotune.SEGMENT_PROBES) + 2 * len(autotune.SMALL_CANDIDATES)
        fresh = 2 * len(autotune.SEGMENT_PROBES) + 2 * len(autotune.SMALL_CANDIDATES)
        assert r.result["calls"] == [n_probes, fresh, n_probes, fresh, n_probes]
