"""What the engine's negotiation costs per cycle, with the response cache on
and off: bytes each rank sends and microseconds, for `--tensors` requests
agreed every cycle (steady state: the same requests step after step, as in
training), on 2 and 4 local ranks, all in one run:

    python benchmarks/negotiation_bench.py [--tensors 100] [--cycles 300]

Per cycle: one ring pass of every rank's negotiation message, decoding, the
agreement and the cache update (ringreduce/engine/negotiation.py), no tensor data.
"step" is a whole engine step besides: the tensors (float32, 256 elements
each) enqueued, negotiated, fused, reduced, waited for.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

RANK_JOB = """
import json, os, statistics, time
import numpy as np
import ringreduce as rr
from ringreduce.engine import Engine
from ringreduce.engine.negotiation import Negotiator
rr.init()
tensors, cycles, capacity = (int(os.environ[k]) for k in ("TENSORS", "CYCLES", "CAPACITY"))
keys = [(f"model/layer{i}/kernel", "allreduce", "float32", (256,), "avg", 0, 0) for i in range(tensors)]
neg = Negotiator(capacity)
for _ in range(10):                    # warm-up: the first cycle fills the cache
    neg.negotiate(keys, False)
rr.barrier()
b0, times = neg.stats.bytes_sent, []
for _ in range(cycles):
    t0 = time.perf_counter()
    out = neg.negotiate(keys, False)
    times.append(time.perf_counter() - t0)
    assert len(out.run) == tensors
per_cycle_bytes = (neg.stats.bytes_sent - b0) / cycles
eng = Engine(cache_capacity=capacity)
grads = [np.full(256, rr.rank(), dtype=np.float32) for _ in keys]
steps = []
for step in range(30):
    rr.barrier()
    t0 = time.perf_counter()
    hs = [eng.enqueue(k[0], g) for k, g in zip(keys, grads)]
    for h in hs:
        eng.wait(h)
    steps.append(time.perf_counter() - t0)
eng.shutdown()
print("RESULT " + json.dumps({"bytes": per_cycle_bytes, "us": statistics.median(times) * 1e6,
                              "step_ms": statistics.median(steps[5:]) * 1e3}))
"""


def run_job(n: int, capacity: int, tensors: int, cycles: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from ringreduce.core import world
    port, secret = world.free_port("127.0.0.1"), secrets.token_hex(16)
    procs = []
    for r in range(n):
        env = dict(os.environ, RINGREDUCE_RANK=str(r), RINGREDUCE_SIZE=str(n), RINGREDUCE_ADDR=f"127.0.0.1:{port}",
                   RINGREDUCE_SECRET=secret, RINGREDUCE_LOCAL_RANK=str(r), RINGREDUCE_LOCAL_SIZE=str(n),
                   TENSORS=str(tensors), CYCLES=str(cycles), CAPACITY=str(capacity), OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_JOB], env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    return {"bytes": statistics.mean(r["bytes"] for r in results),
            "us": max(r["us"] for r in results),  # the slowest rank's median
            "step_ms": max(r["step_ms"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--sizes", default="2,4")
    args = ap.parse_args()
    print(f"{args.tensors} requests agreed per cycle; median of {args.cycles} cycles, the slowest rank's "
          f"({time.strftime('%Y-%m-%d %H:%M')})\n")
    print("| ranks | cache | bytes sent per rank per cycle | negotiation per cycle (us) | engine step (ms) |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        for capacity, label in ((0, "off"), (1024, "on")):
            r = run_job(n, capacity, args.tensors, args.cycles)
            print(f"| {n} | {label} | {r['bytes']:.0f} | {r['us']:.0f} | {r['step_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
