"""Does elastic training cost accuracy? sklearn's digits, a softmax
regression trained by SGD on 4 workers under `ringrun --elastic`: once
undisturbed, once with 3 workers killed (kill -9) along the way. Prints
both test accuracies; they should agree within 1 point.

    python benchmarks/elastic_accuracy.py [--steps 300] [--kills 3]

Each step takes a global batch of 64 samples, split between the ranks of
the world of the moment; the gradients are summed over the ring and divided
by 64, so the mathematics do not depend on the world's size: a loss changes
only the rounding (and rolls back to the last commit).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
BATCH, LR = 64, 0.5


def data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    return train_test_split(x, y, test_size=0.3, random_state=0)


def worker(steps: int, pause: float) -> None:
    import ringreduce as rr
    from ringreduce import elastic
    xtr, xte, ytr, yte = data()
    rr.init()
    state = elastic.ObjectState(step=0, w=np.zeros((64, 10)), b=np.zeros(10))

    @elastic.run
    def train(state):
        while state.step < steps:
            idx = np.random.default_rng(state.step).choice(len(xtr), BATCH, replace=False)
            mine = np.array_split(idx, rr.size())[rr.rank()]
            x, y = xtr[mine], ytr[mine]
            logits = x @ state.w + state.b
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(len(y)), y] -= 1
            grad = np.concatenate([(x.T @ p).ravel(), p.sum(0)])
            grad = rr.allreduce(grad, op="sum", name="grad") / BATCH
            state.w -= LR * grad[:640].reshape(64, 10)
            state.b -= LR * grad[640:]
            state.step += 1
            time.sleep(pause)
            try:
                state.commit()
            finally:
                print(f"committed {state.step} pid {os.getpid()}", flush=True)

    train(state)
    acc = float(((xte @ state.w + state.b).argmax(1) == yte).mean())
    print("done " + json.dumps({"rank": rr.rank(), "accuracy": acc}), flush=True)


def job(steps: int, kills: int, seed: int) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent), "OPENBLAS_NUM_THREADS": "1"}
    env.pop("RINGREDUCE_SECRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "ringreduce.launch.ringrun", "--elastic", "-np", "4", "--min-np", "2",
                             sys.executable, str(HERE), "--worker", "--steps", str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    rng = random.Random(seed)
    plan = sorted(rng.sample(range(10, steps - 20), kills))
    accs, killed = [], 0
    for line in proc.stdout:
        words = line.split("] ", 1)[-1].split()
        if words[:1] == ["committed"] and plan and int(words[1]) >= plan[0]:
            plan.pop(0)
            os.kill(int(words[3]), signal.SIGKILL)
            killed += 1
        elif "] done " in line:
            accs.append(json.loads(line.split("] done ", 1)[1])["accuracy"])
    proc.wait(timeout=300)
    if proc.returncode != 0 or len(set(accs)) != 1:
        raise SystemExit(f"job failed: exit {proc.returncode}, accuracies {accs}")
    return accs[0], killed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps, args.pause)
    calm, _ = job(args.steps, 0, args.seed)
    rough, killed = job(args.steps, args.kills, args.seed)
    print("| run | kills | test accuracy |\n|-----|-------|---------------|")
    print(f"| undisturbed | 0 | {calm * 100:.2f} % |\n| elastic, workers killed | {killed} | {rough * 100:.2f} % |")
    print(f"difference: {abs(calm - rough) * 100:.2f} points")


if __name__ == "__main__":
    main()
