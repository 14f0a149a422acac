"""Runs under mpirun for tests/test_mpi.py: `mpirun -np N python tests/mpi_job.py MODE OUT`.
Each rank writes what it saw to OUT.rank<r>.pkl."""
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringreduce as rr  # noqa: E402
from cases import check_all_allreduce, digest  # noqa: E402


def correctness():
    rr.init()  # under mpirun: the MPI backend by default
    from ringreduce.collectives import _state
    out = {"source": _state.world.source, "allreduce": check_all_allreduce(rr)}
    x = np.arange(100_003, dtype=np.float64) * (rr.rank() + 1)
    out["reduce_scatter"] = (rr.reduce_scatter(x), rr.allreduce(x))
    out["allgather"] = rr.allgather(np.full((rr.rank() + 1, 2), rr.rank(), dtype=np.int32))
    out["broadcast"] = rr.broadcast(np.full(300_001, rr.rank(), dtype=np.int64), root=rr.size() - 1)
    rr.barrier()
    return out


def subcomm():
    """Two process sets, each with its own ring: even and odd ranks."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    sub = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    rr.init(comm=sub)
    y = rr.allreduce(np.full(200_000, world.Get_rank() + 1.0))
    small = rr.allreduce(np.array([world.Get_rank()]))
    return {"rank": rr.rank(), "size": rr.size(), "color": world.Get_rank() % 2,
            "big": float(y[0]), "uniform": bool((y == y[0]).all()), "small": int(small[0]), "digest": digest(y)}


def socket():
    rr.init(backend="socket")  # TCP ring, bootstrapped through MPI: no variables needed
    from ringreduce.collectives import _state
    return {"source": _state.world.source, "sum": float(rr.allreduce(np.full(300_000, 1.0))[0])}


def device():
    """The staged ring over MPI: even ranks on the emulated device, odd ones on
    the host; every result bit-identical to the host ring's."""
    rr.init()
    from ringreduce import _core, collectives
    comm, dev = collectives._state.comm, _core.Device.emulated(0)
    bad = []
    for dtype, code in [(np.float32, _core.FLOAT32), (np.float16, _core.FLOAT16), (np.int64, _core.INT64)]:
        for count in [1, rr.size() + 1, 40_001, 300_007]:
            x = ((np.arange(count) * 7 + rr.rank()) % 13).astype(dtype)
            want = np.empty_like(x)
            comm.allreduce(x, want, code, _core.SUM)
            if rr.rank() % 2 == 0:
                ptr = dev.alloc(x.nbytes)
                dev.write(ptr, x.tobytes())
                comm.allreduce_device(dev, ptr, ptr, x.nbytes, code, _core.SUM)
                got = np.frombuffer(dev.read(ptr, x.nbytes), dtype=dtype)
                dev.free(ptr)
            else:
                got = np.empty_like(x)
                comm.allreduce(x, got, code, _core.SUM)
            if got.tobytes() != want.tobytes():
                bad.append((np.dtype(dtype).name, count))
    return bad


def raises():
    rr.init()
    rr.allreduce(np.ones(10))
    if rr.rank() == 1:
        raise ValueError("rank 1 gives up")
    rr.allreduce(np.ones(1 << 20, dtype=np.float32))
    import time
    time.sleep(120)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    result = {"correctness": correctness, "subcomm": subcomm, "socket": socket, "raises": raises,
              "device": device}[mode]()
    with open(f"{out}.rank{rr.rank() if mode != 'subcomm' else __import__('mpi4py.MPI').MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)
