"""Equal vs balanced batches with one rank 2x slower: time to a fixed test
accuracy and the final accuracy, for worlds of 2 and 3 ranks.

    python benchmarks/balanced_batches.py [--ranks 2 3] [--steps 150] [--target 0.82]

Runs examples/balanced_batches.py under ringrun once per (world, mode): a
softmax regression on synthetic data, global batch 240, every rank's compute
a sleep of 1 ms per row (plus the real gradient), the last rank's 2x. A
sleep takes no CPU, so the 2x ratio holds on a loaded machine. Equal: every
rank gets G/N rows. Balanced: ringreduce.balance moves shares toward each
rank's measured speed every 10 steps. Both average the gradients weighted by
the shares, so they train the same model on the same global batches; the
table shows whether balanced got there sooner. Prints a Markdown table.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(ranks: int, mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "ringreduce", "-np", str(ranks), sys.executable,
           str(ROOT / "examples" / "balanced_batches.py"), "--mode", mode, "--steps", str(args.steps),
           "--target", str(args.target), "--slowdown", str(args.slowdown)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("[0] {"))
    return json.loads(line[4:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--target", type=float, default=0.82)
    ap.add_argument("--slowdown", type=float, default=2.0)
    args = ap.parse_args()
    print("| ranks | mode | steps to target | seconds to target | speedup | final accuracy | final shares | "
          "seconds for all steps |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        equal, balanced = run(n, "equal", args), run(n, "balanced", args)
        for res in (equal, balanced):
            speedup = "" if res is equal or not (equal["seconds_to_target"] and res["seconds_to_target"]) else \
                f"{equal['seconds_to_target'] / res['seconds_to_target']:.2f}x"
            seconds = "not reached" if res["seconds_to_target"] is None else f"{res['seconds_to_target']:.2f}"
            print(f"| {n} | {res['mode']} | {res['steps_to_target']} | {seconds} | {speedup} | "
                  f"{res['final_accuracy']:.4f} | {res['final_shares']} | {res['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
