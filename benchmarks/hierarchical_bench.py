"""Flat ring against the hierarchical allreduce (RINGREDUCE_HIERARCHICAL) on an
emulated cluster: one network namespace per host (benchmarks/cluster.py),
every host's link shaped to --rate (tc tbf), L ranks per host sharing memory.

    sudo .venv/bin/python benchmarks/hierarchical_bench.py                       # 2 hosts x 2 and x 4, 1 Gbit
    sudo .venv/bin/python benchmarks/hierarchical_bench.py --per-host 4 --max-bytes 64M --json out.json

For each layout (hosts x ranks per host) the same job runs twice, with
RINGREDUCE_HIERARCHICAL=off (the flat ring over all N ranks, ranks of a host
next to each other, so each host's link carries one ring link each way) and
=on; each prints an nccl-tests style row per size: time is the median over
--repeats of the mean of back-to-back float32 sum allreduces (the slowest
rank's), algbw = bytes / time, busbw = algbw * 2(N-1)/N for both (the flat
ring's factor: comparable across the two), #wrong the elements off the exact
sum on any rank, cpu the CPU time every rank spent on one allreduce, all
ranks together (user and system, every thread; the ranks of a host share
its cores). The link-limited ratio (the shaper is the bottleneck) holds
on a loaded machine; absolute shared-memory speed does not. Needs root
(CAP_NET_ADMIN) and iproute2.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from harness import parse_bytes, sizes  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process, every thread's, user and system."""
    import resource
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def worker(args) -> None:
    import numpy as np
    import ringreduce as rr
    from ringreduce.core.communicator import current

    if args.chunk_bytes:
        from ringreduce.core import hierarchy
        hierarchy.CHUNK_BYTES = args.chunk_bytes
    rr.init()
    n, me = rr.size(), rr.rank()
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = nbytes // 4
        x = np.full(count, me + 1, np.float32)
        out = np.empty_like(x)
        iters = max(1, min(20, (64 << 20) // nbytes))
        rr.allreduce(x, out=out)  # warm-up
        samples, cpu0 = [], cpu_seconds()
        for _ in range(args.repeats):
            rr.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                rr.allreduce(x, out=out)
            took = (time.perf_counter() - t) / iters
            samples.append(float(rr.allreduce(np.array([took]), op="max")[0]))
        cpu = float(rr.allreduce(np.array([(cpu_seconds() - cpu0) / (iters * args.repeats)]))[0])
        wrong = int(rr.allreduce(np.array([np.count_nonzero(out != n * (n + 1) / 2)], np.int64))[0])
        rows.append({"nbytes": nbytes, "count": count, "seconds": statistics.median(samples), "wrong": wrong,
                     "cpu": cpu})
    if me == 0:
        print("ROWS " + json.dumps({"hierarchy": current.world.extra["hierarchy"], "rows": rows}), flush=True)
    rr.shutdown()


def run_job(cluster, hosts: int, per_host: int, mode: str, args, port: int) -> dict:
    secret = secrets.token_hex(16)
    size = hosts * per_host
    procs = []
    for rank in range(size):
        host = rank // per_host
        env = cluster.ring_env(host, port, secret, size=size)
        env.update(RINGREDUCE_RANK=str(rank), RINGREDUCE_LOCAL_RANK=str(rank % per_host),
                   RINGREDUCE_LOCAL_SIZE=str(per_host), RINGREDUCE_HIERARCHICAL=mode,
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), OPENBLAS_NUM_THREADS="1")
        env.pop("RINGREDUCE_HOST_ID", None)
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--min-bytes", str(args.min_bytes),
                "--max-bytes", str(args.max_bytes), "--factor", str(args.factor), "--repeats", str(args.repeats),
                "--chunk-bytes", str(args.chunk_bytes)]
        procs.append(cluster.popen(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=args.timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"hierarchical_bench: {hosts}x{per_host} {mode} timed out after {args.timeout} s")
    if any(p.returncode for p in procs):
        errors = "\n".join(f"--- rank {r}\n{e[-2000:]}" for r, (_, e) in enumerate(outs) if procs[r].returncode)
        raise SystemExit(f"hierarchical_bench: {hosts}x{per_host} {mode} failed\n{errors}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def table(hosts: int, per_host: int, flat: dict, hier: dict) -> str:
    n = hosts * per_host
    factor = 2 * (n - 1) / n
    lines = [f"## {hosts} hosts x {per_host} ranks (N = {n}); hierarchy: {hier['hierarchy']}",
             f"{'size(B)':>11} {'count':>10} {'type':>7} {'redop':>5} | {'flat time(us)':>13} {'algbw':>7} "
             f"{'busbw':>7} {'#wrong':>6} {'cpu(ms)':>7} | {'hier time(us)':>13} {'algbw':>7} {'busbw':>7} "
             f"{'#wrong':>6} {'cpu(ms)':>7} | {'speedup':>7}"]
    for f, h in zip(flat["rows"], hier["rows"]):
        fa, ha = f["nbytes"] / f["seconds"] / 1e9, h["nbytes"] / h["seconds"] / 1e9
        lines.append(f"{f['nbytes']:>11} {f['count']:>10} {'float':>7} {'sum':>5} | {f['seconds'] * 1e6:>13.0f} "
                     f"{fa:>7.3f} {fa * factor:>7.3f} {f['wrong']:>6} {f['cpu'] * 1e3:>7.0f} | {h['seconds'] * 1e6:>13.0f} "
                     f"{ha:>7.3f} {ha * factor:>7.3f} {h['wrong']:>6} {h['cpu'] * 1e3:>7.0f} | "
                     f"{f['seconds'] / h['seconds']:>6.2f}x")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", default="2,4", help="ranks per host, one layout each (comma-separated)")
    p.add_argument("--rate", default="1gbit", help="every host's link (tc tbf rate)")
    p.add_argument("--min-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-bytes", type=parse_bytes, default=0,
                   help="each rank's chunk of the hierarchy's pipeline pieces (ringreduce.core.hierarchy."
                        "CHUNK_BYTES; 0: as built; the largest size: no pipelining), to study it")
    p.add_argument("--modes", default="off,on", help="RINGREDUCE_HIERARCHICAL values to run (off,on: both)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one job may take")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from cluster import Cluster, can_build
    reason = can_build()
    if reason:
        sys.exit(f"hierarchical_bench: {reason}; run as root")
    results, load_before = [], os.getloadavg()
    with Cluster(args.hosts, rate=args.rate) as cluster:
        port = 29700
        for per_host in [int(v) for v in args.per_host.split(",")]:
            modes = args.modes.split(",")
            flat = run_job(cluster, args.hosts, per_host, "off", args, port) if "off" in modes else None
            hier = run_job(cluster, args.hosts, per_host, "on", args, port + 1) if "on" in modes else None
            port += 2
            results.append({"hosts": args.hosts, "per_host": per_host, "flat": flat, "hierarchical": hier})
            print(table(args.hosts, per_host, flat or hier, hier or flat), flush=True)
            print(flush=True)
    print(f"# emulated cluster: {args.hosts} network namespaces, each link {args.rate} (tc tbf) both ways; "
          f"float32 sum; busbw = algbw * 2(N-1)/N; GB/s = 1e9 B/s; {os.cpu_count()} cores; load average "
          f"{' '.join(f'{v:.1f}' for v in load_before)} before, {' '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"after")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
