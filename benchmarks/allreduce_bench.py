"""Collective bandwidth, nccl-tests style, with peers measured in the same run.

    ringrun -np 4 python benchmarks/allreduce_bench.py
    ringrun -np 2 python benchmarks/allreduce_bench.py --min-bytes 1M --max-bytes 64M --json out.json

Rows from 4 KiB to 256 MiB for ringreduce and, in the same run on the same
machine, torch.distributed's gloo backend (if torch is installed:
pip install torch==2.13.0) and one raw TCP stream between two ranks; then the
ratios. Rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce.collectives import _chunk_bounds  # noqa: E402


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def expected_fill(rank: int, dtype) -> np.ndarray:
    return np.asarray(rank + 1, dtype=dtype)


def ringreduce_impl(coll: str, count: int, dtype, op: str) -> harness.Impl:
    n, r = rr.size(), rr.rank()
    x = np.full(count, r + 1, dtype=dtype)
    want = {"sum": n * (n + 1) // 2, "max": n, "min": 1, "avg": (n + 1) / 2, "prod": None}[op]
    if coll == "allreduce":
        out = np.empty_like(x)
        return harness.Impl("ringreduce", lambda: rr.allreduce(x, op=op, out=out),
                            lambda: int(np.count_nonzero(out != dtype(want))))
    if coll == "reduce_scatter":
        box = {}
        return harness.Impl("ringreduce", lambda: box.__setitem__("y", rr.reduce_scatter(x, op=op)),
                            lambda: int(np.count_nonzero(box["y"] != dtype(want))))
    if coll == "allgather":
        mine = np.full(count // n, r + 1, dtype=dtype)
        box = {}
        expect = np.repeat(np.arange(1, n + 1), count // n).astype(dtype)
        return harness.Impl("ringreduce", lambda: box.__setitem__("y", rr.allgather(mine)),
                            lambda: int(np.count_nonzero(box["y"] != expect)))
    box = {}
    return harness.Impl("ringreduce", lambda: box.__setitem__("y", rr.broadcast(x, root=0)),
                        lambda: int(np.count_nonzero(box["y"] != dtype(1))))


def gloo_impl(count: int, dtype, op: str):
    import torch
    import torch.distributed as dist
    n, r = rr.size(), rr.rank()
    t = torch.full((count,), float(r + 1), dtype=getattr(torch, np.dtype(dtype).name))
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                 "prod": dist.ReduceOp.PRODUCT}.get(op)
    if reduce_op is None:
        return None

    def wrong():
        t.fill_(float(r + 1))
        dist.all_reduce(t, op=reduce_op)
        want = {"sum": n * (n + 1) // 2, "max": n, "min": 1}[op]
        return int((t != want).sum())
    return harness.Impl("gloo", lambda: dist.all_reduce(t, op=reduce_op), wrong)


def start_gloo():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch==2.13.0)"
    torch.set_num_threads(1)
    port = None
    if rr.rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = int(rr.broadcast(np.array([port or 0], dtype=np.int64))[0])
    host = os.environ.get("RINGREDUCE_ADDR", "127.0.0.1:0").rsplit(":", 1)[0]
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rr.rank(), world_size=rr.size())
    return None


def single_stream(nbytes: int = 512 << 20) -> float | None:
    """GB/s of one TCP stream from rank 1 to rank 0 (the other ranks wait)."""
    if rr.size() < 2:
        return None
    port = 0
    listener = None
    if rr.rank() == 0:
        listener = socket.socket()
        listener.bind(("", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
    port = int(rr.broadcast(np.array([port], dtype=np.int64))[0])
    host = os.environ.get("RINGREDUCE_ADDR", "127.0.0.1:0").rsplit(":", 1)[0]
    gbps = 0.0
    if rr.rank() == 1:
        s = socket.create_connection((host, port))
        chunk = memoryview(bytearray(4 << 20))
        sent = 0
        while sent < nbytes:
            sent += s.send(chunk[:min(len(chunk), nbytes - sent)])
        s.recv(1)
        s.close()
    elif rr.rank() == 0:
        conn, _ = listener.accept()
        buf = memoryview(bytearray(4 << 20))
        got, t = 0, time.perf_counter()
        while got < nbytes:
            k = conn.recv_into(buf)
            if not k:
                break
            got += k
        gbps = got / (time.perf_counter() - t) / 1e9
        conn.send(b"k")
        conn.close()
        listener.close()
    return float(rr.allreduce(np.array([gbps]), op="max")[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--step-factor", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--op", default="sum", choices=["sum", "avg", "min", "max", "prod"])
    p.add_argument("--coll", default="allreduce", choices=list(harness.BUSBW_FACTOR))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compare", action="store_true", help="skip gloo and the raw TCP stream")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args()

    rr.init()
    n, lead = rr.size(), rr.rank() == 0
    dtype = np.dtype(args.dtype).type
    gloo_problem = "not asked for" if args.no_compare or args.coll != "allreduce" else start_gloo()
    stream = None if args.no_compare else single_stream()
    byte_sizes = harness.sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.step_factor)
    bar = harness.progress(len(byte_sizes) * (1 if gloo_problem else 2), lead)
    rows = []
    for nbytes in byte_sizes:
        count = nbytes // np.dtype(dtype).itemsize
        impls = [ringreduce_impl(args.coll, count, dtype, args.op)]
        if not gloo_problem:
            impls.append(gloo_impl(count, dtype, args.op))
        for impl in filter(None, impls):
            bar.set_description(f"{impl.name} {nbytes >> 10} KiB")
            barrier = rr.barrier if impl.name != "gloo" else __import__("torch.distributed").distributed.barrier
            rows.append(harness.measure(impl, args.coll, nbytes, count, args.dtype, args.op, barrier,
                                        repeats=args.repeats))
            bar.update()
        del impls
    bar.close()

    if lead:
        print(f"# {args.coll}, N={n}, {platform.node()}, {os.cpu_count()} cores, "
              f"{time.strftime('%Y-%m-%d %H:%M')}, ringreduce {rr.__version__}")
        print(harness.table(rows))
        if stream:
            print(f"\n# one TCP stream, rank 1 -> rank 0: {stream:.2f} GB/s")
        ring = {r.nbytes: r for r in rows if r.impl == "ringreduce"}
        gloo = {r.nbytes: r for r in rows if r.impl == "gloo"}
        print(f"\n{'size(B)':>11} {'ring/gloo busbw':>16} {'ring busbw*N/stream':>20}")
        for nbytes, r in ring.items():
            vs_gloo = f"{r.busbw / gloo[nbytes].busbw:16.2f}" if nbytes in gloo else f"{'-':>16}"
            vs_stream = f"{r.busbw * n / stream:20.2f}" if stream else f"{'-':>20}"
            print(f"{nbytes:>11} {vs_gloo} {vs_stream}")
        if gloo_problem and gloo_problem != "not asked for":
            print(f"\n# gloo not measured: {gloo_problem}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"n": n, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
                           "single_stream_gbps": stream, "rows": [asdict(r) for r in rows]}, f, indent=1)
    rr.shutdown()


if __name__ == "__main__":
    main()
