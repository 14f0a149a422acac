"""How often ringreduce's diagnostics name the right rank, run after run, on a loaded machine.

    sudo python benchmarks/diagnosis_runs.py               # 10 runs of each, a CPU hog per core beside
    sudo python benchmarks/diagnosis_runs.py --runs 20 --hogs 0

Two measurements, each over `--runs` jobs, the culprit rank changing from job
to job, with `--hogs` busy-looping processes (default: one per core) beside
every job:

* **Straggler report** (ringreduce/engine/stragglers.py), on the emulated
  cluster (benchmarks/cluster.py: one network namespace per host, a 1 Gbit
  tbf link each): 4 hosts, one rank each; every step each rank computes
  30 ms (a sleep), the culprit 60 ms more, then hands a 1 MiB gradient to the
  engine. Counted right when rank 0's `rr.straggler_report()` lists exactly
  the culprit. Needs root (namespaces).
* **Hang verdict** (ringreduce/launch/verdict.py), under `ringrun -np 4
  --timeout 3` on this machine: in odd jobs the culprit never arrives at an
  allreduce the others wait in; in even jobs it enters a broadcast while the
  others enter an allreduce. Counted right when ringrun's verdict line names
  the culprit in the expected shape.

Prints one line per job and a summary: `straggler report: 10 of 10 right`.
Exits 1 if any job was wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, can_build  # noqa: E402

STEP_JOB = """
import os, sys, time, json
import numpy as np
import ringreduce as rr
from ringreduce import engine as E
rr.init()
slow = int(os.environ["SLOW"])
eng = E.engine()
x = np.ones(1 << 18, np.float32)  # 1 MiB
for step in range(int(os.environ["STEPS"])):
    time.sleep(0.03 + (0.06 if rr.rank() == slow else 0.0))
    eng.wait(eng.enqueue("grad", x, op="sum"))
report = rr.straggler_report()
if rr.rank() == 0:
    print("REPORT " + json.dumps(report), flush=True)
rr.shutdown()
"""

HANG_PRELUDE = "import time\nimport numpy as np\nimport ringreduce as rr\nrr.init()\nx = np.ones(1000, np.float32)\n"

NEVER_ARRIVES = """
for i in range(4):
    rr.allreduce(x, name="grad/dense_0")
if rr.rank() == CULPRIT:
    time.sleep(100)  # never arrives
rr.allreduce(x, name="grad/dense_1")
"""

OTHER_COLLECTIVE = """
for i in range(6):
    rr.allreduce(x, name="w")
    rr.broadcast(x, root=0, name="b")
if rr.rank() == CULPRIT:
    rr.broadcast(x, root=0, name="b")
else:
    rr.allreduce(x, name="w")
"""


def straggler_runs(runs: int, window: int) -> int:
    right = 0
    with Cluster(4, rate="1gbit") as cluster:
        for run in range(runs):
            slow = run % 4
            secret, port = secrets.token_hex(16), 29500 + run
            procs = []
            for rank in range(4):
                env = cluster.ring_env(rank, port, secret)
                env.update(SLOW=str(slow), STEPS=str(window + 8), RINGREDUCE_STRAGGLER_WINDOW=str(window),
                           PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
                procs.append(cluster.popen(rank, [sys.executable, "-c", STEP_JOB], env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=180) for p in procs]
            failed = [r for r, p in enumerate(procs) if p.returncode]
            line = next((x for x in outs[0][0].splitlines() if x.startswith("REPORT ")), None)
            named = json.loads(line[7:])["stragglers"] if line and not failed else None
            ok = named == [slow]
            right += ok
            detail = f"failed ranks {failed}: {outs[failed[0]][1][-500:]}" if failed else f"named {named}"
            print(f"straggler run {run + 1}: rank {slow} slowed, {detail}: {'right' if ok else 'WRONG'}", flush=True)
    return right


def verdict_runs(runs: int) -> int:
    right = 0
    for run in range(runs):
        culprit = 1 + run % 3
        if run % 2 == 0:
            code, expect = NEVER_ARRIVES, f"ringrun: rank {culprit} never started allreduce 'grad/dense_1' #5"
        else:
            code, expect = OTHER_COLLECTIVE, (f"ringrun: rank {culprit} is in broadcast 'b' #7 while the others "
                                              "are in allreduce 'w' #7")
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "job.py"
            script.write_text(HANG_PRELUDE + textwrap.dedent(code).replace("CULPRIT", str(culprit)))
            env = {**os.environ, "PYTHONPATH": str(REPO), "RINGREDUCE_REPORT_DIR": str(Path(tmp) / "report"),
                   "OPENBLAS_NUM_THREADS": "1"}
            env.pop("RINGREDUCE_SECRET", None)
            out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "4", "--timeout", "3",
                                  sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
        said = [x for x in out.stderr.splitlines() if x.startswith("ringrun: rank ")]
        ok = out.returncode != 0 and any(x.startswith(expect) for x in said)
        right += ok
        print(f"verdict run {run + 1}: rank {culprit} ({'never arrives' if run % 2 == 0 else 'other collective'}), "
              f"ringrun said {said[-1] if said else out.stderr[-300:]!r}: {'right' if ok else 'WRONG'}", flush=True)
    return right


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-looping processes beside the jobs")
    p.add_argument("--window", type=int, default=20, help="RINGREDUCE_STRAGGLER_WINDOW (engine cycles)")
    p.add_argument("--only", choices=["stragglers", "verdict"], default=None)
    args = p.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    results = []
    try:
        if args.only != "verdict":
            reason = can_build()
            if reason:
                raise SystemExit(f"diagnosis_runs: the emulated cluster needs namespaces: {reason}")
            results.append(("straggler report", straggler_runs(args.runs, args.window)))
        if args.only != "stragglers":
            results.append(("hang verdict", verdict_runs(args.runs)))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    for what, right in results:
        print(f"{what}: {right} of {args.runs} right ({args.hogs} CPU hogs beside)")
    return 0 if all(right == args.runs for _, right in results) else 1


if __name__ == "__main__":
    sys.exit(main())
