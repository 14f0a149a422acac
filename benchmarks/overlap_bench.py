"""How much gradient traffic hides behind backprop: DistributedOptimizer with
overlap on and off, on an emulated cluster whose links are the bottleneck.

    sudo python benchmarks/overlap_bench.py                  # N=2, 1 Gbit links, deep MLP
    sudo python benchmarks/overlap_bench.py --np 4 --rate 2gbit --json out.json
    python benchmarks/overlap_bench.py --no-cluster          # plain loopback (links not the bottleneck)

The same Keras model trains twice, with RINGREDUCE_OVERLAP=1 and =0, each time
with RINGREDUCE_TIMELINE on. From rank 0's trace, per step: the time the ring
was busy (the union of its allreduce ops), backprop's end (the moment the
last gradient was handed over), and how much of the ring's busy time fell
before that end: the share hidden behind backprop.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from cluster import Cluster, can_build  # noqa: E402

PY = sys.executable


# --------------------------------------------------------------------------- the worker (one per rank)

def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import ringreduce.tensorflow as rrtf

    # Ranks share this machine's cores: one thread per kernel keeps them from
    # fighting over cores, so the links stay the bottleneck being measured.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    rrtf.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((args.width,))]
                             + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(rrtf.rank())
    steps = args.warmup + args.steps
    x = rng.standard_normal((steps * args.batch, args.width), dtype=np.float32)
    y = rng.integers(0, 10, steps * args.batch)

    class Steps(keras.callbacks.Callback):
        windows: list = []

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= args.warmup:
                self.windows.append((self.t0, time.monotonic()))

    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[rrtf.BroadcastGlobalVariablesCallback(0), Steps()])
    params = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    if rrtf.rank() == 0:
        print("RESULT", json.dumps({"windows": Steps.windows, "params": params}), flush=True)
    from ringreduce.engine import engine
    engine().shutdown()  # closes the timeline file


# --------------------------------------------------------------------------- reading the trace

def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def analyse(trace_path: Path, windows) -> dict:
    """Per step: ring busy time, backprop end, busy time before it (seconds)."""
    events = [e for e in json.loads(trace_path.read_text()) if e]
    ring = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e.get("name") == "ALLREDUCE"]
    handovers = [e["ts"] / 1e6 for e in events if e.get("name") == "QUEUE" and e.get("ph") == "B"]
    steps = []
    for t0, t1 in windows:
        busy = _union([(max(a, t0), min(b, t1)) for a, b in ring if b > t0 and a < t1])
        mine = [t for t in handovers if t0 <= t <= t1]
        if not busy or not mine:
            continue
        first, last = min(mine), max(mine)
        hidden = _union([(a, min(b, last)) for a, b in busy if a < last])
        steps.append({"step": t1 - t0, "comm": _length(busy), "hidden": _length(hidden),
                      "first_handover": first - t0, "backprop_end": last - t0})
    if not steps:
        raise RuntimeError(f"{trace_path}: no ring ops inside the timed steps")
    med = lambda k: sorted(s[k] for s in steps)[len(steps) // 2]  # noqa: E731
    return {"step_s": med("step"), "comm_s": med("comm"), "first_handover_s": med("first_handover"),
            "backprop_end_s": med("backprop_end"),
            "hidden_share": sum(s["hidden"] for s in steps) / sum(s["comm"] for s in steps), "steps": len(steps)}


# --------------------------------------------------------------------------- the launcher

def run_mode(args, cluster, overlap: bool, tmp: Path) -> dict:
    trace = tmp / f"trace-overlap{int(overlap)}.json"
    secret, port = secrets.token_hex(16), 29500 + int(overlap)
    argv = [PY, str(Path(__file__).resolve()), "--worker", "--layers", str(args.layers), "--width", str(args.width),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads", str(args.threads)]
    extra = {"PYTHONPATH": str(REPO), "RINGREDUCE_OVERLAP": "1" if overlap else "0",
             "RINGREDUCE_TIMELINE": str(trace), "TF_CPP_MIN_LOG_LEVEL": "3"}
    procs = []
    for r in range(args.np):
        if cluster is not None:
            env = {**cluster.ring_env(r, port, secret, args.np), **extra}
            procs.append(cluster.popen(r, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        else:
            env = {**os.environ, **extra, "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": str(args.np),
                   "RINGREDUCE_ADDR": f"127.0.0.1:{port}", "RINGREDUCE_SECRET": secret}
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(o[1][-3000:] for o in outs))
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[7:])
    return {**analyse(trace, result["windows"]), "params": result["params"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each host's link rate (tc tbf on the emulated cluster)")
    p.add_argument("--no-cluster", action="store_true", help="run the ranks on plain loopback")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads per rank")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    cluster = None
    if not args.no_cluster:
        reason = can_build()
        if reason:
            sys.exit(f"overlap_bench: {reason}; run as root, or pass --no-cluster")
        cluster = Cluster(args.np, rate=args.rate)
        cluster.up()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            on = run_mode(args, cluster, True, Path(tmp))
            off = run_mode(args, cluster, False, Path(tmp))
    finally:
        if cluster is not None:
            cluster.down()
    where = f"emulated cluster, {args.rate} links" if cluster is not None else "loopback"
    mb = on["params"] * 4 / 2 ** 20
    print(f"# overlap_bench: N={args.np}, {where}; MLP {args.layers}x{args.width} "
          f"({on['params'] / 1e6:.1f}M params, {mb:.0f} MiB of gradients), batch {args.batch}/rank, "
          f"median of {on['steps']} steps")
    print(f"{'overlap':>8} {'step ms':>9} {'ring busy ms':>13} {'1st hand-over ms':>17} "
          f"{'backprop end ms':>16} {'hidden':>7}")
    for name, r in (("on", on), ("off", off)):
        print(f"{name:>8} {r['step_s'] * 1e3:9.1f} {r['comm_s'] * 1e3:13.1f} {r['first_handover_s'] * 1e3:17.1f} "
              f"{r['backprop_end_s'] * 1e3:16.1f} {r['hidden_share'] * 100:6.0f}%")
    saved = off["step_s"] - on["step_s"]
    print(f"step time off/on: {off['step_s'] / on['step_s']:.2f}x; "
          f"step time saved / ring time (off): {saved / off['comm_s'] * 100:.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "on": on, "off": off}, indent=1))


if __name__ == "__main__":
    main()
