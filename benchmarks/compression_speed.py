"""Gradient exchange per step, or the whole training step (--train), with
and without compression, on the emulated cluster (benchmarks/cluster.py: one
network namespace per host, links shaped with tc).

    sudo .venv/bin/python benchmarks/compression_speed.py                 # N=2,4,8 at 1gbit and 100mbit
    sudo .venv/bin/python benchmarks/compression_speed.py --ns 8 --rates 100mbit
    .venv/bin/python benchmarks/compression_speed.py --quick --no-cluster  # tiny, loopback: checks the pipeline
    sudo .venv/bin/python benchmarks/compression_speed.py --train --batch 2048   # training steps: compute and overlap
    .venv/bin/python benchmarks/compression_speed.py --cpu       # each compressor's arithmetic per step, one rank

Every rank holds the gradients of benchmarks/training_scaling.py's model
(Dense kernels and biases, 20M+ parameters by default) and hands them all to
the engine, last layer first, as DistributedOptimizer would; a step is the
time from the first hand-over to the last result, the median of --steps.
Bytes per step are what rank 0 sent (rr.stats(), counted in C), so they
include negotiation and headers. Real: every byte on the wire, every
compressor's arithmetic (on a shared 2-core machine, N ranks share those 2
cores: compression's CPU time is counted at that disadvantage). Not
modelled: backprop (no overlap with compute here).

--train: the whole training step, as benchmarks/training_scaling.py runs it
(its functions, with overlap on): one rank alone measures the model's
forward and backward time at --batch; in the runs every rank computes the
real Keras model and DistributedOptimizer with the compressor on a slice of
--slice rows, and a stand-in after every layer sleeps that layer's measured
share, so gradients appear in backprop's order at the full batch's times and
transfer overlaps backprop. Every gradient byte is real. A step is the median
of --steps after --warmup; samples/s count the full batch (N x --batch).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
PY = sys.executable

COMPRESSIONS = ("none", "powersgd:rank=4", "int8", "topk:ratio=0.01")


def make_compressor(spec: str):
    """'none', 'int8', 'int8:block=256', 'powersgd:rank=4', 'topk:ratio=0.01' -> a
    ringreduce.compression one (None: exact)."""
    from ringreduce.compression import Int8, PowerSGD, TopK
    name, _, params = spec.partition(":")
    kw = {k: (float(v) if "." in v else int(v)) for k, v in (p.split("=") for p in params.split(",") if p)}
    return {"none": lambda: None, "powersgd": lambda: PowerSGD(**kw), "int8": lambda: Int8(**kw),
            "topk": lambda: TopK(**kw)}[name]()


def layer_shapes(args) -> list[tuple[str, tuple]]:
    widths = [args.features] + [args.width] * args.layers + [10]
    out = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        out += [(f"dense{i}/kernel", (a, b)), (f"dense{i}/bias", (b,))]
    return out


def worker(args) -> None:
    import numpy as np

    import ringreduce as rr
    from ringreduce.engine import engine
    rr.init()
    comp = make_compressor(args.compression)
    rng = np.random.default_rng(rr.rank())
    grads = [(name, (rng.standard_normal(shape, dtype=np.float32) * 0.01)) for name, shape in layer_shapes(args)]
    eng = engine()
    times, sent = [], []
    for step in range(args.warmup + args.steps):
        rr.allreduce(np.zeros(1), name="compression_speed.start")  # every rank starts the clock together
        rr.reset_stats()
        t0 = time.perf_counter()
        handles = [eng.enqueue(name, g, op="avg", compression=comp) for name, g in reversed(grads)]
        for h in handles:
            eng.wait(h)
        times.append(time.perf_counter() - t0)
        sent.append(rr.stats()["bytes_sent"])
    if rr.rank() == 0:
        print("RESULT", json.dumps({"step_s": statistics.median(times[args.warmup:]), "steps": times[args.warmup:],
                                    "bytes_per_step": statistics.median(sent[args.warmup:]),
                                    "params": sum(int(np.prod(s)) for _, s in layer_shapes(args))}), flush=True)
    eng.shutdown()


def run(args, hosts, n: int, compression: str) -> dict:
    from training_scaling import _base_env, _result
    port, secret = hosts.port(29300 + n), secrets.token_hex(16)
    argv = [PY, str(Path(__file__).resolve()), "--worker", "--compression", compression, "--features",
            str(args.features), "--width", str(args.width), "--layers", str(args.layers),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    procs = []
    for r in range(n):
        env = {**_base_env(), "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": str(n),
               "RINGREDUCE_ADDR": f"{hosts.address(0)}:{port}", "RINGREDUCE_SECRET": secret,
               "RINGREDUCE_LOCAL_RANK": "0", "RINGREDUCE_LOCAL_SIZE": "1",
               # bytes are counted on links: on loopback (--no-cluster) every rank shares one host, whose
               # arena would carry the small exchanges uncounted; the emulated hosts have none anyway
               "RINGREDUCE_ARENA_BYTES": "0"}
        procs.append(hosts.popen(r, argv, env))
    return _result(procs, f"N={n} {compression}", args.timeout)


def compressor_cpu(args) -> None:
    """Process CPU seconds of each compressor's arithmetic on the whole
    model's gradient, one rank alone (N = 1: its collectives do nothing),
    the least of --steps: what every rank of a step spends besides the wire."""
    import numpy as np

    import ringreduce as rr
    os.environ.update(RINGREDUCE_RANK="0", RINGREDUCE_SIZE="1")
    rr.init()
    rng = np.random.default_rng(0)
    names, grads = zip(*[(n, rng.standard_normal(s, dtype=np.float32) * 0.01) for n, s in layer_shapes(args)])
    for spec in [s for s in args.compressions.split(";") if s != "none"]:
        c = make_compressor(spec)
        c.reduce_bucket(list(names), list(grads), "avg")  # warm: state, warm starts
        best = float("inf")
        for _ in range(args.steps):
            t = time.process_time()
            c.reduce_bucket(list(names), list(grads), "avg")
            best = min(best, time.process_time() - t)
        print(f"| {spec} | {best:.3f} |", flush=True)


def train_args(args) -> argparse.Namespace:
    """training_scaling.py's options for this model (its model_argv)."""
    return argparse.Namespace(features=args.features, width=args.width, layers=args.layers, batch=args.batch,
                              slice=args.slice, steps=args.steps, warmup=args.warmup, lr=0.01, threads=1,
                              reps=args.reps, timeout=args.timeout)


def run_train(args, hosts, n: int, compression: str, schedule: dict, trace_dir: Path) -> dict:
    """One training run, overlap on (training_scaling.run_ring): step time, samples/s, bytes per step."""
    from training_scaling import run_ring
    name = compression.replace(":", "_").replace("=", "")
    r = run_ring(train_args(args), hosts, n, schedule, True, compression, trace_dir / f"train-{name}-{n}.json")
    return {k: r[k] for k in ("step_s", "samples_per_s", "bytes_per_step", "step_times", "weights_agree", "trace")}


def table(rows) -> list[str]:
    train = any("samples_per_s" in r for r in rows)
    out = ["| link | N | compression | step (s) | " + ("samples/s | " if train else "") +
           "MB sent per step, rank 0 | bytes vs none | step vs none |",
           "|---|---|---|---|---|---|---|" + ("---|" if train else "")]
    base = {(r["rate"], r["n"]): r for r in rows if r["compression"] == "none"}
    for r in rows:
        b = base.get((r["rate"], r["n"]))
        b = None if b is r else b
        fewer = f"{b['bytes_per_step'] / r['bytes_per_step']:.1f}x fewer" if b else ""
        faster = f"{b['step_s'] / r['step_s']:.2f}x faster" if b else ""
        rate = f"{r['samples_per_s']:.0f} | " if train else ""
        out.append(f"| {r['rate']} | {r['n']} | {r['compression']} | {r['step_s']:.3f} | {rate}"
                   f"{r['bytes_per_step'] / 1e6:.2f} | {fewer} | {faster} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="2,4,8")
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--compressions", default=";".join(COMPRESSIONS), help="';'-separated")
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train", action="store_true", help="the whole training step: compute stand-ins, overlap")
    p.add_argument("--cpu", action="store_true", help="each compressor's CPU seconds per step, one rank, no wire")
    p.add_argument("--batch", type=int, default=2048, help="--train: per worker, what the compute stands in for")
    p.add_argument("--slice", type=int, default=8, help="--train: rows each rank really computes per step")
    p.add_argument("--reps", type=int, default=5, help="--train: repeats of the one-rank timing (the fastest counts)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-cluster", action="store_true", help="loopback, no shaped links (no root needed)")
    p.add_argument("--quick", action="store_true", help="a tiny model, N=2, loopback, into /tmp")
    p.add_argument("--out", help="default: docs/compression_speed.json, with --train docs/compression_train.json "
                                 "(--quick: /tmp/...)")
    p.add_argument("--from-json", help="print the table of a saved run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.cpu:
        return compressor_cpu(args)
    if args.from_json:
        return print("\n".join(table(json.loads(Path(args.from_json).read_text())["rows"])))
    stem = "compression_train" if args.train else "compression_speed"
    if args.quick:
        args.ns, args.rates, args.features, args.width, args.layers = "2", "loopback", 64, 128, 2
        args.batch, args.slice, args.reps = 32, 4, 2
        args.no_cluster, args.out = True, args.out or f"/tmp/{stem}.json"
    args.out = args.out or str(REPO / "docs" / f"{stem}.json")
    from training_scaling import Hosts, measure_alone, stand_in_schedule
    rows, extra = [], {}
    if args.train:  # one rank alone, no communication: the compute every rank then stands in for
        alone = measure_alone(train_args(args))
        schedule = stand_in_schedule(alone["layer_fwd"], alone["layer_bwd"], alone["fwd_s"], alone["fwd_bwd_s"])
        extra = {"alone": alone, "schedule": schedule, "load": os.getloadavg()}
        trace_dir = Path(args.out).parent / ".traces"
        trace_dir.mkdir(parents=True, exist_ok=True)
        print(f"one rank alone, batch {args.batch}: forward+backward {alone['fwd_bwd_s']:.3f} s", flush=True)
    for n in [int(x) for x in args.ns.split(",")]:  # N outer: --ns 8,4,2 has N = 8 at every rate first
        for rate in args.rates.split(","):
            if args.no_cluster:
                cluster = None
            else:
                from cluster import Cluster
                cluster = Cluster(n, rate=rate)
                cluster.up()
            try:
                for spec in args.compressions.split(";"):
                    res = (run_train(args, Hosts(cluster), n, spec, schedule, trace_dir) if args.train
                           else run(args, Hosts(cluster), n, spec))
                    row = {"rate": rate if cluster else "loopback", "n": n, "compression": spec, **res}
                    rows.append(row)
                    print(f"{row['rate']} N={n} {spec}: {res['step_s']:.3f} s/step, "
                          f"{res['bytes_per_step'] / 1e6:.2f} MB/step", flush=True)
                    Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, **extra}, indent=1))
            finally:
                if cluster:
                    cluster.down()
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
