"""ringrun's verdict on a failed job: which rank is where, from the ranks'
flight recorder dumps. The verdict logic on hand-made dumps of each hang
shape, then each shape for real under ringrun (a short RINGREDUCE_TIMEOUT),
once with a CPU hog beside the job, and `ringrun --postmortem DIR`."""
import json
import os
import subprocess
import sys
import textwrap

from ranks import REPO
from ringreduce.launch.verdict import position, ranks_text, verdict

# -- the verdict on hand-made dumps --------------------------------------------

_ids = iter(range(1, 1 << 30))


def entry(kind="allreduce", seq=1, name=None, state="done", ps=0, t=1.0, error=None, enqueued_only=False):
    return {"id": next(_ids), "seq": None if enqueued_only else seq, "name": name, "kind": kind, "bytes": 16,
            "dtype": "float32", "op": "sum", "process_set": ps, "generation": 0, "step": None, "state": state,
            "error": error, "t_enqueue": t if enqueued_only else None, "t_start": None if enqueued_only else t,
            "t_end": None if state in ("started", "enqueued") else t + 0.5}


def dump(rank, size, *entries, sets=None):
    return {"format": 1, "rank": rank, "size": size, "entries": list(entries), "process_sets": sets or {}}


def history(n, name="grad/dense_0"):
    return [entry(seq=i, name=name, t=float(i)) for i in range(1, n + 1)]


LOST = "PeerLostError: lost rank 3: no progress for 2.0 s (RINGREDUCE_TIMEOUT)"


def test_ranks_are_named_in_ranges():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"


def test_a_rank_that_never_started_the_collective_the_others_wait_in():
    waiting = entry(seq=1024, name="grad/dense_1", state="failed", t=2000.0, error=LOST)
    dumps = {r: dump(r, 4, *history(1023), dict(waiting)) for r in range(3)}
    dumps[3] = dump(3, 4, *history(1023))
    assert verdict(dumps) == ("rank 3 never started allreduce 'grad/dense_1' #1024 (its last was allreduce "
                              "'grad/dense_0' #1023); ranks 0-2 are waiting in it (" + LOST + ")")


def test_a_rank_that_left_no_dump_is_named_as_such():
    waiting = entry(seq=9, state="started", t=10.0)
    dumps = {r: dump(r, 3, *history(8), dict(waiting)) for r in (0, 2)}
    text = verdict(dumps, size=3)
    assert text.startswith("rank 1 wrote no flight record") and "ranks 0, 2 are waiting in allreduce #9" in text


def test_a_rank_in_another_collective():
    dumps = {r: dump(r, 4, *history(6), entry(seq=7, state="failed", t=9.0, error="MismatchError: kinds"))
             for r in (0, 2, 3)}
    dumps[1] = dump(1, 4, *history(6), entry("broadcast", seq=7, state="failed", t=9.0))
    assert verdict(dumps) == "rank 1 is in broadcast #7 while the others are in allreduce #7"


def test_a_rank_in_another_process_set():
    sets = {"1": [1, 2]}
    dumps = {r: dump(r, 3, *history(4), entry(seq=5, state="started", t=9.0), sets=sets) for r in (0, 1)}
    dumps[2] = dump(2, 3, *history(4), entry(seq=1, ps=1, state="started", t=9.0), sets=sets)
    assert verdict(dumps) == ("rank 2 is in allreduce #1 of process set 1 (ranks 1, 2) while the others are in "
                              "allreduce #5 of the world")


def test_non_members_of_a_set_are_not_waited_for():
    sets = {"1": [0, 1]}
    failed = entry(seq=3, ps=1, state="failed", t=9.0, error="RingReduceError: boom")
    dumps = {0: dump(0, 3, dict(failed), sets=sets), 1: dump(1, 3, dict(failed), sets=sets),
             2: dump(2, 3, *history(2), sets=sets)}
    assert verdict(dumps) == "ranks 0, 1 failed in allreduce #3 of process set 1 (ranks 0, 1): RingReduceError: boom"


def test_every_rank_failing_in_the_same_collective_says_how():
    bad = entry(seq=2, state="failed", t=3.0, error="MismatchError: ranks disagree on the dtype\nmore")
    assert verdict({r: dump(r, 2, dict(bad)) for r in range(2)}) == (
        "every rank failed in allreduce #2: MismatchError: ranks disagree on the dtype")


def test_an_engine_request_never_enqueued_on_one_rank():
    waiting = entry(name="grad/a", state="failed", t=5.0, error=LOST, enqueued_only=True)
    dumps = {r: dump(r, 3, *history(3, "grad/b"), dict(waiting)) for r in (0, 2)}
    dumps[1] = dump(1, 3, *history(3, "grad/b"))
    assert verdict(dumps).startswith("rank 1 never enqueued allreduce 'grad/a' (in the engine, not yet agreed)")


def test_a_failure_the_rank_went_past_is_not_where_it_is():
    caught = entry(seq=1, state="failed", t=1.0, error="MismatchError: caught by the program")
    later = entry(seq=2, state="started", t=5.0)
    assert position(dump(0, 1, caught, later)) is later
    assert position(dump(0, 1, caught, entry(seq=2, t=5.0))) is None


def test_no_rank_in_a_collective_says_the_failure_was_elsewhere():
    dumps = {r: dump(r, 2, *history(3)) for r in range(2)}
    assert verdict(dumps).startswith("no rank was inside a collective")
    assert verdict({}) is None


# -- for real, under ringrun ---------------------------------------------------

def ringrun(*args, timeout=120, env=None):
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full.pop("RINGREDUCE_SECRET", None)
    return subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True,
                          text=True, timeout=timeout, env=full)


def run_job(tmp_path, np_, code, env=None):
    script = tmp_path / "job.py"
    script.write_text("import time\nimport numpy as np\nimport ringreduce as rr\nrr.init()\n"
                      "x = np.ones(1000, np.float32)\n" + textwrap.dedent(code))
    report = tmp_path / "report"
    out = ringrun("-np", str(np_), "--timeout", "3", sys.executable, str(script),
                  env={"RINGREDUCE_REPORT_DIR": str(report), **(env or {})})
    lines = [line for line in out.stderr.splitlines() if line.startswith("ringrun: ")]
    return out, lines, report


NEVER_ARRIVES = """
for i in range(4):
    rr.allreduce(x, name="grad/dense_0")
if rr.rank() == 2:
    time.sleep(100)  # never arrives
rr.allreduce(x, name="grad/dense_1")
"""


def test_job_where_a_rank_never_arrives(tmp_path):
    out, lines, report = run_job(tmp_path, 4, NEVER_ARRIVES)
    assert out.returncode == 1, out.stderr
    assert ("ringrun: rank 2 never started allreduce 'grad/dense_1' #5 (its last was allreduce 'grad/dense_0' #4);"
            " ranks 0, 1, 3 are waiting in it") in lines[-2 if "kept" in lines[-1] else -1], out.stderr
    assert sorted(os.listdir(report)) == [f"flight_rank{r}.json" for r in range(4)], "markers removed, dumps kept"
    dumped = json.loads((report / "flight_rank2.json").read_text())
    assert dumped["reason"] == "SIGUSR1" and dumped["rank"] == 2, "the sleeping rank was asked by ringrun"
    waiter = json.loads((report / "flight_rank0.json").read_text())  # written when its C call timed out
    assert waiter["reason"].startswith("PeerLostError") and waiter["entries"][-1]["state"] == "failed"
    assert waiter["entries"][-1]["name"] == "grad/dense_1" and "rank 2" in waiter["entries"][-1]["error"]


def test_job_where_a_rank_never_arrives_beside_a_cpu_hog(tmp_path):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out, lines, _ = run_job(tmp_path, 3, NEVER_ARRIVES)
    finally:
        hog.kill()
        hog.wait()
    assert out.returncode == 1, out.stderr
    assert any(line.startswith("ringrun: rank 2 never started allreduce 'grad/dense_1' #5") for line in lines), \
        out.stderr


def test_job_where_ranks_are_in_different_collectives(tmp_path):
    out, lines, _ = run_job(tmp_path, 3, """
    for i in range(6):
        rr.allreduce(x, name="w")
        rr.broadcast(x, root=0, name="b")
    if rr.rank() == 1:
        rr.broadcast(x, root=0, name="b")
    else:
        rr.allreduce(x, name="w")
    """)
    assert out.returncode == 1, out.stderr
    assert "ringrun: rank 1 is in broadcast 'b' #7 while the others are in allreduce 'w' #7" in lines, out.stderr


def test_job_where_a_rank_is_in_another_process_set(tmp_path):
    out, lines, _ = run_job(tmp_path, 3, """
    pairs = rr.add_process_set([1, 2])
    for i in range(3):
        rr.allreduce(x)
    if rr.rank() == 2:
        rr.allreduce(x, process_set=pairs)
    else:
        rr.allreduce(x)
    """)
    assert out.returncode == 1, out.stderr
    assert ("ringrun: rank 2 is in allreduce #1 of process set 1 (ranks 1, 2) while the others are in allreduce #4 "
            "of the world") in lines, out.stderr


def test_job_where_an_engine_request_never_comes_on_one_rank(tmp_path):
    out, lines, _ = run_job(tmp_path, 3, """
    from ringreduce.engine import engine
    e = engine()
    for i in range(3):
        e.wait(e.enqueue("grad/a", x))
        e.wait(e.enqueue("grad/b", x))
    if rr.rank() == 1:
        time.sleep(100)
    e.wait(e.enqueue("grad/a", x))
    """)
    assert out.returncode == 1, out.stderr
    assert any(line.startswith("ringrun: rank 1 never enqueued allreduce 'grad/a' (in the engine, not yet agreed)"
                               " (its last was allreduce 'grad/b' #6); ranks 0, 2 are waiting in it")
               for line in lines), out.stderr


def test_postmortem_reads_a_finished_jobs_dumps(tmp_path):
    out, lines, report = run_job(tmp_path, 3, NEVER_ARRIVES)
    assert out.returncode == 1, out.stderr
    said = next(line for line in lines if "never started" in line)
    again = ringrun("--postmortem", str(report))
    assert again.returncode == 0 and again.stdout.strip() == said, again.stderr
    module = subprocess.run([sys.executable, "-m", "ringreduce.launch.postmortem", str(report)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert module.returncode == 0 and module.stdout.strip() == said, module.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    none = ringrun("--postmortem", str(empty))
    assert none.returncode == 1 and "no flight recorder dumps" in none.stderr
    assert ringrun("--postmortem", str(empty), "-np", "2").returncode == 2


def test_a_job_that_succeeds_leaves_no_report_dir_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    env.pop("RINGREDUCE_REPORT_DIR", None)
    code = "import numpy as np, ringreduce as rr, os; rr.init(); rr.allreduce(np.ones(3)); " \
           "print(os.path.isdir(os.environ['RINGREDUCE_REPORT_DIR']))"
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("True") == 2, "every rank had its report dir"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ringrun-")], "removed: nothing was reported"


def test_a_failed_job_keeps_its_report_dir_and_says_where(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    env.pop("RINGREDUCE_REPORT_DIR", None)
    code = ("import numpy as np, ringreduce as rr; rr.init()\n"
            "rr.allreduce(np.ones(3), name='a' if rr.rank() == 0 else 'b')")
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    kept = [p for p in os.listdir(tmp_path) if p.startswith("ringrun-")]
    assert len(kept) == 1 and f"reports kept in {tmp_path / kept[0]}" in out.stderr, out.stderr
    assert "ringrun: rank 1 is in allreduce 'b' #1 while rank 0 is in allreduce 'a' #1" in out.stderr, out.stderr


def test_dumps_of_an_earlier_job_in_a_kept_report_dir_are_not_this_jobs(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    old = {"format": 1, "rank": 1, "size": 2, "wall": 1.0, "entries": [entry("broadcast", state="started")]}
    (report / "flight_rank1.json").write_text(json.dumps(old))
    code = ("import numpy as np, ringreduce as rr, time; rr.init(); rr.allreduce(np.ones(2))\n"
            "if rr.rank() == 1:\n    raise SystemExit(3)\nrr.allreduce(np.ones(2), name='late')")
    out = ringrun("-np", "2", "--timeout", "3", sys.executable, "-c", code, env={"RINGREDUCE_REPORT_DIR": str(report)})
    assert out.returncode in (1, 3), out.stderr  # rank 1's 3, or rank 0's PeerLostError when reaped first
    assert ("ringrun: rank 1 wrote no flight record (ended or unreachable before it could); rank 0 is waiting in "
            "allreduce 'late' #2") in out.stderr, out.stderr
    assert "broadcast" not in out.stderr
