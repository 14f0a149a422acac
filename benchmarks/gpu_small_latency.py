"""Where a small GPU allreduce's time goes: the public call beside its parts,
as a markdown table for docs/performance.md.

    ringrun -np 2 python benchmarks/gpu_small_latency.py
    ringrun -np 2 python benchmarks/gpu_small_latency.py --bytes 8K --iters 5000
    ringrun -np 2 python benchmarks/gpu_small_latency.py --dry   # no GPU: the GPU rows say n/a

Every rank uses GPU (local rank % GPU count): several ranks may share one.
Rows, microseconds per call (mean over --iters calls, the slowest rank's),
float32 sum:

  numpy             rr.allreduce on a numpy array: the host small path
  cupy IPC          rr.allreduce on a cupy array with RINGREDUCE_CUDA_IPC=1
                    (the one-pass small allreduce where the ranks agreed on IPC)
  cupy IPC, out     the same into a preallocated out
  IPC C call        the pass alone (device_ipc.allreduce_small with a header
                    made once): the Python around it is the difference
  cupy staged       rr.allreduce on a cupy array with RINGREDUCE_CUDA_IPC=0
                    (the pinned bounce buffer and the host small path)
  stream sync       cupy's current stream synchronized (the call waits so once)
  empty_like        cupy.empty_like(x) (the result's allocation from the pool)
  D2D copy + sync   out[...] = x, then a synchronize (one device copy and wait)

Every allreduce result is checked against numpy's (#wrong). Rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_bytes  # noqa: E402

import ringreduce as rr  # noqa: E402

IPC_VARIABLE = "RINGREDUCE_CUDA_IPC"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=parse_bytes, default=64 << 10, help="message size (default 64K)")
    p.add_argument("--iters", type=int, default=2000, help="calls per row (default 2000)")
    p.add_argument("--dry", action="store_true", help="no GPU: only the numpy row runs")
    args = p.parse_args(argv)
    if args.bytes <= 0 or args.bytes % 4 or args.iters <= 0:
        p.error("--bytes must be a positive multiple of 4 and --iters positive")
    return args


def per_call(fn, iters: int) -> float:
    """Microseconds per call of fn, the slowest rank's mean (after a barrier
    and a few untimed calls)."""
    for _ in range(min(iters, 20)):
        fn()
    rr.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = (time.perf_counter() - start) / iters * 1e6
    return float(rr.allreduce(np.array([mine]), op="max")[0])


def main(argv=None) -> None:
    args = parse_args(argv)
    cp = None
    if not args.dry:
        import cupy as cp
    count = args.bytes // 4
    os.environ[IPC_VARIABLE] = "1"
    rr.init()
    n, r = rr.size(), rr.rank()
    host = (np.arange(count) % 251 + r).astype(np.float32)
    want = sum((np.arange(count) % 251 + q).astype(np.float32) for q in range(n))
    rows, wrong, notes = {}, 0, []

    def checked(got) -> None:
        nonlocal wrong
        got = cp.asnumpy(got) if cp is not None and not isinstance(got, np.ndarray) else got
        wrong += int(np.count_nonzero(got != want))

    checked(rr.allreduce(host))
    rows["numpy"] = per_call(lambda: rr.allreduce(host), args.iters)
    if cp is not None:
        cp.cuda.Device(rr.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
        x, out = cp.asarray(host), cp.empty(count, cp.float32)
        checked(rr.allreduce(x))  # the ring agrees on its path here
        ring = rr.core.communicator().ring
        ipc = getattr(ring, "ipc", None) is True
        if not ipc:
            notes.append("the ranks agreed on the staged path: the IPC rows ran the bounce buffer")
        rows["cupy IPC"] = per_call(lambda: rr.allreduce(x), args.iters)
        rr.allreduce(x, out=out)
        checked(out)
        rows["cupy IPC, out"] = per_call(lambda: rr.allreduce(x, out=out), args.iters)
        if ipc:
            from ringreduce.core import cuda, device_ipc
            from ringreduce.core.arrays import dtype_code, op_code
            from ringreduce.core.protocol import ALLREDUCE, header
            code, opc = dtype_code(x.dtype), op_code("sum")
            head = header(ALLREDUCE, opc, code, x.shape, None, True, device=True)
            device = cuda.ring_device(x.device.id)

            def c_call():
                with ring.lock:
                    return device_ipc.allreduce_small(ring, device, head, x.data.ptr, out.data.ptr, x.nbytes,
                                                      code, opc)
            assert c_call() is None
            checked(out)
            rows["IPC C call"] = per_call(c_call, args.iters)
        stream = cp.cuda.get_current_stream()
        rows["stream sync"] = per_call(stream.synchronize, args.iters)
        rows["empty_like"] = per_call(lambda: cp.empty_like(x), args.iters)

        def copy():
            out[...] = x
            stream.synchronize()
        rows["D2D copy + sync"] = per_call(copy, args.iters)
        rr.shutdown()
        os.environ[IPC_VARIABLE] = "0"
        rr.init()
        checked(rr.allreduce(x))
        rows["cupy staged"] = per_call(lambda: rr.allreduce(x), args.iters)
    wrong = int(rr.allreduce(np.array([wrong], np.int64))[0])
    if r == 0:
        gpu = "no GPU (--dry)"
        if cp is not None:
            props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
            gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"# small allreduce latency: {args.bytes} B float32 sum, N={n} ranks on {gpu}, "
              f"{args.iters} calls per row, {time.strftime('%Y-%m-%d %H:%M')}\n")
        print("| what | us per call |\n|---|---|")
        for what in ["numpy", "cupy IPC", "cupy IPC, out", "IPC C call", "cupy staged", "stream sync",
                     "empty_like", "D2D copy + sync"]:
            print(f"| {what} | {'n/a' if what not in rows else f'{rows[what]:.1f}'} |")
        print(f"\n#wrong: {wrong}")
        for note in notes:
            print(f"\n{note}")
    rr.shutdown()


if __name__ == "__main__":
    main()
