"""GPU allreduce against torch.distributed's gloo on CUDA tensors, in one run,
as markdown tables for docs/performance.md.

    ringrun -np 2 python benchmarks/gpu_allreduce_bench.py
    ringrun -np 4 python benchmarks/gpu_allreduce_bench.py --sizes 64K,16M --repeats 3
    ringrun -np 2 python benchmarks/gpu_allreduce_bench.py --dry   # no GPU: numpy stands in for cupy

Every rank uses GPU (local rank % GPU count): several ranks may share one.
Implementations, interleaved size by size so each row of a size ran in the
same minute (float32 sum by default):

  staged  rr.allreduce on cupy arrays, RINGREDUCE_CUDA_IPC=0: the staged
          ring (pinned mirror, the host ring)
  numpy   rr.allreduce on numpy arrays of the same size: the same wire
          without the device, so staged/numpy is the cost of staging
  gloo    torch.distributed's gloo allreduce on CUDA tensors, over the same
          ranks (one process group for the whole run); "n/a" without torch
  mixed   the staged ring with the odd ranks on numpy (a mixed CPU/GPU
          ring), against the all-numpy ring
  ipc     rr.allreduce on cupy arrays with RINGREDUCE_CUDA_IPC=1, in a
          second phase (ringreduce shut down and initialized again; gloo
          stays up): where this build has no CUDA IPC path it runs staged

Every result is compared with numpy's (the inputs are exact in float32:
#wrong counts differing elements over all ranks and implementations). With
--dry numpy arrays stand in for cupy and gloo runs on CPU tensors: the script
and its tables, not the GPU, are checked. Rank 0 prints; a progress bar goes
to stderr.

--seconds S (default: GPU_CHECK_STAGE_SECONDS less STARTUP_SECONDS where
benchmarks/gpu_check.sh sets it, else no limit): the measuring keeps to
about S seconds so the tables print before a time limit kills the run: the
staged phase takes up to STAGED_SHARE of them, the IPC phase runs until
LAST_SHARE, and a size whose estimated time (the previous size's, scaled by
the bytes it moves) would not fit is left out with every size after it, on
every rank alike (rank 0's clock decides), and a note names them.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import parse_bytes  # noqa: E402

import ringreduce as rr  # noqa: E402

DEFAULT_SIZES = "64K,1M,16M,64M,256M"
STARTUP_SECONDS = 25  # of a gpu_check stage's: ringrun, imports, gloo, the tables
STAGED_SHARE, LAST_SHARE = 0.55, 0.9
IPC_VARIABLE = "RINGREDUCE_CUDA_IPC"
# Columns of the tables, in order: implementation -> header.
BUSBW_COLUMNS = {"staged": "rr cupy staged", "ipc": "rr cupy IPC", "gloo": "gloo CUDA", "numpy": "rr numpy",
                 "mixed": "rr mixed"}


def parse_sizes(text: str) -> list[int]:
    """"64K,1M" -> [65536, 1048576]: sizes in bytes, as given (each a multiple of 4)."""
    sizes = [parse_bytes(s) for s in text.split(",") if s.strip()]
    if not sizes or any(s <= 0 or s % 4 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive multiples of 4 bytes: {text!r}")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                   help=f"comma-separated sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per row (median of them)")
    p.add_argument("--dry", action="store_true", help="no GPU: numpy stands in for cupy, gloo on CPU tensors")
    p.add_argument("--no-gloo", action="store_true", help="leave out torch's gloo")
    p.add_argument("--no-ipc", action="store_true", help="leave out the RINGREDUCE_CUDA_IPC=1 phase")
    p.add_argument("--no-mixed", action="store_true", help="leave out the mixed CPU/GPU ring")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    stage = float(os.environ.get("GPU_CHECK_STAGE_SECONDS") or 0)
    p.add_argument("--seconds", type=float, default=max(stage - STARTUP_SECONDS, 1.0) if stage else 0.0,
                   help="keep the measuring to about this long, leaving out sizes that would not fit "
                        "(default: GPU_CHECK_STAGE_SECONDS less %d where set, else 0: no limit)" % STARTUP_SECONDS)
    return p.parse_args(argv)


def inputs(count: int, rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's input, the sum every rank must get): integers below 2**24,
    exact in float32, different in every element so a misplaced chunk shows."""
    base = np.arange(count, dtype=np.int64) % 251
    return (base + rank).astype(np.float32), (base * n + n * (n - 1) // 2).astype(np.float32)


def rr_impl(label: str, xp, count: int) -> harness.Impl:
    n, r = rr.size(), rr.rank()
    host, want = inputs(count, r, n)
    x = xp.asarray(host)
    out = xp.empty_like(x)
    to_host = (lambda a: a) if xp is np else xp.asnumpy
    return harness.Impl(label, lambda: rr.allreduce(x, op="sum", out=out),
                        lambda: int(np.count_nonzero(to_host(out) != want)))


def start_gloo(dry: bool) -> str | None:
    """torch.distributed's gloo process group over these ranks (rank 0's port
    passed by ringreduce), checked with one allreduce on the tensors the
    benchmark uses (CUDA, or CPU with --dry); None when every rank is ready,
    else why not. Every rank runs the same collectives whatever fails where,
    and all agree: a failure is a note, never a hang or a crash."""
    why = ""
    try:
        import torch
        import torch.distributed as dist
        if not dist.is_gloo_available():
            why = "torch has no gloo backend"
    except Exception as exc:  # torch missing or broken
        why = f"torch not importable ({type(exc).__name__}: {exc})"
    port = 0
    if rr.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = int(rr.broadcast(np.array([port], dtype=np.int64))[0])
    if rr.allreduce(np.array([0 if why else 1], dtype=np.int32), op="min")[0] != 1:
        return why or "torch or gloo missing on another rank"
    try:
        torch.set_num_threads(1)
        if not dry:
            torch.cuda.set_device(rr.local_rank() % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rr.rank(),
                                world_size=rr.size(), timeout=datetime.timedelta(seconds=120))
        t = torch.full((1000,), float(rr.rank() + 1), device="cpu" if dry else "cuda")
        dist.all_reduce(t)
        ok = bool((t == rr.size() * (rr.size() + 1) // 2).all().item())
        why = "" if ok else "gloo's probe allreduce gave a wrong sum"
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"[:300]
    if rr.allreduce(np.array([0 if why else 1], dtype=np.int32), op="min")[0] != 1:
        return why or "gloo failed on another rank"
    return None


def gloo_impl(count: int, dry: bool) -> harness.Impl:
    import torch
    import torch.distributed as dist
    host, want = inputs(count, rr.rank(), rr.size())
    src = torch.from_numpy(host)
    t = src.clone() if dry else src.cuda()

    def wrong():
        t.copy_(src)
        dist.all_reduce(t)
        return int(np.count_nonzero(t.cpu().numpy() != want))
    # In place, as gloo reduces: the timed runs grow the values (inf at worst, never slower).
    return harness.Impl("gloo", lambda: dist.all_reduce(t), wrong)


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def size_name(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def report(rows: list[harness.Row], title: str, notes: list[str], columns: dict = BUSBW_COLUMNS) -> str:
    """The markdown tables: busbw with the ratios, then time per allreduce.
    A missing implementation's cells say n/a; columns: implementation -> header."""
    by = {(r.impl, r.nbytes): r for r in rows}
    sizes = sorted({r.nbytes for r in rows})

    def bw(impl, b):
        row = by.get((impl, b))
        return None if row is None else row.busbw

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    lines = [f"# {title}", "",
             "busbw in GB/s (nccl-tests: algbw * 2(N-1)/N); #wrong: elements differing from numpy's sum, "
             "all ranks and implementations", "",
             "| size | " + " | ".join(columns.values()) +
             " | staged/numpy | staged/gloo | IPC/staged | mixed/numpy | #wrong |",
             "|---" * (len(columns) + 6) + "|"]
    for b in sizes:
        cells = [fmt(bw(impl, b), 3) for impl in columns]
        ratios = [ratio(bw("staged", b), bw("numpy", b)), ratio(bw("staged", b), bw("gloo", b)),
                  ratio(bw("ipc", b), bw("staged", b)), ratio(bw("mixed", b), bw("numpy", b))]
        wrong = sum(r.wrong for r in rows if r.nbytes == b)
        lines.append(f"| {size_name(b)} | " + " | ".join(cells + [fmt(x) for x in ratios]) + f" | {wrong} |")
    lines += ["", "time per allreduce in us (the slowest rank's; the smallest size is the latency)", "",
              "| size | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for b in sizes:
        cells = [fmt(None if by.get((impl, b)) is None else by[impl, b].seconds * 1e6, 1) for impl in columns]
        lines.append(f"| {size_name(b)} | " + " | ".join(cells) + " |")
    bad = sorted({(r.impl, size_name(r.nbytes), r.wrong) for r in rows if r.wrong})
    if bad:
        lines += ["", "WRONG RESULTS: " + ", ".join(f"{impl} at {s}: {k} elements" for impl, s, k in bad)]
    lines += [f"\n{note}" for note in notes]
    return "\n".join(lines)


def work(nbytes: int, repeats: int) -> float:
    """Bytes one implementation moves measuring a size (harness.measure: two warm-ups, then the repeats)."""
    return float(nbytes) * (2 + repeats * harness.iterations(nbytes))


def starts(until: float | None, estimate: float) -> bool:
    """Whether a size estimated to take `estimate` seconds fits before
    `until` (time.monotonic() on rank 0, None: no limit): rank 0's verdict,
    the same on every rank."""
    if until is None:
        return True
    fits = 1 if rr.rank() != 0 or time.monotonic() + estimate < until else 0
    return bool(int(rr.broadcast(np.array([fits], dtype=np.int32), root=0)[0]))


def measure_phase(impls_for, sizes, repeats: int, bar, until: float | None = None,
                  left_out: list | None = None) -> list[harness.Row]:
    """Every implementation at every size, size by size: impls_for(nbytes)
    gives [(Impl, barrier)]; each is dropped before the next size. With
    `until` (starts()), a size that would not fit is left out with every
    size after it (appended to left_out)."""
    rows = []
    last = None  # (bytes moved, seconds) of the size before
    for i, nbytes in enumerate(sizes):
        estimate = 0.0 if last is None else last[1] * work(nbytes, repeats) / last[0]
        if not starts(until, estimate):
            if left_out is not None:
                left_out.extend(sizes[i:])
            break
        began = time.monotonic()
        for impl, barrier in impls_for(nbytes):
            bar.set_description(f"{impl.name} {size_name(nbytes)}")
            rows.append(harness.measure(impl, "allreduce", nbytes, nbytes // 4, "float32", "sum", barrier,
                                        repeats=repeats))
            bar.update()
        free_device_memory()
        last = (work(nbytes, repeats), time.monotonic() - began)
    return rows


_cupy = None


def free_device_memory() -> None:
    if _cupy is not None:
        _cupy.get_default_memory_pool().free_all_blocks()


def ipc_known() -> bool:
    """Whether this build reads RINGREDUCE_CUDA_IPC (core/config.py has a field for it)."""
    from ringreduce.core.config import Config
    return any("ipc" in name for name in Config.__dataclass_fields__)


def main(argv=None) -> None:
    global _cupy
    args = parse_args(argv)
    xp, gpu = np, "no GPU (--dry: numpy stands in for cupy)"
    if not args.dry:
        import cupy as xp
        _cupy = xp
    if not ipc_known():  # the IPC phase then runs staged, and a note says so: not a warning per rank and init
        warnings.filterwarnings("ignore", message=f"{IPC_VARIABLE} is not a ringreduce setting")
    os.environ[IPC_VARIABLE] = "0"
    rr.init()
    n, lead = rr.size(), rr.rank() == 0
    if xp is not np:
        xp.cuda.Device(rr.local_rank() % xp.cuda.runtime.getDeviceCount()).use()
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gpu = f"{xp.cuda.runtime.getDeviceCount()} GPU(s) ({name}), cupy {xp.__version__}"
    notes = []
    gloo_why = "--no-gloo" if args.no_gloo else start_gloo(args.dry)
    if gloo_why:
        notes.append(f"gloo: n/a ({gloo_why})")
    else:
        import torch
        import torch.distributed as dist
        notes.append(f"gloo: torch {torch.__version__}, {'CPU tensors (--dry)' if args.dry else 'CUDA tensors'}")
    mixed_xp = np if rr.rank() % 2 else xp

    def phase_staged(nbytes):
        count = nbytes // 4
        impls = [(rr_impl("staged", xp, count), rr.barrier), (rr_impl("numpy", np, count), rr.barrier)]
        if not gloo_why:
            impls.append((gloo_impl(count, args.dry), dist.barrier))
        if not args.no_mixed:
            impls.append((rr_impl("mixed", mixed_xp, count), rr.barrier))
        return impls

    per_size = 2 + (not gloo_why) + (not args.no_mixed) + (not args.no_ipc)
    bar = harness.progress(len(args.sizes) * per_size, lead and not args.no_progress)
    began = time.monotonic()
    shares = (STAGED_SHARE if not args.no_ipc else LAST_SHARE, LAST_SHARE)
    until = [began + share * args.seconds if args.seconds > 0 else None for share in shares]
    left_out = {"staged": [], "ipc": []}
    rows = measure_phase(phase_staged, args.sizes, args.repeats, bar, until[0], left_out["staged"])
    if not args.no_ipc:
        rr.shutdown()
        os.environ[IPC_VARIABLE] = "1"
        rr.init()
        rows += measure_phase(lambda nbytes: [(rr_impl("ipc", xp, nbytes // 4), rr.barrier)], args.sizes,
                              args.repeats, bar, until[1], left_out["ipc"])
        if not ipc_known():
            notes.append(f"IPC: this build does not read {IPC_VARIABLE}: the IPC column ran the staged path")
        elif getattr(rr.core.communicator().ring, "ipc", None) is not True:  # the ring's agreement (core/device_ipc.py)
            notes.append("IPC: the ranks agreed on the staged path (fallback: IPC refused or not permitted here): "
                         "the IPC column ran staged")
    if xp is not np:
        from ringreduce.core import cuda
        unpinned = cuda.ring_device(xp.cuda.Device().id).counts().get("unpinned", 0)
        if int(rr.allreduce(np.array([unpinned], np.int64), op="max")[0]):
            notes.append("the driver would not pin host memory (cuMemHostRegister refused): the staged path's "
                         "copies ran from and to pageable memory")
    for phase, sizes in left_out.items():
        if sizes:
            notes.append(f"time: the {phase} phase left out {', '.join(size_name(b) for b in sizes)} "
                         f"(--seconds {args.seconds:g}: they would not have fitted)")
    bar.close()
    if lead:
        title = (f"allreduce float32 sum, N={n} ranks sharing {gpu}, {platform.node()}, {os.cpu_count()} cores, "
                 f"{time.strftime('%Y-%m-%d %H:%M')}, ringreduce {rr.__version__}")
        columns = BUSBW_COLUMNS if not args.dry else {**BUSBW_COLUMNS, "gloo": "gloo CPU"}
        print(report(rows, title, notes, columns), flush=True)
    if not gloo_why:
        dist.destroy_process_group()
    rr.shutdown()


if __name__ == "__main__":
    main()
