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
    from ringreduce.core.communicator import current as _state
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
    from ringreduce.core.communicator import current as _state
    return {"source": _state.world.source, "sum": float(rr.allreduce(np.full(300_000, 1.0))[0])}


def device():
    """The staged ring over MPI: even ranks on the emulated device, odd ones on
    the host; every result bit-identical to the host ring's."""
    rr.init()
    from ringreduce import _core
    from ringreduce.core import collectives
    comm, dev = collectives.communicator().comm, _core.Device.emulated(0)
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


def late_peer():
    """Rank 1 comes 3 s late: rank 0's CPU time across the wait."""
    import time
    rr.init()
    rr.allreduce(np.ones(4))
    if rr.rank() == 1:
        time.sleep(3)
    wall, cpu = time.monotonic(), time.process_time()
    y = rr.allreduce(np.ones(1000))
    return {"wall": time.monotonic() - wall, "cpu": time.process_time() - cpu, "sum": float(y[0])}


def stalled_mid_ring():
    """Rank 0 stops rank 1 (SIGSTOP) in the middle of a large allreduce and
    wakes it 1.2 s later; with RINGREDUCE_TIMEOUT=1 both fail with requests in
    flight. Each then frees the collective's buffer and does more MPI work in
    the same process: no MPI call may touch the freed memory."""
    import signal
    import threading
    import time
    from mpi4py import MPI
    rr.init()
    world = MPI.COMM_WORLD
    pids = world.allgather(os.getpid())
    rr.allreduce(np.ones(4))
    x = np.ones(32 << 20, dtype=np.float32)  # 128 MiB, munmap'ed when freed
    out = {}
    if rr.rank() == 0:
        def stall():
            # Rank 0 reduces chunk 0 first: once a quarter of it is done, the
            # ring is surely mid-message.
            while x[len(x) // 8] != 2.0:
                time.sleep(0.0005)
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(1.2)
            os.kill(pids[1], signal.SIGCONT)
        threading.Thread(target=stall, daemon=True).start()
    try:
        rr.allreduce(x, out=x)
        out["error"] = None
    except rr.RingReduceError as exc:
        out["error"] = (type(exc).__name__, exc.rank)
    del x
    time.sleep(2.5)  # rank 1 runs again; both ranks have given up
    canary = [np.full(1 << 20, 7.0) for _ in range(8)]
    out["world_sum"] = world.allreduce(rr.rank() + 1)
    big = np.ones(4 << 20)
    world.Allreduce(MPI.IN_PLACE, big)
    out["big_ok"] = bool((big == 2).all())
    out["canary_ok"] = all((c == 7.0).all() for c in canary)
    return out


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    result = {"correctness": correctness, "subcomm": subcomm, "socket": socket, "raises": raises,
              "device": device, "late_peer": late_peer, "stalled_mid_ring": stalled_mid_ring}[mode]()
    with open(f"{out}.rank{rr.rank() if mode != 'subcomm' else __import__('mpi4py.MPI').MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)
