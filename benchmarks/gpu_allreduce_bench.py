"""GPU allreduce bandwidth, nccl-tests columns, side by side in one run.

    ringrun -np 2 python benchmarks/gpu_allreduce_bench.py
    ringrun -np 4 python benchmarks/gpu_allreduce_bench.py --mixed --max-bytes 64M

Rows per size for:
  rr-gpu    rr.allreduce on cupy arrays: the staged ring (pinned mirror,
            CUDA copies and reduction kernels overlapping the TCP transfers);
            with --mixed the odd ranks pass numpy arrays instead
  rr-host   rr.allreduce on numpy arrays of the same size: the same wire
            without the device, so rr-gpu/rr-host is the cost of staging
  nccl      cupy.cuda.nccl's allreduce, where NCCL will run (it refuses
            several ranks on one GPU: then a note says so)
then each implementation's busbw over rr-host's. Ranks use GPU
(local rank % GPU count). Rank 0 prints; a progress bar goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import harness
import ringreduce as rr
from harness import parse_bytes


def rr_impl(label: str, xp, count: int, dtype, op: str) -> harness.Impl:
    n, r = rr.size(), rr.rank()
    x = xp.full(count, r + 1, dtype=dtype)
    out = xp.empty_like(x)
    want = dtype({"sum": n * (n + 1) // 2, "max": n, "min": 1, "avg": (n + 1) / 2}[op])
    return harness.Impl(label, lambda: rr.allreduce(x, op=op, out=out), lambda: int((out != want).sum()))


def start_nccl(cp, notes: list):
    """A NCCL communicator over every rank, rank 0's unique id passed by
    ringreduce; None if NCCL refuses anywhere. Every rank runs the same
    collectives whatever fails where, so a refusal is a note, not a hang."""
    nccl, why = None, ""
    uid = np.zeros(1 + 128, dtype=np.uint8)  # how the id is typed (0: none), then its 128 bytes
    try:
        from cupy.cuda import nccl
        if rr.rank() == 0:
            got = nccl.get_unique_id()  # bytes from cupy 14, a tuple of 128 signed chars before
            if isinstance(got, bytes):
                uid[0], uid[1:] = 2, np.frombuffer(got, dtype=np.uint8)
            else:
                uid[0], uid[1:] = 1, np.array(got, dtype=np.int8).view(np.uint8)
    except Exception as exc:  # NCCL missing
        why = f"{type(exc).__name__}: {exc}"
    uid = rr.broadcast(uid)
    comm = None
    if uid[0] and nccl is not None:
        try:
            key = bytes(uid[1:]) if uid[0] == 2 else tuple(uid[1:].view(np.int8).tolist())
            comm = nccl.NcclCommunicator(rr.size(), key, rr.rank())
        except Exception as exc:  # several ranks on one GPU, say
            why = f"{type(exc).__name__}: {exc}"
    elif not why:
        why = "no NCCL on rank 0"
    if not rr.allreduce(np.array([int(comm is not None)], dtype=np.int32), op="min")[0]:
        notes.append(f"nccl: not measured ({why or 'refused on another rank'})")
        return None
    return comm, nccl


def nccl_impl(started, cp, count: int, dtype, op: str) -> harness.Impl:
    comm, nccl = started
    n, r = rr.size(), rr.rank()
    x = cp.full(count, r + 1, dtype=dtype)
    out = cp.empty_like(x)
    kinds = {np.float32: nccl.NCCL_FLOAT32, np.float64: nccl.NCCL_FLOAT64, np.float16: nccl.NCCL_FLOAT16,
             np.int32: nccl.NCCL_INT32, np.int64: nccl.NCCL_INT64}
    ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "avg": nccl.NCCL_AVG}
    want = dtype({"sum": n * (n + 1) // 2, "max": n, "min": 1, "avg": (n + 1) / 2}[op])
    stream = cp.cuda.Stream(non_blocking=True)

    def run():
        comm.allReduce(x.data.ptr, out.data.ptr, count, kinds[dtype], ops[op], stream.ptr)
        stream.synchronize()
    return harness.Impl("nccl", run, lambda: int((out != want).sum()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", default="64K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--step-factor", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64", "int32", "int64"])
    p.add_argument("--op", default="sum", choices=["sum", "avg", "min", "max"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mixed", action="store_true", help="odd ranks use host arrays in the rr-gpu rows")
    args = p.parse_args()

    import cupy as cp
    rr.init()
    cp.cuda.Device(rr.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
    n, lead = rr.size(), rr.rank() == 0
    dtype = np.dtype(args.dtype).type
    notes = []
    started = start_nccl(cp, notes)
    on_gpu = not (args.mixed and rr.rank() % 2 == 1)
    label = "rr-mixed" if args.mixed else "rr-gpu"
    byte_sizes = harness.sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.step_factor)
    rows = []
    bar = harness.progress(len(byte_sizes) * (3 if started else 2), lead)
    for nbytes in byte_sizes:
        count = nbytes // np.dtype(dtype).itemsize
        impls = [rr_impl(label, cp if on_gpu else np, count, dtype, args.op),
                 rr_impl("rr-host", np, count, dtype, args.op)]
        if started:
            impls.append(nccl_impl(started, cp, count, dtype, args.op))
        for impl in impls:
            bar.set_description(f"{impl.name} {nbytes >> 10} KiB")
            rows.append(harness.measure(impl, "allreduce", nbytes, count, args.dtype, args.op, rr.barrier,
                                        repeats=args.repeats))
            bar.update()
        del impls
        cp.get_default_memory_pool().free_all_blocks()
    bar.close()
    if lead:
        gpu = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
        print(f"# allreduce on GPU arrays, N={n} sharing {cp.cuda.runtime.getDeviceCount()} GPU(s) ({gpu}), "
              f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, ringreduce {rr.__version__}")
        print(harness.table(rows))
        by = {(r.impl, r.nbytes): r for r in rows}
        others = [m for m in dict.fromkeys(r.impl for r in rows) if m != "rr-host"]
        print(f"\n{'size(B)':>11} " + " ".join(f"{m + '/rr-host':>18}" for m in others))
        for b in byte_sizes:
            print(f"{b:>11} " + " ".join(f"{by[m, b].busbw / by['rr-host', b].busbw:18.2f}" for m in others))
        for note in notes:
            print(f"\n# {note}")
    rr.shutdown()


if __name__ == "__main__":
    main()
