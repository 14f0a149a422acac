"""The ring's staged path for device memory (csrc/device/device.h), on the emulated
device: its pointers fault when the host touches them and its queued work runs
late, so a segment sent before its copy finished, a slot reused too early or a
result read before the device is done shows up as wrong bits or a crash.

Device ranks and host ranks share one ring: every case runs with all ranks on
the device and with device and host ranks alternating, and each rank's result
must equal, bit for bit, what the host ring gives for the same inputs. A small
segment (RINGREDUCE_SEGMENT_BYTES) makes every chunk many segments, so all
staging slots turn over many times.

Each case runs on two devices: the emulated one (csrc/device/device_emulated.c) and
the CUDA one (csrc/device/cuda_device.c) over the host CUDA driver (tests/hostcuda.py),
whose kernels are reduce.cu compiled for the host and whose streams also run
late: the code that drives a GPU runs here, kernels and all.
"""
import os
import textwrap

import numpy as np
import pytest

from ranks import run_ranks

SETUP = """
from cases import DTYPES, OPS, make_input, np_dtype
from ringreduce import _core
from ringreduce.core import collectives
comm = collectives.communicator().comm
if kind == "emulated":
    dev = memory = _core.Device.emulated(patience)
else:
    from hostcuda import HostCuda
    memory = HostCuda()  # the driver libcuda.so.1 that the CUDA device opens too
    dev = memory.ring_device()
codes = {d: collectives.dtype_code(np_dtype(d)) for d in DTYPES}
opcodes = collectives.OPS

class Buf:
    # An array's bytes in emulated device memory.
    def __init__(self, a):
        self.nbytes, self.ptr = a.nbytes, memory.alloc(max(a.nbytes, 1))
        memory.write(self.ptr, a.tobytes())
    def get(self, dtype):
        return np.frombuffer(memory.read(self.ptr, self.nbytes), dtype=dtype).copy()

def on_device(mode):
    return mode == "device" or (mode == "mixed" and rr.rank() % 2 == 0)

def host_allreduce(x, dtype, op):
    out = np.empty_like(x)
    comm.allreduce(x.view(np.uint8), out.view(np.uint8), codes[dtype], opcodes[op])
    return out
"""


def job(body: str, mode: str = "device", patience: int = 2, kind: str = "emulated") -> str:
    return f"mode, patience, kind = {mode!r}, {patience}, {kind!r}\n" + SETUP + textwrap.dedent(body)


@pytest.fixture(params=["emulated", "hostcuda"])
def device(request):
    """(kind, environment) for the ranks: the CUDA kind finds the host driver
    through LD_LIBRARY_PATH; both run queued work late by the same rule."""
    if request.param == "emulated":
        return "emulated", {}
    folder = request.getfixturevalue("hostcuda_dir")
    return "hostcuda", {"LD_LIBRARY_PATH": f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def env_for(device, patience, **extra):
    kind, env = device
    return {**env, "HOSTCUDA_PATIENCE": str(patience), **extra}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("mode", ["device", "mixed"])
@pytest.mark.parametrize("patience", [0, 2])
def test_allreduce_on_device_equals_the_host_ring(tmp_path, device, n, mode, patience):
    ranks = run_ranks(n, job("""
        bad = []
        for dtype in DTYPES:
            for op in OPS:
                for count in [0, 1, rr.size() - 1, 2 * rr.size() + 1, 5_003, 40_001]:
                    x = make_input(rr.rank(), (count,), dtype, op)
                    want = host_allreduce(x, dtype, op)  # checked against numpy in test_allreduce.py
                    in_place = count % 2 == 1
                    if on_device(mode):
                        src = Buf(x)
                        dst = src if in_place else Buf(np.zeros_like(x))
                        comm.allreduce_device(dev, src.ptr, dst.ptr, x.nbytes, codes[dtype], opcodes[op])
                        got = dst.get(x.dtype)
                        if not in_place and src.get(x.dtype).tobytes() != x.tobytes():
                            bad.append(("input changed", dtype, op, count))
                    else:
                        got = host_allreduce(x, dtype, op)
                    if got.tobytes() != want.tobytes():
                        bad.append((dtype, op, count))
        result = bad
    """, mode, patience, device[0]), tmp_path, env=env_for(device, patience, RINGREDUCE_SEGMENT_BYTES="1024"),
        timeout=240)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result[:5]}"


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("mode", ["device", "mixed"])
@pytest.mark.parametrize("patience", [0, 2])
def test_reduce_scatter_allgather_broadcast_on_device(tmp_path, device, n, mode, patience):
    ranks = run_ranks(n, job("""
        out = {}
        N, r = rr.size(), rr.rank()
        for count in [0, 1, N - 1, 3 * N + 2, 30_011]:
            x = make_input(r, (count,), "float32", "sum")
            if on_device(mode):
                src, dst = Buf(x), Buf(np.zeros_like(x))
                comm.reduce_scatter_device(dev, src.ptr, dst.ptr, x.nbytes, codes["float32"], opcodes["sum"])
                got = dst.get(x.dtype)
            else:
                got = np.zeros_like(x)
                comm.reduce_scatter(x, got, codes["float32"], opcodes["sum"])
            lo, hi = collectives.chunk_bounds(count, N, r)
            out[("rs", count)] = got[lo:hi]
            out[("ar", count)] = host_allreduce(x, "float32", "sum")[lo:hi]

            rows = [(count + i * 7) % 50_000 for i in range(N)]  # uneven blocks, some empty
            nbytes = [k * 2 for k in rows]
            full = np.zeros(sum(rows), dtype=np.int16)
            at = sum(rows[:r])
            full[at:at + rows[r]] = np.arange(rows[r], dtype=np.int16) + r
            if on_device(mode):
                buf = Buf(full)
                comm.allgather_device(dev, buf.ptr, nbytes)
                out[("ag", count)] = buf.get(np.int16)
            else:
                comm.allgather(full.view(np.uint8), nbytes)
                out[("ag", count)] = full

            for root in range(N):
                b = np.arange(count, dtype=np.int64) * (root + 1) if r == root else np.zeros(count, np.int64)
                if on_device(mode):
                    buf = Buf(b)
                    comm.broadcast_device(dev, buf.ptr, b.nbytes, root)
                    b = buf.get(np.int64)
                else:
                    comm.broadcast(b, root)
                out[("bc", count, root)] = b
        result = out
    """, mode, patience, device[0]), tmp_path, env=env_for(device, patience, RINGREDUCE_SEGMENT_BYTES="512"),
        timeout=180)
    for count in [0, 1, n - 1, 3 * n + 2, 30_011]:
        for r in ranks:
            assert r.result[("rs", count)].tobytes() == r.result[("ar", count)].tobytes(), (count, r.rank)
        rows = [(count + i * 7) % 50_000 for i in range(n)]
        want = np.concatenate([np.arange(k, dtype=np.int16) + i for i, k in enumerate(rows)])
        for r in ranks:
            assert np.array_equal(r.result[("ag", count)], want), (count, r.rank)
            for root in range(n):
                assert np.array_equal(r.result[("bc", count, root)], np.arange(count, dtype=np.int64) * (root + 1))


def test_single_rank_copies_on_the_device(tmp_path, device):
    [rank] = run_ranks(1, job("""
        x = np.arange(1000, dtype=np.float64)
        src, dst = Buf(x), Buf(np.zeros_like(x))
        comm.allreduce_device(dev, src.ptr, dst.ptr, x.nbytes, codes["float64"], opcodes["avg"])
        result = dst.get(np.float64)
    """, kind=device[0]), tmp_path, env=env_for(device, 2))
    assert np.array_equal(rank.result, np.arange(1000, dtype=np.float64))


def test_a_failing_device_fails_every_rank(tmp_path, device):
    """Rank 1 hands the device a host pointer: its device refuses the work,
    rank 1 raises that, and the others learn rank 1 is gone, none hangs."""
    ranks = run_ranks(3, job("""
        x = np.ones(100_000, dtype=np.float32)
        try:
            if rr.rank() == 1:
                comm.allreduce_device(dev, x.ctypes.data, x.ctypes.data, x.nbytes, codes["float32"], opcodes["sum"])
            else:
                src = Buf(x)
                comm.allreduce_device(dev, src.ptr, src.ptr, x.nbytes, codes["float32"], opcodes["sum"])
            result = "no error"
        except rr.RingReduceError as exc:
            result = (type(exc).__name__, str(exc))
    """, kind=device[0]), tmp_path, env=env_for(device, 2), timeout=60)
    kind, msg = ranks[1].result
    assert kind == "RingReduceError"
    assert ("host pointer" if device[0] == "emulated" else "cuMemcpyDtoHAsync failed: invalid argument") in msg, msg
    for r in (ranks[0], ranks[2]):
        assert r.result != "no error"
        assert r.result[0] == "PeerLostError" and "1" in r.result[1], r.result


def test_the_cuda_device_uses_its_driver_as_a_gpu_needs(tmp_path, hostcuda_dir):
    """On the host CUDA driver: the ring's copies to and from the host all use
    pinned memory (pageable ones would serialize with the network), work runs
    from a thread other than the one that made the device (the context is made
    current there), and dropping the device frees every stream, event,
    allocation and context reference it took."""
    env = {"LD_LIBRARY_PATH": str(hostcuda_dir), "RINGREDUCE_SEGMENT_BYTES": "4096"}
    ranks = run_ranks(3, job("""
        import gc, threading
        x = make_input(rr.rank(), (100_003,), "float32", "sum")
        src, dst = Buf(x), Buf(np.zeros_like(x))
        def reduce_on_another_thread():
            comm.allreduce_device(dev, src.ptr, dst.ptr, x.nbytes, codes["float32"], opcodes["avg"])
        t = threading.Thread(target=reduce_on_another_thread)
        t.start()
        t.join()
        same = dst.get(np.float32).tobytes() == host_allreduce(x, "float32", "avg").tobytes()
        comm.broadcast_device(dev, src.ptr, x.nbytes, 0)
        during = memory.stats()
        del dev
        gc.collect()
        result = same, during, memory.stats()
    """, kind="hostcuda"), tmp_path, env=env, timeout=60)
    for r in ranks:
        same, during, after = r.result
        assert same
        assert during["pageable_copies"] == 0 and during["sticky_error"] == 0
        # The host's kernels reduce in the pinned mirror: the device only copies.
        assert during["launches"] == 0 and during["contexts"] == 1 and during["pinned_blocks"] > 0
        assert {k: after[k] for k in ("contexts", "streams", "events", "device_blocks", "pinned_blocks")} == \
            dict(contexts=0, streams=0, events=0, device_blocks=0, pinned_blocks=0), after


@pytest.mark.parametrize("devices, ordinal, why", [(0, 0, "cuInit failed"), (1, 1, "invalid device ordinal")])
def test_no_usable_gpu_is_a_clear_error(tmp_path, hostcuda_dir, devices, ordinal, why):
    [rank] = run_ranks(1, f"""
        from hostcuda import HostCuda
        try:
            HostCuda().ring_device({ordinal})
            result = "no error"
        except rr.RingReduceError as exc:
            result = str(exc)
    """, tmp_path, env={"LD_LIBRARY_PATH": str(hostcuda_dir), "HOSTCUDA_DEVICES": str(devices)})
    assert why in rank.result and rank.result.startswith("CUDA"), rank.result


@pytest.mark.parametrize("mode", ["device", "mixed"])
def test_16_bit_average_on_device_keeps_the_range(tmp_path, device, mode):
    """The device's running-mean kernels give the host ring's bits at the edges
    of the float16/bfloat16 range, where a sum would overflow to inf."""
    ranks = run_ranks(3, job("""
        import ml_dtypes
        bad = []
        for dtype in ["float16", "bfloat16"]:
            info = ml_dtypes.finfo(np_dtype(dtype))
            big, tiny = float(info.max), float(info.smallest_subnormal)
            g = np.random.default_rng([rr.rank(), len(dtype)])
            for count in [5, 5_003]:
                x = np.concatenate([np.full(count, big), np.full(count, 40000.0 if dtype == "float16" else 3e38),
                                    np.full(count, big if rr.rank() % 2 else -big), np.full(count, tiny),
                                    g.uniform(-big, big, count)]).astype(np_dtype(dtype))
                want = host_allreduce(x, dtype, "avg")
                if on_device(mode):
                    src = Buf(x)
                    comm.allreduce_device(dev, src.ptr, src.ptr, x.nbytes, codes[dtype], opcodes["avg"])
                    got = src.get(x.dtype)
                else:
                    got = host_allreduce(x, dtype, "avg")
                if got.tobytes() != want.tobytes():
                    bad.append(("differs from the host ring", dtype, count))
                if got[:2 * count].tobytes() != x[:2 * count].tobytes() or got[3 * count:4 * count].tobytes() != x[3 * count:4 * count].tobytes():
                    bad.append(("equal inputs changed", dtype, count))
                if not np.isfinite(got.astype(np.float64)).all():
                    bad.append(("not finite", dtype, count))
        result = bad
    """, mode, 2, device[0]), tmp_path, env=env_for(device, 2, RINGREDUCE_SEGMENT_BYTES="1024"), timeout=180)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result[:5]}"


# A device array family (as ringreduce/core/cuda.py DeviceArrays) over the emulated
# device (csrc/device/device_emulated.c): the public collectives then run this
# rank's large operations on the ring's staged device path.
EMULATED_FAMILY = """
import contextlib
from ringreduce import _core
from ringreduce.core import collectives as C, cuda, device_ipc
device = _core.Device.emulated(0)

class Dev(np.ndarray):
    pass

def staged(src_nbytes, fill, run, read_into):
    # device buffers for the C call, the host arrays copied in and out
    ptrs = [device.alloc(max(n, 1)) for n in src_nbytes]
    for p, a in zip(ptrs, fill):
        device.write(p, a.tobytes())
    run(*ptrs)
    for p, a in zip(ptrs, read_into):
        if a is not None:
            a.view(np.uint8).reshape(-1)[:] = np.frombuffer(device.read(p, a.nbytes), np.uint8)

class Emulated:
    xp = np
    asarray = staticmethod(lambda x: x)
    on = staticmethod(lambda x: contextlib.nullcontext())
    to_host = staticmethod(lambda x: np.asarray(x))
    from_host = staticmethod(lambda a, like: a.view(Dev))
    def allreduce(self, ring, src, dst, code, opc, all_device):
        staged([src.nbytes, dst.nbytes], [src],
               lambda s, d: device_ipc.allreduce(ring, device, s, d, src.nbytes, code, opc, all_device), [None, dst])
    def allgather(self, ring, flat, nbytes, all_device):
        staged([flat.nbytes], [flat], lambda b: device_ipc.allgather(ring, device, b, nbytes, all_device), [flat])

cuda.is_device_array = lambda x: isinstance(x, Dev)
C.cuda.is_device_array = cuda.is_device_array
from ringreduce.core import arrays as core_arrays
core_arrays.device_arrays = Emulated
"""


def test_a_device_rank_beside_host_ranks_on_zero_copy_links_gets_the_right_sums(tmp_path):
    # Host and device ranks share one ring (docs/architecture.md), but the
    # zero-copy path sends slice-major and the staged device path
    # step-major: a large allreduce with one device rank beside host ranks
    # over shared-memory links must still give the right sums on every rank.
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        from ringreduce.core import collectives as C
        r = rr.rank()
        base = (np.arange((3 << 20) + 5) % 11).astype(np.float32)
        x = base * (r + 1)
        y = rr.allreduce(x.view(Dev) if r == 1 else x)
        g = rr.allgather((np.arange((3 << 20) + 1) + r).astype(np.float32).view(Dev if r == 1 else np.ndarray))
        ok_g = all(np.array_equal(g[k * ((3 << 20) + 1):(k + 1) * ((3 << 20) + 1)], np.arange((3 << 20) + 1) + k)
                   for k in range(3))
        z = rr.allreduce(x)  # all on the host again: the zero-copy path is back
        result = (bool(np.array_equal(np.asarray(y), base * 6)), bool(ok_g), bool(np.array_equal(z, base * 6)),
                  C.communicator().comm.zero_copy)
        """), tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "20"})
    for k in ranks:
        assert k.result == (True, True, True, True), (k.rank, k.result)


PATHS = """
def on_path(path):
    # Every rank takes the same host path from the next operation on (csrc/ring.c).
    pid = comm.cma_pid
    comm.set_zero_copy(path != "copy")
    comm.set_cma(pid if path == "cma" else 0)

def path_ops():
    return comm.cma_ops() + comm.zero_copy_ops()
"""


@pytest.mark.parametrize("mode", ["device", "mixed"])
@pytest.mark.parametrize("patience", [0, 2])
def test_staged_ranks_take_every_host_path_with_the_host_bits(tmp_path, device, mode, patience):
    """A device rank runs the host ring on its pinned mirror, so with chunks
    big enough for zero copy (2 MiB) and Cross Memory Attach (1 MiB) every
    rank, device or host, takes that path, and the bits are the host ring's.
    Patience 0: no trip down runs until the ring waits for it, so a chunk read
    before its ticket would give stale bytes."""
    ranks = run_ranks(3, job(PATHS + textwrap.dedent("""
        assert comm.zero_copy and comm.cma_pid, "the ranks should agree on zero copy and CMA"
        N, r = rr.size(), rr.rank()
        bad = []
        for path in ["cma", "zc", "copy"]:
            for dtype, op in [("float32", "sum"), ("float16", "avg"), ("int32", "max"), ("float64", "avg")]:
                count = N * (2_400_000 // np_dtype(dtype).itemsize + 7) + 1  # chunks of about 2.3 MiB, uneven
                x = make_input(r, (count,), dtype, op)
                on_path(path)
                want = host_allreduce(x, dtype, op)
                before = path_ops()
                if on_device(mode):
                    src, dst = Buf(x), Buf(np.zeros_like(x))
                    comm.allreduce_device(dev, src.ptr, dst.ptr, x.nbytes, codes[dtype], opcodes[op])
                    got = dst.get(x.dtype)
                else:
                    got = host_allreduce(x, dtype, op)
                if got.tobytes() != want.tobytes():
                    bad.append(("allreduce", path, dtype, op))
                if path_ops() - before != (path != "copy"):
                    bad.append(("path not taken", path, dtype, op))
            count = N * (600_000 + 7) + 1
            x = make_input(r, (count,), "float32", "sum")
            lo, hi = collectives.chunk_bounds(count, N, r)
            want = host_allreduce(x, "float32", "sum")[lo:hi]
            if on_device(mode):
                src, dst = Buf(x), Buf(np.zeros_like(x))
                comm.reduce_scatter_device(dev, src.ptr, dst.ptr, x.nbytes, codes["float32"], opcodes["sum"])
                got = dst.get(x.dtype)[lo:hi]
            else:
                got = np.zeros_like(x)
                comm.reduce_scatter(x, got, codes["float32"], opcodes["sum"])
                got = got[lo:hi]
            if got.tobytes() != want.tobytes():
                bad.append(("reduce_scatter", path))
            rows = [1_100_000 + 3 * k for k in range(N)]  # int16 blocks over 2 MiB
            full = np.zeros(sum(rows), dtype=np.int16)
            at = sum(rows[:r])
            full[at:at + rows[r]] = np.arange(rows[r], dtype=np.int16) + r
            nbytes = [k * 2 for k in rows]
            if on_device(mode):
                buf = Buf(full)
                comm.allgather_device(dev, buf.ptr, nbytes)
                full = buf.get(np.int16)
            else:
                comm.allgather(full.view(np.uint8), nbytes)
            want = np.concatenate([np.arange(k, dtype=np.int16) + i for i, k in enumerate(rows)])
            if not np.array_equal(full, want):
                bad.append(("allgather", path))
        on_path("cma")
        result = bad
    """), mode, patience, device[0]), tmp_path, env=env_for(device, patience, RINGREDUCE_SHM_CMA="1"),
        timeout=300)
    for r in ranks:
        assert r.result == [], f"rank {r.rank}: {r.result[:5]}"


def test_a_64_mib_allreduce_costs_a_few_device_operations_per_chunk(tmp_path):
    """The staged path moves whole chunks: N copies down, N up and N + 1
    tickets per rank, whatever the size, not a few per 256 KiB segment. A
    64 MiB allreduce at N = 4 stays within 4N + 8 device operations (copies
    and tickets) on every rank, and gives the exact sum."""
    n = 4
    ranks = run_ranks(n, job(PATHS + textwrap.dedent("""
        N, r = rr.size(), rr.rank()
        count = (64 << 20) // 4
        x = (np.arange(count, dtype=np.int64) % 251 + r).astype(np.float32)
        src = Buf(x)
        del x
        before, paths = dev.counts(), path_ops()
        comm.allreduce_device(dev, src.ptr, src.ptr, count * 4, codes["float32"], opcodes["sum"])
        after = dev.counts()
        want = (np.arange(count, dtype=np.int64) % 251 * N + N * (N - 1) // 2).astype(np.float32)
        right = bool(np.array_equal(src.get(np.float32), want))
        result = {k: after[k] - before[k] for k in after}, path_ops() - paths, right
    """)), tmp_path, env=env_for(("emulated", {}), 2), timeout=300)
    for r in ranks:
        counts, paths, right = r.result
        assert right, f"rank {r.rank}: wrong sum"
        assert counts["copies"] == 2 * n and counts["copies"] + counts["events"] <= 4 * n + 8, (r.rank, counts)
        assert paths == 1, "a device rank takes the host ring's zero-copy or CMA path"


def test_small_messages_bounce_through_cached_pinned_buffers(tmp_path, device):
    """The GPU small-message path (ringreduce.core.cuda.through_bounce): one copy
    down into a pinned bounce buffer the device keeps, the host work in place
    there, one copy up: two device operations, and after the first message
    of a size no new pinned memory. Every slot taken: False, nothing done; a
    failing host step hands its slot back."""
    [rank] = run_ranks(1, job("""
        from ringreduce.core.cuda import through_bounce
        x = np.arange(1000, dtype=np.float32)
        src, dst = Buf(x), Buf(np.zeros_like(x))
        def double(view):
            a = np.frombuffer(view, dtype=np.float32)
            a *= 2
        out = {}
        pinned = lambda: memory.stats()["pinned_blocks"] if kind == "hostcuda" else 0
        assert through_bounce(dev, src.ptr, dst.ptr, x.nbytes, double)
        out["first"] = dst.get(np.float32)
        before, blocks = dev.counts(), pinned()
        assert through_bounce(dev, dst.ptr, dst.ptr, x.nbytes, double)
        after = dev.counts()
        out["second"] = dst.get(np.float32)
        out["ops"] = {k: after[k] - before[k] for k in after}
        out["new_blocks"] = pinned() - blocks
        held = [dev.bounce_down(src.ptr, 16) for _ in range(8)]
        out["ninth"] = through_bounce(dev, src.ptr, dst.ptr, 16, double)
        for slot, view in held:
            view.release()
            dev.bounce_release(slot)
        def fails(view):
            raise ValueError("host step failed")
        for _ in range(9):
            try:
                through_bounce(dev, src.ptr, dst.ptr, x.nbytes, fails)
            except ValueError:
                pass
        out["after_failures"] = through_bounce(dev, src.ptr, dst.ptr, x.nbytes, double)
        result = out
    """, kind=device[0]), tmp_path, env=env_for(device, 2))
    out = rank.result
    x = np.arange(1000, dtype=np.float32)
    assert np.array_equal(out["first"], 2 * x) and np.array_equal(out["second"], 4 * x)
    assert out["ops"]["copies"] == 2, out["ops"]
    assert out["new_blocks"] == 0
    assert out["ninth"] is False and out["after_failures"] is True


def test_a_small_message_never_waits_for_another_threads_collective(tmp_path, device):
    """Rank 0's thread holds the device in an allreduce that waits for rank 1;
    meanwhile rank 0's small message must not wait for it (rank 1 could be
    waiting on that very message elsewhere): through_bounce says False at
    once, and works again once the device is free."""
    ranks = run_ranks(2, job("""
        import threading, time
        from ringreduce.core.cuda import through_bounce
        x = np.ones(1 << 20, dtype=np.float32)
        big, small = Buf(x), Buf(x[:16])
        out = {}
        if rr.rank() == 0:
            t = threading.Thread(target=lambda: comm.allreduce_device(dev, big.ptr, big.ptr, x.nbytes,
                                                                       codes["float32"], opcodes["sum"]))
            t.start()
            time.sleep(0.5)  # the thread holds the device, waiting for rank 1
            start = time.monotonic()
            out["busy"] = through_bounce(dev, small.ptr, small.ptr, 64, lambda view: None)
            out["waited"] = time.monotonic() - start
            t.join()
            out["free"] = through_bounce(dev, small.ptr, small.ptr, 64, lambda view: None)
        else:
            time.sleep(3)
            comm.allreduce_device(dev, big.ptr, big.ptr, x.nbytes, codes["float32"], opcodes["sum"])
        out["sum"] = float(big.get(np.float32)[-1])
        result = out
    """, kind=device[0]), tmp_path, env=env_for(device, 2), timeout=60)
    out = ranks[0].result
    assert out["busy"] is False and out["waited"] < 1.0, out
    assert out["free"] is True and out["sum"] == 2.0 and ranks[1].result["sum"] == 2.0


def test_a_small_device_allreduce_goes_through_a_bounce_buffer_beside_host_ranks(tmp_path):
    """rr.allreduce of a small GPU array (collectives._allreduce_device): the
    device family's allreduce_small runs the host's small path in place in
    a bounce buffer (here: through_bounce on the emulated device, as
    ringreduce.core.cuda.DeviceArrays does with cupy pointers), beside host ranks,
    repeated so the planned fast path runs too; with no bounce buffer to be
    had it goes through the host instead. The sums are right either way."""
    ranks = run_ranks(3, job("""
        import contextlib
        from ringreduce.core import cuda
        from ringreduce.core.cuda import through_bounce

        class Dev(np.ndarray):
            pass

        class Family:
            xp = np
            busy = False
            calls = 0
            asarray = staticmethod(lambda x: x)
            on = staticmethod(lambda x: contextlib.nullcontext())
            to_host = staticmethod(lambda x: np.asarray(x).copy())
            from_host = staticmethod(lambda a, like: np.asarray(a).view(Dev))

            def allreduce_small(self, x, out, reduce):
                Family.calls += 1
                if Family.busy:
                    return None
                a = np.asarray(x)
                src, dst = Buf(a), Buf(np.zeros_like(a))
                work = lambda view: reduce(np.frombuffer(view, dtype=a.dtype).reshape(a.shape))
                return dst.get(a.dtype).reshape(a.shape).view(Dev) \\
                    if through_bounce(dev, src.ptr, dst.ptr, a.nbytes, work) else None

        family = Family()
        cuda.is_device_array = lambda x: isinstance(x, Dev)
        collectives.cuda.is_device_array = cuda.is_device_array
        from ringreduce.core import arrays as core_arrays
        core_arrays.device_arrays = lambda: family
        r = rr.rank()
        got = []
        for busy in (False, False, False, True):
            Family.busy = busy
            x = (np.arange(1000) % 7 + r).astype(np.float32)
            y = rr.allreduce(x.view(Dev) if r % 2 == 0 else x, op="sum")
            got.append(bool(np.array_equal(np.asarray(y), (np.arange(1000) % 7 * 3 + 3).astype(np.float32))))
        result = got, Family.calls
    """), tmp_path, env=env_for(("emulated", {}), 2), timeout=60)
    for r in ranks:
        sums, calls = r.result
        assert sums == [True] * 4, (r.rank, sums)
        assert calls == (4 if r.rank % 2 == 0 else 0), (r.rank, calls)
