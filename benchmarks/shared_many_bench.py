"""Many shared arrays used in turn against the neighbour's cache of mappings.

    ringrun -np 2 python benchmarks/shared_many_bench.py
    ringrun -np 2 python benchmarks/shared_many_bench.py --arrays 8,16,17,32 --mib 16 --repeats 5

A reader keeps RR_PEER_MAPS (16) of its neighbour's regions mapped per ring
(csrc/memory/peer_map.h). With more live shared arrays than that allreduced in
turn, every operation misses: the reader maps the region afresh and takes a
page fault per page it reads, which costs more than the copy the mapped read
saves. Each row: K arrays of --mib MiB (float32, sum, in place), shared and
plain interleaved repeat by repeat so load falls on both alike; ms per
operation of the slowest rank, min .. max over repeats.
"""
import argparse
import time

import numpy as np

import ringreduce as rr
from ringreduce import collectives as C

from harness import slowest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arrays", default="8,20")
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rr.init()
    comm = C._state.comm
    count = (args.mib << 20) // 4
    if rr.rank() == 0:
        print(f"ranks {rr.size()}, {args.mib} MiB arrays, CMA pid {comm.cma_pid or 'off'}")
        print(f"{'arrays':>6} {'shared ms/op':>16} {'plain ms/op':>16}")
    for k in (int(x) for x in args.arrays.split(",")):
        sets = {True: [rr.shared_empty(count, np.float32) for _ in range(k)],
                False: [np.empty(count, np.float32) for _ in range(k)]}
        times = {True: [], False: []}
        for a in sets[True] + sets[False]:
            a[:] = 1
            rr.allreduce(a, out=a)  # warm: every page touched, regions mapped
        for _ in range(args.repeats):
            for shared in (True, False):
                t = time.perf_counter()
                for a in sets[shared]:
                    rr.allreduce(a, out=a)
                times[shared].append(slowest((time.perf_counter() - t) / k * 1e3))
        if rr.rank() == 0:
            cell = {s: f"{min(v):.2f} .. {max(v):.2f}" for s, v in times.items()}
            print(f"{k:>6} {cell[True]:>16} {cell[False]:>16}")
        del sets
    rr.shutdown()


if __name__ == "__main__":
    main()
