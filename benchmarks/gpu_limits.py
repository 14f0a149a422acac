"""The GPU's physical limits the staged ring works under, as a markdown table:

    python benchmarks/gpu_limits.py            # cupy on the current GPU
    python benchmarks/gpu_limits.py --dry      # numpy standing in (checks the script, measures host memory)

Rows: device-to-host and host-to-device copy bandwidth from and to pinned
host memory (what the staged ring's mirror and bounce buffers get) and from
and to pageable memory (what cupy.asnumpy / cupy.asarray get), and device
memory bandwidth: `x += y` (two reads and one write per element) and a
device-to-device copy (one read, one write). GB = 1e9 bytes, counting every
byte read or written; each rate is the best of several timed runs
(harness.best_rate), after one warm-up. Without cupy (or with --dry) the
same rows run with numpy on host memory, labelled so.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_bytes  # noqa: E402


def best_rate(fn, nbytes: float, sync, seconds: float) -> float:
    """GB/s of fn() moving nbytes, the best of the runs fitting in about
    `seconds` (at least 3), after one warm-up; sync() waits for the device."""
    fn()
    sync()
    best, spent, runs = 0.0, 0.0, 0
    while runs < 3 or spent < seconds:
        t = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t
        best, spent, runs = max(best, nbytes / dt / 1e9), spent + dt, runs + 1
    return best


def measure_gpu(cp, nbytes: int, seconds: float) -> list[tuple[str, float, str]]:
    """(row, GB/s, note) for every limit, with cupy on its current device."""
    count = nbytes // 4
    dev_a, dev_b = cp.ones(count, np.float32), cp.ones(count, np.float32)
    pinned_mem = cp.cuda.alloc_pinned_memory(nbytes)
    pinned = np.ndarray((count,), np.float32, buffer=pinned_mem)  # as cupyx.empty_pinned makes it
    pinned[:] = 1
    pageable = np.ones(count, np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    kind = cp.cuda.runtime
    sync = stream.synchronize

    def copy(dst, src, how):
        return lambda: kind.memcpyAsync(dst, src, nbytes, how, stream.ptr)

    rows = [
        ("D2H, pinned", best_rate(copy(pinned.ctypes.data, dev_a.data.ptr, kind.memcpyDeviceToHost), nbytes,
                                  sync, seconds), "cudaMemcpyAsync into cudaHostAlloc memory"),
        ("H2D, pinned", best_rate(copy(dev_a.data.ptr, pinned.ctypes.data, kind.memcpyHostToDevice), nbytes,
                                  sync, seconds), "cudaMemcpyAsync from cudaHostAlloc memory"),
        ("D2H, pageable", best_rate(lambda: dev_a.get(out=pageable), nbytes, sync, seconds), "cupy ndarray.get"),
        ("H2D, pageable", best_rate(lambda: dev_a.set(pageable), nbytes, sync, seconds), "cupy ndarray.set"),
    ]
    with stream:
        rows.append(("device x += y", best_rate(lambda: dev_a.__iadd__(dev_b), 3 * nbytes, sync, seconds),
                     "2 reads + 1 write per element"))
        rows.append(("device D2D copy", best_rate(copy(dev_b.data.ptr, dev_a.data.ptr, kind.memcpyDeviceToDevice),
                                                  2 * nbytes, sync, seconds), "1 read + 1 write per element"))
    return rows


def measure_host(nbytes: int, seconds: float) -> list[tuple[str, float, str]]:
    """The same rows with numpy on host memory: what --dry (or no cupy) measures."""
    count = nbytes // 4
    a, b, c = np.ones(count, np.float32), np.ones(count, np.float32), np.empty(count, np.float32)
    sync = lambda: None  # noqa: E731
    copy = lambda: np.copyto(c, a)  # noqa: E731
    return [
        ("D2H, pinned", best_rate(copy, nbytes, sync, seconds), "host memcpy (no GPU)"),
        ("H2D, pinned", best_rate(copy, nbytes, sync, seconds), "host memcpy (no GPU)"),
        ("D2H, pageable", best_rate(copy, nbytes, sync, seconds), "host memcpy (no GPU)"),
        ("H2D, pageable", best_rate(copy, nbytes, sync, seconds), "host memcpy (no GPU)"),
        ("device x += y", best_rate(lambda: a.__iadd__(b), 3 * nbytes, sync, seconds), "host numpy (no GPU)"),
        ("device D2D copy", best_rate(copy, 2 * nbytes, sync, seconds), "host numpy (no GPU)"),
    ]


def table(rows, nbytes: int, title: str) -> str:
    lines = [f"# {title}", "", f"| limit ({nbytes >> 20} MiB) | GB/s | how |", "|---|---|---|"]
    lines += [f"| {name} | {gbps:.1f} | {note} |" for name, gbps, note in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", default="256M", help="buffer size of every row (default 256M)")
    p.add_argument("--seconds", type=float, default=0.5, help="time spent per row, about (default 0.5)")
    p.add_argument("--dry", action="store_true", help="numpy on host memory instead of cupy (no GPU needed)")
    args = p.parse_args(argv)
    nbytes = parse_bytes(args.bytes)
    cp, why = None, "--dry"
    if not args.dry:
        try:
            import cupy as cp
            cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no cupy, or no driver / device
            cp, why = None, f"{type(exc).__name__}: {exc}"
    if cp is None:
        print(table(measure_host(nbytes, args.seconds), nbytes, f"host memory, no GPU measured ({why})"))
        return
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(table(measure_gpu(cp, nbytes, args.seconds), nbytes, f"{name}, cupy {cp.__version__}"))


if __name__ == "__main__":
    main()
