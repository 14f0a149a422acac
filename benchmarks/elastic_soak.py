"""Soak test of elastic training (not in CI): many 4-worker jobs under
`ringrun --elastic`, each killed (kill -9) at random times, random workers,
some kills landing while a reset is in progress. Counts hangs and wrong
results and reports the recovery time: from a kill to the next step a
survivor commits in a later generation.

    python benchmarks/elastic_soak.py --runs 100 --kills 2

A run is wrong unless ringrun exits 0, every worker ends with the same
weights (sha256), those weights are what the committed history of world
sizes says (tests/elastic_job.py), and every step was done. A run hangs
if it outlives --run-timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "elastic_job.py"


def one_run(rng: random.Random, steps: int, kills: int, timeout: float, during_reset: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "ELASTIC_JOB_ELEMENTS": "20001"}
    env.pop("RINGREDUCE_SECRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "ringreduce.launch.ringrun", "--elastic", "-np", "4", "--min-np", "2",
                             sys.executable, str(JOB), str(steps), "0.02"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    err: list = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    hung = []
    timer = threading.Timer(timeout, lambda: (hung.append(True), os.killpg(proc.pid, signal.SIGKILL)))
    timer.start()
    plan = sorted(rng.sample(range(5, steps - 10), kills))  # steps after which a kill is due
    killed: list = []   # (time, pid, generation at the kill)
    commits: list = []  # (time seen, step, generation, pid)
    done: list = []
    live: dict = {}     # pid -> last generation seen
    quick = []          # kills that landed while a reset was in progress
    lock = threading.Lock()

    def kill(victim: int, gen: int, during_reset: bool) -> None:
        with lock:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                return
            killed.append((time.time(), victim, gen))
            quick.append(during_reset)
            live.pop(victim, None)

    for line in proc.stdout:
        now = time.time()
        words = line.split("] ", 1)[-1].split()
        if words[:1] == ["committed"]:
            step, gen, pid = int(words[1]), int(words[3]), int(words[9])
            commits.append((now, step, gen, pid))
            with lock:
                live[pid] = gen
                due = plan and step >= plan[0] and len(live) > 2
            if due:
                plan.pop(0)
                with lock:
                    candidates = sorted(p for p, g in live.items() if g == gen) or sorted(live)
                kill(rng.choice(candidates), gen, False)
                if plan and rng.random() < during_reset and len(live) > 2:
                    # the next kill lands inside the reset the first one starts (it takes ~10-50 ms)
                    plan.pop(0)
                    with lock:
                        second = rng.choice(sorted(live))
                    threading.Timer(rng.uniform(0.0, 0.03), kill, (second, gen, True)).start()
        elif "] done " in line:
            done.append(json.loads(line.split("] done ", 1)[1]))
    proc.wait()
    timer.cancel()
    recoveries = []
    for t, pid, gen in killed:
        after = [c for c in commits if c[0] > t and c[2] > gen and c[3] != pid]
        if after:
            recoveries.append(min(c[0] for c in after) - t)
    right = (proc.returncode == 0 and len(done) >= 2 and len({d["sha"] for d in done}) == 1
             and all(d["w0"] == d["expected"] and d["steps"] == steps and d["uniform"] for d in done))
    return {"hung": bool(hung), "right": right, "kills": len(killed), "quick": sum(quick), "recoveries": recoveries,
            "code": proc.returncode, "stderr": "".join(err)[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--kills", type=int, default=2, help="kills per run")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--run-timeout", type=float, default=120.0)
    ap.add_argument("--during-reset", type=float, default=0.5, help="share of kills followed by one inside the reset")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=float, default=float("inf"), help="stop starting runs after this many seconds")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results, started = [], time.monotonic()
    for i in range(args.runs):
        if time.monotonic() - started > args.budget:
            break
        r = one_run(rng, args.steps, args.kills, args.run_timeout, args.during_reset)
        results.append(r)
        status = "HUNG" if r["hung"] else ("ok" if r["right"] else f"WRONG (exit {r['code']})")
        print(f"run {i + 1}: {status}, {r['kills']} kill(s) ({r['quick']} during a reset), recovery "
              + ", ".join(f"{x:.3f} s" for x in r["recoveries"]), flush=True)
        if not r["right"]:
            print(r["stderr"], file=sys.stderr)
    rec = sorted(x for r in results for x in r["recoveries"])
    kills = sum(r["kills"] for r in results)
    quick = sum(r["quick"] for r in results)
    print(f"\nruns {len(results)}, kills {kills} ({quick} during a reset), hangs {sum(r['hung'] for r in results)}, "
          f"wrong results {sum(not r['right'] and not r['hung'] for r in results)}")
    if rec:
        q = statistics.quantiles(rec, n=20, method="inclusive") if len(rec) > 1 else [rec[0]] * 19
        print(f"recovery (kill -> next committed step), {len(rec)} measured: median {statistics.median(rec):.3f} s, "
              f"p95 {q[18]:.3f} s, worst {rec[-1]:.3f} s")


if __name__ == "__main__":
    main()
