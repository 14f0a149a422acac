"""The straggler report: which rank the others wait for, from the engine's
negotiation (ringreduce/engine/stragglers.py): its numbers, the warning,
the timeline's counter, ringrun's summary, and the settings' checks."""
import json
import os
import subprocess
import sys

import pytest

from ranks import REPO, run_ranks
from ringreduce.engine import stragglers as S

# Every rank computes for COMPUTE seconds a step, the slow one EXTRA more, then
# reduces one tensor through the engine (a training loop's shape, TF-free).
STEP_JOB = """
import time
from ringreduce import engine as E
slow, extra, steps = int(os.environ["SLOW"]), float(os.environ["EXTRA"]), int(os.environ["STEPS"])
eng = E.engine()
x = np.ones(256, np.float32)
for step in range(steps):
    time.sleep(0.03 + (extra if rr.rank() == slow else 0.0))
    assert eng.wait(eng.enqueue("grad", x, op="sum"))[0] == rr.size()
result = rr.straggler_report()
"""

WINDOW = 20


def step_env(slow, extra, **more):
    return {"SLOW": str(slow), "EXTRA": str(extra), "STEPS": str(WINDOW + 8),
            "RINGREDUCE_STRAGGLER_WINDOW": str(WINDOW), **more}


def by_rank(report):
    return {x["rank"]: x for x in report["ranks"]}


def warnings_in(text, rank):
    return [line for line in text.splitlines() if f"rank {rank} is a straggler" in line]


@pytest.mark.parametrize("n, slow", [(3, 2), (4, 1)])
def test_the_slow_rank_is_named_scored_lower_warned_about_and_counted_in_the_timeline(tmp_path, n, slow):
    trace = tmp_path / "trace.json"
    ranks = run_ranks(n, STEP_JOB, tmp_path, env=step_env(slow, 0.06, RINGREDUCE_TIMELINE=str(trace)), timeout=120)
    report = ranks[0].result
    # every rank computes the same numbers from the same messages
    assert all(r.result == report for r in ranks), [r.result for r in ranks]
    assert report["cycles"] == WINDOW and report["stragglers"] == [slow], report
    lines = by_rank(report)
    others = [r for r in range(n) if r != slow]
    assert lines[slow]["last_fraction"] >= 0.8, report
    assert 0.03 <= lines[slow]["median_lateness"] <= lines[slow]["p90_lateness"], report
    # 30 ms of compute against 90: a third of the fastest's pace (loose: the machine is loaded)
    assert lines[slow]["score"] < 0.6 and all(lines[r]["score"] > lines[slow]["score"] + 0.2 for r in others), report
    assert max(lines[r]["score"] for r in others) == 1.0, "the fastest rank scores 1"
    # rank 0 warns, once (rate-limited though the rank stays late for several cycles); the others never
    assert len(warnings_in(ranks[0].stderr, slow)) == 1, ranks[0].stderr
    assert "ms" in warnings_in(ranks[0].stderr, slow)[0]
    assert not any(warnings_in(r.stderr, slow) for r in ranks[1:])
    assert "not a ringreduce setting" not in ranks[0].stderr, "the settings are known names, no typos"
    events = json.loads(trace.read_text())
    counters = [e["args"] for e in events if e.get("name") == "lateness (ms)"]
    assert len(counters) >= WINDOW, len(counters)
    assert sum(c[f"rank {slow}"] > max(c[f"rank {r}"] for r in others) for c in counters) >= 0.8 * len(counters)


def test_ranks_that_keep_the_same_pace_have_no_straggler(tmp_path):
    ranks = run_ranks(3, STEP_JOB, tmp_path, env=step_env(-1, 0.0), timeout=120)
    report = ranks[0].result
    assert report["cycles"] == WINDOW and report["stragglers"] == [], report
    assert all(x["score"] > 0.5 for x in report["ranks"]), report
    assert not any(warnings_in(r.stderr, n) for r in ranks for n in range(3))


# Each step hands four tensors over as "backprop" produces them (the TF
# layer's overlap), then waits for all four; the slow rank's layers take 1.5x.
LAYERED_JOB = """
import time
from ringreduce import engine as E
eng = E.engine()
for step in range(28):
    handles = []
    for layer in range(4):
        time.sleep(0.015 if rr.rank() == 1 else 0.01)
        handles.append(eng.enqueue(f"layer{layer}", np.ones(64, np.float32), op="sum"))
    for h in handles:
        eng.wait(h)
result = rr.straggler_report()
"""


def test_a_rank_slower_by_half_with_gradients_handed_over_during_backprop_scores_two_thirds(tmp_path):
    # Busy time is the time a rank is not blocked waiting for results: 40 ms a step against 60, 0.67,
    # however the hand-overs spread over the step (the others' earlier offers are no waiting of theirs).
    ranks = run_ranks(3, LAYERED_JOB, tmp_path, env={"RINGREDUCE_STRAGGLER_WINDOW": "40"}, timeout=120)
    report = ranks[0].result
    lines = by_rank(report)
    assert report["cycles"] == 40, report
    assert 0.5 < lines[1]["score"] < 0.85 and min(lines[0]["score"], lines[2]["score"]) > 0.9, report
    assert lines[1]["last_fraction"] >= 0.8 and lines[1]["median_lateness"] > 0.003, report
    assert report["stragglers"] == [], "1.5x slower is no straggler at the default threshold 0.5"


def test_the_score_is_the_fastest_ranks_busy_time_over_this_ranks():
    # Period 0.2 s: ranks 0 and 1 offered 0.1 s before the pass ended and
    # then waited for the result, rank 2 just before it: rank 2 was 0.1 s
    # late, busy the whole period, the others half of it: twice as slow.
    tracker = S.Tracker(S.Settings(window=2, threshold=S.Threshold.parse("0.6")))
    for _ in range(2):
        lateness = tracker.observe([(0.1, 0.2, 0.1), (0.1, 0.19, 0.09), (0.0, 0.21, 0.01)], me=1)
        assert lateness == pytest.approx({0: 0.0, 1: 0.0, 2: 0.1})
    lines = by_rank(tracker.report())
    assert lines[2]["score"] == pytest.approx(0.5) and lines[0]["score"] == lines[1]["score"] == 1.0
    assert lines[2]["last_fraction"] == 1.0 and lines[0]["last_fraction"] == 0.0
    assert tracker.report()["stragglers"] == [2]
    # lateness counts from the first offer, however long ago; a rank with no report is not compared
    assert tracker.observe([(0.5, 0.2, 0.15), None, (0.05, 0.2, 0.0)], me=1) == pytest.approx({0: 0.0, 2: 0.45})
    # but the busy time is each period's: rank 0 waited 0.15 s of this period's 0.2, busy 0.05 s; over the window (this cycle and the one before) busy on average 0.075 s, rank 1 0.1 s
    # (the cycle before only), rank 2 0.2 s
    lines = by_rank(tracker.report())
    assert [lines[r]["score"] for r in range(3)] == pytest.approx([1.0, 0.75, 0.375])
    assert lines[1]["cycles"] == 1 and lines[0]["cycles"] == lines[2]["cycles"] == 2
    assert tracker.observe([(0.1, None, None), (0.0, None, None)], me=1) is None, "no period: the first cycle"


def test_ranks_that_spend_their_cycles_waiting_are_no_stragglers_of_each_other():
    """A tight loop of collectives: every rank is blocked nearly the whole
    period, busy for microseconds (rank 0 for none at all). Such busy times
    are overhead and noise, not pace: no rank scores below 1, none is named."""
    tracker = S.Tracker(S.Settings(window=2, threshold=S.Threshold.parse("0.5")))
    for _ in range(2):
        tracker.observe([(0.0001, 0.0002, 0.0002), (0.0001, 0.0002, 0.00018), (0.0001, 0.0002, 0.00015)], me=0)
    report = tracker.report()
    assert [x["score"] for x in report["ranks"]] == [1.0, 1.0, 1.0]
    assert report["stragglers"] == []
    # a rank busy for real against one that is never busy: compared from the floor, not divided by zero
    tracker.observe([(0.01, 0.1, 0.1), (0.0, 0.1, 0.0), (0.01, 0.1, 0.1)], me=0)
    tracker.observe([(0.01, 0.1, 0.1), (0.0, 0.1, 0.0), (0.01, 0.1, 0.1)], me=0)
    lines = by_rank(tracker.report())
    assert lines[0]["score"] == lines[2]["score"] == 1.0
    assert lines[1]["score"] == pytest.approx(S.MIN_BUSY / 0.1)


@pytest.mark.parametrize("period, blocked", [(7200.0, 7140.0), (7200.0, 600.0), (5000.0, 0.0), (100.0, 40.0)])
def test_a_cycle_longer_than_the_wire_holds_keeps_its_busy_time(period, blocked):
    """Microseconds in 32 bits end at about 71 minutes: a longer cycle (an
    evaluation between two steps) is sent as the longest, its busy time intact
    up to that longest, not as the difference of two clipped numbers."""
    age, got_period, got_blocked = S.decode(S.encode((1.0, period, blocked)), 0)
    assert age == 1.0 and got_period <= 4294.967294
    assert got_period - got_blocked == pytest.approx(min(period - blocked, 4294.967294), abs=2e-6)


def test_rank_0_warns_once_a_window_is_full_and_then_not_again_for_a_minute(caplog, monkeypatch):
    tracker = S.Tracker(S.Settings(window=10, threshold=S.Threshold.parse("50ms")))
    late = [(0.2, 0.3, 0.1)] * 3 + [(0.1, 0.3, 0.0)]  # rank 3 offers 100 ms after the others, who wait
    with caplog.at_level("WARNING", logger="ringreduce"):
        for _ in range(9):
            tracker.observe(late, me=0)
        assert not caplog.records, "the window is not full yet"
        for _ in range(30):
            tracker.observe(late, me=0)
        assert [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()] == [
            "ringreduce: rank 3 is a straggler: the others waited 100 ms for it on median (p90 100 ms) over the "
            "last 10 engine cycles, it arrived last in 100% of them; score 0.67 (RINGREDUCE_STRAGGLER_THRESHOLD=50ms)"]
        later = S._now() + S.WARN_EVERY
        monkeypatch.setattr(S, "_now", lambda: later)
        for _ in range(10):
            tracker.observe(late, me=0)
        assert len(caplog.records) == 2, "a minute later, still late: named again"
        other = S.Tracker(S.Settings(window=10, threshold=S.Threshold.parse("50ms")))
        for _ in range(20):
            other.observe(late, me=1)
        assert len(caplog.records) == 2, "only rank 0 warns"


@pytest.mark.parametrize("value", ["abc", "0", "1", "1.5", "-0.5", "nan", "inf", "-3ms", "0s", "2x", "1e999s"])
def test_a_threshold_that_makes_no_sense_raises_naming_the_variable(value):
    with pytest.raises(ValueError, match="RINGREDUCE_STRAGGLER_THRESHOLD"):
        S.Settings.from_env({"RINGREDUCE_STRAGGLER_THRESHOLD": value})


@pytest.mark.parametrize("value", ["0", "1", "-5", "2.5", "x"])
def test_a_window_that_makes_no_sense_raises_naming_the_variable(value):
    with pytest.raises(ValueError, match="RINGREDUCE_STRAGGLER_WINDOW"):
        S.Settings.from_env({"RINGREDUCE_STRAGGLER_WINDOW": value})


def test_thresholds_as_scores_or_durations():
    assert S.Threshold.parse("0.7").score == 0.7
    assert S.Threshold.parse("150ms").seconds == pytest.approx(0.15)
    assert S.Threshold.parse(" 0.2s ").seconds == 0.2
    assert S.Threshold.parse("off") is None
    assert S.Settings.from_env({}) == S.Settings(100, S.Threshold.parse("0.5"))
    late = S.Threshold.parse("100ms")
    assert late.exceeded(score=0.9, median=0.2) and not late.exceeded(score=0.1, median=0.05)


def test_init_and_the_engine_refuse_nonsense_settings_on_every_rank(tmp_path):
    ranks = run_ranks(2, """
        from ringreduce.engine import Engine
        errors = []
        try:
            rr.init()
        except ValueError as e:
            errors.append(str(e))
        os.environ["RINGREDUCE_STRAGGLER_THRESHOLD"] = "0.5"
        rr.init()
        os.environ["RINGREDUCE_STRAGGLER_WINDOW"] = "1"  # set after init: the engine checks it when it starts
        try:
            Engine()
        except ValueError as e:
            errors.append(str(e))
        result = errors
    """, tmp_path, env={"RINGREDUCE_STRAGGLER_THRESHOLD": "fast"}, init=False, timeout=60)
    for r in ranks:
        assert len(r.result) == 2, r.result
        assert "RINGREDUCE_STRAGGLER_THRESHOLD='fast' makes no sense" in r.result[0], r.result
        assert "RINGREDUCE_STRAGGLER_WINDOW=1 makes no sense" in r.result[1], r.result


def test_rank_0s_engine_writes_its_report_when_it_shuts_down(tmp_path):
    ranks = run_ranks(2, """
        from ringreduce.engine import Engine
        mine = os.path.join(os.environ["BASE"], f"rank{rr.rank()}")
        os.makedirs(mine)
        os.environ["RINGREDUCE_REPORT_DIR"] = mine
        eng = Engine()
        for step in range(5):
            eng.wait(eng.enqueue("g", np.ones(4)))
        before = os.listdir(mine)
        eng.shutdown()
        result = (before, os.listdir(mine))
    """, tmp_path, env={"BASE": str(tmp_path)}, timeout=60)
    assert ranks[0].result == ([], ["stragglers.json"]) and ranks[1].result == ([], [])
    report = json.loads((tmp_path / "rank0" / "stragglers.json").read_text())
    assert report["cycles"] == 3 and [x["rank"] for x in report["ranks"]] == [0, 1], report  # 5 steps: the
    # first cycle has no period, the last one's report never went out


def test_ringrun_prints_who_straggled_from_rank_0s_report(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import numpy as np, os\nimport ringreduce as rr\nrr.init()\nresult = None\n"
                      + STEP_JOB + "rr.shutdown()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RINGREDUCE_REPORT_DIR": str(tmp_path), **step_env(1, 0.06)}
    env.pop("RINGREDUCE_SECRET", None)
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "3", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    summary = [line for line in out.stderr.splitlines() if line.startswith("ringrun: straggler")]
    assert len(summary) == 1, out.stderr
    assert "rank 1 arrived last in" in summary[0] and "late on median" in summary[0], summary
    report = json.loads((tmp_path / "stragglers.json").read_text())
    assert report["stragglers"] == [1], report


def test_ringrun_says_there_was_no_straggler_when_the_ranks_keep_pace(tmp_path):
    # no RINGREDUCE_REPORT_DIR: ringrun makes one (under TMPDIR), prints its summary of the
    # report and, the job having ended well, leaves nothing behind
    script = tmp_path / "job.py"
    script.write_text("import numpy as np, os\nimport ringreduce as rr\nrr.init()\nresult = None\n" + STEP_JOB)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path), **step_env(-1, 0.0)}
    env.pop("RINGREDUCE_SECRET", None)
    env.pop("RINGREDUCE_REPORT_DIR", None)
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "3", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "ringrun: no straggler (over the last 20 engine cycles" in out.stderr, out.stderr
    assert "ringrun: straggler" not in out.stderr
    assert not list(tmp_path.glob("ringrun-*")), "a good job's report dir of ringrun's own is removed"


def test_ringrun_removes_the_report_dir_it_made_when_no_rank_left_a_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    env.pop("RINGREDUCE_SECRET", None)
    env.pop("RINGREDUCE_REPORT_DIR", None)
    code = "import os; d = os.environ['RINGREDUCE_REPORT_DIR']; print(os.path.isdir(d), d)"
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    seen = {line.split()[-1] for line in out.stdout.splitlines() if " True " in line}
    assert len(seen) == 1 and seen.pop().startswith(str(tmp_path / "ringrun-")), out.stdout
    assert not list(tmp_path.glob("ringrun-*")), "an empty report dir of ringrun's own is removed"
    assert "straggler" not in out.stderr, "no engine ran: no summary"


def test_ranks_with_different_straggler_settings_agree_on_every_result(tmp_path):
    """The settings are each rank's own (its window, its threshold): the arrival
    reports they send are the same 12 bytes whatever they are, so negotiation
    and every result stay the same on every rank, and each report keeps its
    rank's own window."""
    ranks = run_ranks(3, """
        window, threshold = ["2", "5", "50"][int(os.environ["RINGREDUCE_RANK"])], ["off", "0.9", "10ms"][int(os.environ["RINGREDUCE_RANK"])]
        os.environ["RINGREDUCE_STRAGGLER_WINDOW"], os.environ["RINGREDUCE_STRAGGLER_THRESHOLD"] = window, threshold
        rr.init()
        from ringreduce.engine import engine
        out = []
        for i in range(12):
            h = engine().enqueue(f"t{i}", np.arange(5, dtype=np.float64) * (rr.rank() + 1) + i / 3, op="sum")
            out.append(engine().wait(h).tobytes().hex())
        report = rr.straggler_report()
        result = dict(out=out, window=report["window"], threshold=report["threshold"], cycles=report["cycles"])
    """, tmp_path, init=False, timeout=120)
    assert ranks[0].result["out"] == ranks[1].result["out"] == ranks[2].result["out"]
    assert [r.result["window"] for r in ranks] == [2, 5, 50]
    assert [r.result["threshold"] for r in ranks] == ["off", "0.9", "10ms"]
    assert ranks[0].result["cycles"] == 2 and ranks[1].result["cycles"] == 5 and ranks[2].result["cycles"] >= 10
