"""Collective bandwidth, nccl-tests style, with peers measured in the same run.

    ringrun -np 4 python benchmarks/allreduce_bench.py
    ringrun -np 2 python benchmarks/allreduce_bench.py --min-bytes 1M --max-bytes 64M --json out.json
    mpirun -np 4 python benchmarks/allreduce_bench.py --plot busbw.png

Rows from 4 KiB to 256 MiB for ringreduce and, in the same run on the same
machine, its peers: torch.distributed's gloo backend (if torch is installed:
pip install torch==2.13.0), one raw TCP stream between two ranks, ringreduce
again with every link on TCP (rr-tcp; by default neighbours on one host share
memory), and under mpirun ringreduce over MPI and over its own links beside
MPI_Allreduce (mpi4py); then
the ratios of each to gloo (ringrun) or MPI_Allreduce (mpirun). Rank 0 prints;
a progress bar goes to stderr.
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
from harness import parse_bytes  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce.core.world import discover  # noqa: E402


def expected_fill(rank: int, dtype) -> np.ndarray:
    return np.asarray(rank + 1, dtype=dtype)


def ringreduce_impl(coll: str, count: int, dtype, op: str, label: str = "ringreduce") -> harness.Impl:
    n, r = rr.size(), rr.rank()
    x = np.full(count, r + 1, dtype=dtype)
    want = {"sum": n * (n + 1) // 2, "max": n, "min": 1, "avg": (n + 1) / 2, "prod": None}[op]
    if coll == "allreduce":
        out = np.empty_like(x)
        return harness.Impl(label, lambda: rr.allreduce(x, op=op, out=out),
                            lambda: int(np.count_nonzero(out != dtype(want))))
    if coll == "reduce_scatter":
        box = {}
        return harness.Impl(label, lambda: box.__setitem__("y", rr.reduce_scatter(x, op=op)),
                            lambda: int(np.count_nonzero(box["y"] != dtype(want))))
    if coll == "allgather":
        mine = np.full(count // n, r + 1, dtype=dtype)
        box = {}
        expect = np.repeat(np.arange(1, n + 1), count // n).astype(dtype)
        return harness.Impl(label, lambda: box.__setitem__("y", rr.allgather(mine)),
                            lambda: int(np.count_nonzero(box["y"] != expect)))
    box = {}
    return harness.Impl(label, lambda: box.__setitem__("y", rr.broadcast(x, root=0)),
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
    p.add_argument("--no-compare", action="store_true", help="skip the peers (gloo, MPI_Allreduce) and the TCP stream")
    p.add_argument("--json", help="write every number to this file")
    p.add_argument("--plot", help="draw busbw against size into this PNG")
    p.add_argument("--backend", choices=["socket", "mpi"], help="measure only this ringreduce backend")
    args = p.parse_args()

    under_mpirun = discover().source == "mpirun"
    # ringreduce is one global ring at a time: each backend gets its own phase.
    # The socket backend runs twice: as it comes (neighbours on one host share
    # memory), then with every link on TCP, as between hosts.
    tcp_only = {"RINGREDUCE_SHM_BYTES": "0"}
    phases = [("rr-mpi", "mpi", {}), ("rr-socket", "socket", {})] if under_mpirun else \
        [("ringreduce", None, {}), ("rr-tcp", "socket", tcp_only)]
    if args.backend:
        phases = [(f"rr-{args.backend}", args.backend, {})]
    dtype = np.dtype(args.dtype).type
    byte_sizes = harness.sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.step_factor)
    rows, notes, stream = [], [], None
    for phase, (label, backend, env) in enumerate(phases):
        os.environ.update(env)
        rr.init(backend=backend)
        n, lead = rr.size(), rr.rank() == 0
        peers = {}
        if phase == 0 and not args.no_compare and args.coll == "allreduce":
            peers = start_peers(under_mpirun, notes)
            stream = single_stream()
        bar = harness.progress(len(byte_sizes) * (1 + len(peers)), lead)
        for nbytes in byte_sizes:
            count = nbytes // np.dtype(dtype).itemsize
            impls = [(ringreduce_impl(args.coll, count, dtype, args.op, label), rr.barrier)]
            impls += [(make(count, dtype, args.op), barrier) for make, barrier in peers.values()]
            for impl, barrier in impls:
                if impl is None:
                    continue
                bar.set_description(f"{impl.name} {nbytes >> 10} KiB")
                rows.append(harness.measure(impl, args.coll, nbytes, count, args.dtype, args.op, barrier,
                                            repeats=args.repeats))
                bar.update()
            del impls
        bar.close()
        if phase < len(phases) - 1:
            rr.shutdown()
        for name in env:
            del os.environ[name]
    if lead:
        report(args, rows, n, stream, notes, "MPI_Allreduce" if under_mpirun else "gloo")
    rr.shutdown()


def start_peers(under_mpirun: bool, notes: list) -> dict:
    """The implementations measured beside ringreduce: name -> (factory, barrier)."""
    peers = {}
    if under_mpirun:
        from mpi4py import MPI
        peers["MPI_Allreduce"] = (mpi_impl, MPI.COMM_WORLD.Barrier)
    problem = start_gloo()
    if problem:
        notes.append(f"gloo not measured: {problem}")
    else:
        import torch.distributed as dist
        peers["gloo"] = (gloo_impl, dist.barrier)
    return peers


def mpi_impl(count: int, dtype, op: str):
    from mpi4py import MPI
    comm, n, r = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}.get(op)
    if mpi_op is None:
        return None
    x, out = np.full(count, r + 1, dtype=dtype), np.empty(count, dtype=dtype)
    want = {"sum": n * (n + 1) // 2, "max": n, "min": 1, "prod": None}[op]
    return harness.Impl("MPI_Allreduce", lambda: comm.Allreduce(x, out, op=mpi_op),
                        lambda: 0 if want is None else int(np.count_nonzero(out != dtype(want))))


def report(args, rows, n, stream, notes, reference: str) -> None:
    stamp = f"N={n}, {platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}"
    print(f"# {args.coll}, {stamp}, ringreduce {rr.__version__}")
    print(harness.table(rows))
    if stream:
        print(f"\n# one TCP stream, rank 1 -> rank 0: {stream:.2f} GB/s")
    names = list(dict.fromkeys(r.impl for r in rows))
    by = {(r.impl, r.nbytes): r for r in rows}
    sizes = sorted({r.nbytes for r in rows})
    if reference in names:
        others = [m for m in names if m != reference]
        print(f"\n{'size(B)':>11} " + " ".join(f"{m + '/' + reference:>24}" for m in others)
              + (f" {'rr busbw*N/stream':>18}" if stream else ""))
        for b in sizes:
            cells = " ".join(f"{by[m, b].busbw / by[reference, b].busbw:24.2f}" for m in others)
            tail = f" {by[names[0], b].busbw * n / stream:18.2f}" if stream else ""
            print(f"{b:>11} {cells}{tail}")
    for note in notes:
        print(f"\n# {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": n, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "single_stream_gbps": stream, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        plot(args.plot, rows, names, f"{args.coll} busbw, {stamp}")


def plot(path: str, rows, names, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in names:
        mine = sorted((r.nbytes, r.busbw) for r in rows if r.impl == m)
        ax.plot([b for b, _ in mine], [v for _, v in mine], "o-", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
