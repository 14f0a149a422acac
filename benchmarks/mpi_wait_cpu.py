"""CPU a rank burns while it waits for a late peer under mpirun.

    mpirun -np 2 python benchmarks/mpi_wait_cpu.py [--late 3] [--trials 5]

Rank 1 arrives `--late` seconds after rank 0 at an allreduce; rank 0 reports
its wall and CPU time across that wait. MPI has no poll(2), so the transport
naps between request tests; this shows what that costs (issue: under 0.1 s of
CPU per 3 s of waiting). Rank 0 prints one line per trial and the median.
"""
import argparse
import statistics
import time

import numpy as np

import ringreduce as rr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--late", type=float, default=3.0)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    rr.init(backend="mpi")
    cpus = []
    for trial in range(args.trials):
        rr.allreduce(np.ones(4))  # meet first: the wait below is the late peer's alone
        if rr.rank() == 1:
            time.sleep(args.late)
        wall, cpu = time.monotonic(), time.process_time()
        rr.allreduce(np.ones(1000))
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        if rr.rank() == 0:
            cpus.append(cpu)
            print(f"trial {trial}: waited {wall:.2f} s, CPU {cpu * 1000:.1f} ms")
    if rr.rank() == 0:
        print(f"median CPU per {args.late:g} s wait: {statistics.median(cpus) * 1000:.1f} ms "
              f"(worst {max(cpus) * 1000:.1f} ms) over {args.trials} trials")


if __name__ == "__main__":
    main()
