"""Zero-copy shared-memory ring against the copying path, in one run.

    ringrun -np 2 python benchmarks/shm_zerocopy_bench.py
    ringrun -np 4 python benchmarks/shm_zerocopy_bench.py --mib 1,4,16,64,256

Every rank of a one-host run has both ring links through shared memory, so
`Comm.set_zero_copy` switches its path between operations (what
RINGREDUCE_SHM_ZEROCOPY=0/1 chooses at init). The two paths run interleaved,
repeat by repeat, so load on the machine falls on both alike; time is the
median over repeats of the slowest rank's mean over back-to-back float32 sum
allreduces (out of place). busbw = bytes * 2(N-1)/N / time (harness.py).

Roofline: what this machine's memcpy and numpy add allow, measured in the
same run by rank 0 alone (the others wait in a barrier) on arrays of one
chunk (bytes / N), the size each step works on. Per rank and chunk byte the
zero-copy schedule does N-1 reductions (read 2 streams, write 1: one numpy
add) and 2N-1 copies (the first step's send, the forward of the finished
chunk, N-2 AllGather forwards, N-1 AllGather copies into the output). The
copying path does the same N-1 reductions and 4N-4 copies (each of 2N-2
steps copies into the mapping and out of it). With N ranks on C cores,
min(N, C) of them run at once, so

    bound time = N / min(N, C) * chunk * ((N-1) / add_rate + (2N-1) / memcpy_rate)

and the roofline column is busbw / (bytes * 2(N-1)/N / bound time): the
share of the zero-copy schedule's own memory work the path achieves. It
ignores that concurrent ranks share memory bandwidth and wake-up latency, so
it is an upper bound, never reached.

CPU columns: CPU seconds (time.process_time) per operation, summed over the
ranks, median over repeats: the work each path costs, which load on the
machine moves less than wall time. They include the yields of a waiting
rank (RINGREDUCE_SPIN); with RINGREDUCE_SPIN=0 a waiting rank sleeps in poll
and costs nothing, so that run shows the work alone. cpu ratio = copying /
zero-copy (above 1: zero copy costs less).

CMA columns (where the ranks agreed on Cross Memory Attach at init,
RINGREDUCE_SHM_CMA=1, the default): the same operations with each rank
reading its neighbour's chunks by process_vm_readv (csrc/schedule/cma.c), a third
path interleaved with the other two; cma/copy and cma/zc are busbw ratios.

Mapped columns (with the CMA path): the CMA path once more, on arrays
allocated by rr.shared_empty (input and output): each rank maps its
neighbour's arrays and reduces straight out of them, no kernel copy
(csrc/memory/peer_map.h); a fourth path interleaved with the others, the same
repeats. mapped/copy and mapped/cma are busbw ratios; a run where the
mapped read did not serve every CMA operation there stops with an error
(below 1 MiB a chunk no path reads by CMA: csrc/schedule/cma.h).

Waits columns: voluntary context switches (getrusage ru_nvcsw: a rank
slept in poll for a peer) per operation, summed over the ranks, median over
repeats: how often the ring stalled on a neighbour, the thing running ahead
(ZC_SLICE in csrc/schedule/ring.c) is meant to cut.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce import collectives  # noqa: E402

MIB = 1 << 20
PATHS = (("zero-copy", True), ("copying", False))
CMA = "cma"  # a third column where RINGREDUCE_SHM_CMA=1 was agreed at init (csrc/schedule/cma.h)
MAPPED = "mapped"  # and a fourth: CMA on shared arrays (ringreduce/shared.py)


def rate(fn, nbytes: int, seconds: float = 0.2) -> float:
    """GB/s of fn() over nbytes of output, best of a few timed calls."""
    return harness.best_rate(fn, nbytes, seconds)


def machine_rates(chunk: int) -> tuple[float, float]:
    """(memcpy GB/s, numpy add GB/s) on chunk-sized float32 arrays, rank 0
    alone; every rank gets rank 0's numbers."""
    rr.barrier()
    got = np.zeros(2)
    if rr.rank() == 0:
        a = np.ones(max(chunk // 4, 16), np.float32)
        b, c = a.copy(), np.empty_like(a)
        got[:] = (rate(lambda: np.copyto(c, a), a.nbytes), rate(lambda: np.add(a, b, out=c), a.nbytes))
    return tuple(rr.broadcast(got, root=0))


def table(mibs: list[int], repeats: int) -> str:
    n, r = rr.size(), rr.rank()
    comm = collectives._state.comm
    cores = os.cpu_count() or 1
    if not comm.set_zero_copy(True):
        raise SystemExit("this rank's links are not both shared memory: run all ranks on one host, "
                         "RINGREDUCE_SHM_BYTES > 0 and a multiple of 64")
    factor = harness.BUSBW_FACTOR["allreduce"](n)
    cma_pid = comm.cma_pid
    paths = PATHS + ((CMA, True), (MAPPED, True)) if cma_pid else PATHS
    lines = [f"N = {n} on {cores} cores, float32 sum, out of place; busbw GB/s; "
             f"roofline = busbw / zero-copy bound",
             f"{'MiB':>4} {'memcpy':>7} {'add':>6} {'bound':>6} {'zero-copy':>10} {'copying':>8} "
             f"{'ratio':>6} {'zc roof':>8} {'copy roof':>9} {'zc cpu ms':>9} {'copy cpu ms':>11} "
             f"{'cpu ratio':>9} {'zc waits':>8} {'copy waits':>10} {'#wrong':>6}"
             + (f" {'cma':>7} {'cma/copy':>8} {'cma/zc':>6} {'cma cpu ms':>10} {'cma waits':>9}"
                f" {'mapped':>7} {'map/copy':>8} {'map/cma':>7} {'map cpu ms':>10}" if cma_pid else "")]
    for mib in mibs:
        count = mib * MIB // 4
        nbytes = count * 4
        iters = max(2, min(20, 128 // mib))
        x = np.full(count, r + 1, np.float32)
        out = np.empty_like(x)
        shared_x, shared_out = rr.shared_empty_like(x), rr.shared_empty_like(x)
        shared_x[:] = x
        arrays = {label: (shared_x, shared_out) if label == MAPPED else (x, out) for label, _ in paths}
        want = np.float32(n * (n + 1) // 2)
        samples = {label: [] for label, _ in paths}
        cpu = {label: [] for label, _ in paths}
        waits = {label: [] for label, _ in paths}
        wrong = 0
        for rep in range(repeats + 1):  # the first round warms up
            for label, on in paths:
                comm.set_zero_copy(on)
                comm.set_cma(cma_pid if label in (CMA, MAPPED) else 0)
                src, out = arrays[label]
                out.fill(0)
                mapped_before, cma_before = comm.mapped_ops(), comm.cma_ops()
                rr.barrier()
                t, c = time.perf_counter(), time.process_time()
                w = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                for _ in range(iters):
                    rr.allreduce(src, op="sum", out=out)
                if rep:
                    spent = (time.process_time() - c) / iters
                    slept = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - w) / iters
                    samples[label].append(harness.slowest((time.perf_counter() - t) / iters))
                    total = rr.allreduce(np.array([spent, slept]), op="sum")
                    cpu[label].append(float(total[0]))
                    waits[label].append(float(total[1]))
                wrong += int(np.count_nonzero(out != want))
                mapped, took_cma = comm.mapped_ops() - mapped_before, comm.cma_ops() - cma_before
                if mapped != (took_cma if label == MAPPED else 0):
                    raise SystemExit(f"rank {r}: the mapped read served {mapped} of the {took_cma} CMA "
                                     f"operations on path {label}")
        comm.set_zero_copy(True)
        comm.set_cma(cma_pid)
        cpy, add = machine_rates(nbytes // n)
        chunk = nbytes / n
        bound_s = n / min(n, cores) * chunk * ((n - 1) / (add * 1e9) + (2 * n - 1) / (cpy * 1e9))
        bound = nbytes * factor / bound_s / 1e9
        bw = {label: nbytes * factor / statistics.median(s) / 1e9 for label, s in samples.items()}
        wrong = int(rr.allreduce(np.array([wrong], np.int64), op="sum")[0])
        zc_cpu, copy_cpu = statistics.median(cpu["zero-copy"]), statistics.median(cpu["copying"])
        lines.append(f"{mib:>4} {cpy:>7.2f} {add:>6.2f} {bound:>6.2f} {bw['zero-copy']:>10.2f} "
                     f"{bw['copying']:>8.2f} {bw['zero-copy'] / bw['copying']:>6.2f} "
                     f"{bw['zero-copy'] / bound:>8.2f} {bw['copying'] / bound:>9.2f} {zc_cpu * 1e3:>9.1f} "
                     f"{copy_cpu * 1e3:>11.1f} {copy_cpu / zc_cpu:>9.2f} {statistics.median(waits['zero-copy']):>8.0f} "
                     f"{statistics.median(waits['copying']):>10.0f} {wrong:>6}"
                     + (f" {bw[CMA]:>7.2f} {bw[CMA] / bw['copying']:>8.2f} {bw[CMA] / bw['zero-copy']:>6.2f} "
                        f"{statistics.median(cpu[CMA]) * 1e3:>10.1f} {statistics.median(waits[CMA]):>9.0f}"
                        f" {bw[MAPPED]:>7.2f} {bw[MAPPED] / bw['copying']:>8.2f} {bw[MAPPED] / bw[CMA]:>7.2f}"
                        f" {statistics.median(cpu[MAPPED]) * 1e3:>10.1f}"
                        if cma_pid else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="1,4,16,64,256", help="MiB per allreduce, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rr.init()
    text = table([int(m) for m in args.mib.split(",")], args.repeats)
    if rr.rank() == 0:
        print(text, flush=True)
    rr.shutdown()


if __name__ == "__main__":
    main()
