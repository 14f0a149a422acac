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

from emulated_family import emulated_family
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

def ring_device_allreduce(family, ring, src, dst, code, opc, all_device):
    # A device family's allreduce after its header pass: the ring's device path on dev (device_ipc.allreduce).
    from ringreduce.core import device_ipc
    s, d = Buf(np.asarray(src)), Buf(np.asarray(dst))
    device_ipc.allreduce(ring, dev, s.ptr, d.ptr, s.nbytes, code, opc, all_device)
    np.asarray(dst).reshape(-1).view(np.uint8)[:] = d.get(np.uint8)
    memory.free(s.ptr)
    memory.free(d.ptr)

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
    rank 1 raises that, naming itself, and the others learn rank 1 is gone,
    none hangs."""
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
            result = (type(exc).__name__, str(exc), exc.rank)
    """, kind=device[0]), tmp_path, env=env_for(device, 2), timeout=60)
    kind, msg, at_fault = ranks[1].result
    assert kind == "RingReduceError"
    assert at_fault == 1 and msg.startswith("rank 1: "), (at_fault, msg)
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


def test_a_driver_that_will_not_pin_host_memory_leaves_it_pageable_and_the_results_right(tmp_path, hostcuda_dir):
    """On the host CUDA driver refusing cuMemHostRegister (as some sandboxed
    drivers do): the mirror and the bounce buffers stay pageable (the device
    counts them: counts()["unpinned"]), CUDA's copies to and from them run
    the pageable way, and the staged allreduce (Cross Memory Attach on, two
    ranks) and the small trip give the host ring's bits; dropping the device
    unmaps them."""
    env = {"LD_LIBRARY_PATH": str(hostcuda_dir), "HOSTCUDA_HOST_REGISTER": "0", "RINGREDUCE_SHM_CMA": "1"}
    ranks = run_ranks(2, job("""
        import gc
        ok = []
        for count in [100_003, 3 << 20]:  # 3 Mi floats: chunks past Cross Memory Attach's 1 MiB
            x = make_input(rr.rank(), (count,), "float32", "sum")
            src, dst = Buf(x), Buf(np.zeros_like(x))
            comm.allreduce_device(dev, src.ptr, dst.ptr, x.nbytes, codes["float32"], opcodes["sum"])
            ok.append(dst.get(np.float32).tobytes() == host_allreduce(x, "float32", "sum").tobytes())
            memory.free(src.ptr)
            memory.free(dst.ptr)
        small = Buf(make_input(rr.rank(), (10,), "int32", "sum"))
        got = dev.bounce_down(small.ptr, 40)
        ok.append(got is not None)
        if got is not None:
            slot, view = got
            ok.append(bytes(view[:40]) == make_input(rr.rank(), (10,), "int32", "sum").tobytes())
            view.release()
            dev.bounce_release(slot)
        during, unpinned = memory.stats(), dev.counts()["unpinned"]
        del dev
        gc.collect()
        result = ok, during, unpinned, memory.stats()
    """, kind="hostcuda"), tmp_path, env=env, timeout=120)
    for r in ranks:
        ok, during, unpinned, after = r.result
        assert ok == [True] * 4, ok
        assert unpinned > 0 and during["registered"] == 0 and during["pageable_copies"] > 0, (unpinned, during)
        assert during["sticky_error"] == 0, during
        assert after["pinned_blocks"] == 0 and after["contexts"] == 0, after


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


EMULATED_FAMILY = emulated_family(0)


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
    had it goes through the host instead. The sums are right either way. The
    first takes the ring's device path (where every rank is on a device it
    would agree on IPC, device_ipc.small_agrees_first), and meeting a host
    rank the ring stops asking."""
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
            ready = staticmethod(lambda x: None)
            allreduce = ring_device_allreduce

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
        result = got, Family.calls, collectives.communicator().ring.small_asks_ipc
    """), tmp_path, env=env_for(("emulated", {}), 2), timeout=60)
    for r in ranks:
        sums, calls, asks = r.result
        assert sums == [True] * 4, (r.rank, sums)
        # the first took the ring's device path (it would agree on IPC) and met the host rank: no more asking
        assert calls == (3 if r.rank % 2 == 0 else 0), (r.rank, calls)
        assert asks is (r.rank % 2 != 0), (r.rank, asks)


def test_a_small_message_from_a_fresh_thread_gets_its_pinned_buffer(tmp_path, hostcuda_dir):
    """The first small message of a thread that never ran a collective (an
    engine's or the user's): its bounce buffer is pinned memory, which CUDA
    registers only in a context current on the calling thread, so the device
    is made current there before the buffer is taken."""
    [rank] = run_ranks(1, job("""
        import threading
        from ringreduce.core.cuda import through_bounce
        x = np.arange(1000, dtype=np.float32)
        src = Buf(x)
        out = []
        def double(view):
            a = np.frombuffer(view, dtype=np.float32)
            a *= 2
        def first_message():
            try:
                out.append(through_bounce(dev, src.ptr, src.ptr, x.nbytes, double))
            except rr.RingReduceError as exc:
                out.append(str(exc))
        t = threading.Thread(target=first_message)
        t.start()
        t.join()
        result = out, src.get(np.float32)
    """, kind="hostcuda"), tmp_path, env={"LD_LIBRARY_PATH": str(hostcuda_dir)}, timeout=60)
    out, got = rank.result
    assert out == [True], out
    assert np.array_equal(got, 2 * np.arange(1000, dtype=np.float32))


def test_a_forked_child_lets_go_of_the_parents_cuda_device(tmp_path, hostcuda_dir):
    """CUDA does not survive fork, and the pinned mirror and bounce buffers
    are not inherited (MADV_DONTFORK): a child that inherited the ring's
    device gets a clear error if it uses it, and dropping it (its exit,
    a gc) touches neither the driver nor the absent pages, so the child
    does not crash; the parent's device keeps working."""
    [rank] = run_ranks(1, job("""
        import gc
        from ringreduce.core.cuda import through_bounce
        x = np.arange(1000, dtype=np.float32)
        src = Buf(x)
        assert through_bounce(dev, src.ptr, src.ptr, x.nbytes, lambda view: None)  # pinned memory taken
        pid = os.fork()
        if pid == 0:
            try:
                through_bounce(dev, src.ptr, src.ptr, x.nbytes, lambda view: None)
                code = 2
            except rr.RingReduceError as exc:
                code = 3 if "fork" in str(exc) else 4
            del dev
            gc.collect()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        def double(view):
            a = np.frombuffer(view, dtype=np.float32)
            a *= 2
        still = through_bounce(dev, src.ptr, src.ptr, x.nbytes, double)
        result = status, still, src.get(np.float32)
    """, kind="hostcuda"), tmp_path, env={"LD_LIBRARY_PATH": str(hostcuda_dir)}, timeout=60)
    status, still, got = rank.result
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, \
        f"child: {'signal %d' % os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exit %d' % os.WEXITSTATUS(status)}"
    assert still and np.array_equal(got, 2 * np.arange(1000, dtype=np.float32))


def test_a_device_rank_out_of_gpu_memory_refuses_before_data_moves(tmp_path):
    """A large GPU allreduce allocates its contiguous input and its result on
    the GPU; a rank whose allocation fails (cupy's OutOfMemoryError is a
    MemoryError) raises it before its header goes out, and the others raise
    MismatchError naming it at once, instead of waiting in the ring for a
    rank that will not come (and pairing with its next collective). The
    ring stays usable: the next allreduce gives the right sums everywhere."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        import time, types
        r = rr.rank()
        class OutOfMemory(MemoryError):
            pass
        def no_memory(*args, **kwargs):
            raise OutOfMemory("out of memory allocating 4194304 bytes")
        if r == 1:
            Emulated.xp = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
            Emulated.xp.empty_like = no_memory
        x = np.full(1 << 20, r + 1, dtype=np.float32)
        start = time.monotonic()
        try:
            rr.allreduce(x.view(Dev) if r % 2 == 1 else x, op="sum")
            first = "no error"
        except (MemoryError, rr.RingReduceError) as exc:
            first = (type(exc).__name__, str(exc))
        took = time.monotonic() - start
        Emulated.xp = np
        y = rr.allreduce(x.view(Dev) if r % 2 == 1 else x, op="sum")
        result = first, took, bool(np.array_equal(np.asarray(y), np.full(1 << 20, 6, dtype=np.float32)))
        """), tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "20"})
    kind, msg = ranks[1].result[0]
    assert kind == "OutOfMemory", ranks[1].result
    for k in (0, 2):
        first, took, _ = ranks[k].result
        assert first[0] == "MismatchError" and "rank 1" in first[1] and "out of memory" in first[1], first
        assert took < 10, took
    for k in ranks:
        assert k.result[2], (k.rank, "wrong sums after the refusal")


def test_a_small_device_allreduce_whose_gpu_fails_first_is_refused(tmp_path):
    """rr.allreduce of a small GPU array whose trip down fails (a CUDA
    error, GPU memory out) before this rank's host allreduce began: it
    raises that, and the host ranks beside it raise MismatchError naming it
    at once, instead of waiting for a collective that will not come; the
    ring stays usable. A failure after the host allreduce (the trip up) is
    this rank's alone: the others have their sums."""
    ranks = run_ranks(3, job("""
        import contextlib, time
        from ringreduce.core import cuda
        from ringreduce.core.cuda import through_bounce

        class Dev(np.ndarray):
            pass

        class Family:
            xp = np
            fail = None
            asarray = staticmethod(lambda x: x)
            on = staticmethod(lambda x: contextlib.nullcontext())
            to_host = staticmethod(lambda x: np.asarray(x).copy())
            from_host = staticmethod(lambda a, like: np.asarray(a).view(Dev))
            ready = staticmethod(lambda x: None)
            allreduce = ring_device_allreduce

            def allreduce_small(self, x, out, reduce):
                a = np.asarray(x)
                if Family.fail == "down":
                    raise rr.RingReduceError("CUDA: cuMemcpyDtoHAsync failed: an illegal memory access was encountered")
                src, dst = Buf(a), Buf(np.zeros_like(a))
                work = lambda view: reduce(np.frombuffer(view, dtype=a.dtype).reshape(a.shape))
                through_bounce(dev, src.ptr, dst.ptr, a.nbytes, work)
                if Family.fail == "up":
                    raise rr.RingReduceError("CUDA: cuMemcpyHtoDAsync failed: an illegal memory access was encountered")
                return dst.get(a.dtype).reshape(a.shape).view(Dev)

        family = Family()
        cuda.is_device_array = lambda x: isinstance(x, Dev)
        collectives.cuda.is_device_array = cuda.is_device_array
        from ringreduce.core import arrays as core_arrays
        core_arrays.device_arrays = lambda: family
        r = rr.rank()
        x = (np.arange(1000) % 7 + r).astype(np.float32)
        want = (np.arange(1000) % 7 * 3 + 3).astype(np.float32)
        rr.allreduce(x.view(Dev) if r == 0 else x)  # the ring's device path once: a host rank, so the bounce buffer
        out = []
        for fail in ("down", "up", None):
            Family.fail = fail if r == 0 else None
            start = time.monotonic()
            try:
                y = rr.allreduce(x.view(Dev) if r == 0 else x, op="sum")
                out.append(bool(np.array_equal(np.asarray(y), want)))
            except rr.RingReduceError as exc:
                out.append((type(exc).__name__, str(exc)[:300], time.monotonic() - start < 10))
        result = out
    """), tmp_path, env={**env_for(("emulated", {}), 2), "RINGREDUCE_TIMEOUT": "20"}, timeout=120)
    down, up, last = ranks[0].result
    assert down[0] == "RingReduceError" and "cuMemcpyDtoHAsync" in down[1], down
    assert up[0] == "RingReduceError" and "cuMemcpyHtoDAsync" in up[1], up
    assert last is True
    for k in (1, 2):
        down, up, last = ranks[k].result
        assert down[0] == "MismatchError" and "rank 0" in down[1] and "cuMemcpyDtoHAsync" in down[1] and down[2], down
        assert up is True and last is True, ranks[k].result


# A device array family over the test's device (emulated, or the CUDA device on the
# host driver), as ringreduce.core.cuda.DeviceArrays is over cupy: small
# collectives' data goes through cuda.SmallTrip on the ring's device, results
# come back as Dev arrays read out of device memory.
SMALL_FAMILY = """
import contextlib
from ringreduce.core import arrays as core_arrays, cuda

class Dev(np.ndarray):
    pass

def copy_up(host, ptr):
    memory.write(ptr, host.tobytes())

class Family:
    xp = np
    uploads = 0
    asarray = staticmethod(lambda x: x)
    on = staticmethod(lambda x: contextlib.nullcontext())
    to_host = staticmethod(lambda x: np.asarray(x).copy())
    from_host = staticmethod(lambda a, like: np.asarray(a).copy().view(Dev))

    ready = staticmethod(lambda x: None)

    def small_trip(self, x, down=True):
        a = np.ascontiguousarray(np.asarray(x))
        src = Buf(a)  # x in device memory
        return cuda.SmallTrip(dev if down else None, src.ptr, a.nbytes, lambda: a, copy_up)

    def result(self, trip, a, like):
        box = {}
        def alloc(h):
            box["buf"] = Buf(np.zeros_like(h))
            return box["buf"], box["buf"].ptr
        def upload(h):
            Family.uploads += 1
            return h.copy().view(Dev)
        got = trip.result(a, alloc, upload)
        return got.get(a.dtype).reshape(a.shape).view(Dev) if "buf" in box else got

family = Family()
cuda.is_device_array = lambda x: isinstance(x, Dev)
collectives.cuda.is_device_array = cuda.is_device_array
core_arrays.device_arrays = lambda: family
"""


@pytest.mark.parametrize("mode", ["device", "mixed"])
def test_small_collectives_on_device_bounce_with_the_host_bits(tmp_path, device, mode):
    """Small reduce_scatter, allgather, broadcast and alltoall of device arrays
    go through one of the device's pinned bounce buffers (cuda.SmallTrip): at
    most two device copies per rank and collective (down and up; an
    allgather's larger result goes up the pageable way), no pinned memory
    allocated once a size has passed (the host driver counts it), and the
    host ring's bits on every rank, beside host ranks too. With every bounce
    buffer taken they go through pageable memory: no device copy, the same
    bits."""
    ranks = run_ranks(3, job(SMALL_FAMILY + textwrap.dedent("""
        N, r = rr.size(), rr.rank()
        on = on_device(mode)
        wrap = (lambda a: a.view(Dev)) if on else (lambda a: a)
        pinned = lambda: memory.stats()["pinned_blocks"] if kind == "hostcuda" else 0
        bad, copies = [], {}

        def check(what, got, want):
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            for g, w in zip(got, want):
                if on and isinstance(w, np.ndarray) and w.dtype != np.int32 and not isinstance(g, Dev):
                    bad.append((what, "not a device array"))
                g, w = np.asarray(g), np.asarray(w)
                if g.shape != w.shape or g.dtype != w.dtype or g.tobytes() != w.tobytes():
                    bad.append(what)

        def run(what, f, x):
            before = dev.counts()["copies"]
            got = f(wrap(x))
            copies[what] = dev.counts()["copies"] - before
            check(what, got, f(x))  # the host ring's result

        def everything(tag):
            for dtype in ["float32", "bfloat16", "int16", "float64"]:
                for count in [0, 1, N + 1, 1000]:
                    x = make_input(r, (count,), dtype, "sum")
                    run((tag, "rs", dtype, count), rr.reduce_scatter, x)
                    run((tag, "ag", dtype, count), rr.allgather, x[:count // 2 + r] if count else x)
                    run((tag, "bc", dtype, count), lambda a: rr.broadcast(a, root=N - 1), x)
                    rows = make_input(r, (N * (count // 4 + 1), 3), dtype, "sum")
                    run((tag, "a2a", dtype, count), rr.alltoall, rows)

        everything("first")
        blocks = pinned()
        everything("again")
        new_blocks = pinned() - blocks
        held = [dev.bounce_down(Buf(np.zeros(4, np.float32)).ptr, 16) for _ in range(8)]
        x = make_input(r, (1000,), "float32", "sum")
        run(("held", "rs"), rr.reduce_scatter, x)
        run(("held", "bc"), lambda a: rr.broadcast(a, root=0), x)
        for slot, view in held:
            view.release()
            dev.bounce_release(slot)
        run(("free", "rs"), rr.reduce_scatter, x)
        result = bad, copies, new_blocks, Family.uploads
    """), mode, 2, device[0]), tmp_path, env=env_for(device, 2), timeout=120)
    for k in ranks:
        bad, copies, new_blocks, uploads = k.result
        assert bad == [], f"rank {k.rank}: {bad[:5]}"
        if mode == "mixed" and k.rank % 2 == 1:
            assert set(copies.values()) == {0} and uploads == 0, (k.rank, copies)
            continue
        assert max(copies.values()) <= 2, (k.rank, {w: c for w, c in copies.items() if c > 2})
        for (tag, kind, *rest), c in copies.items():
            if tag in ("first", "again") and kind in ("rs", "bc") and rest[1] >= 3:  # a chunk on every rank
                assert c == 2, (k.rank, tag, kind, rest, c)  # down and up through the bounce buffer
            if tag in ("first", "again") and kind == "ag" and rest[1] and rest[1] // 2 + k.rank:  # rows here
                assert c >= 1, (k.rank, tag, kind, rest, c)
        assert copies[("held", "rs")] == 0 and copies[("held", "bc")] == 0, copies
        assert copies[("free", "rs")] == 2, copies
        assert new_blocks == 0
        assert uploads > 0  # allgather's results, larger than the buffer


def test_a_small_messages_trip_up_never_waits_for_a_staged_collective(tmp_path, device):
    """Rank 0's small message has its bounce buffer when another thread starts
    a staged collective (cuda.staged) that holds the device until rank 1
    joins, and rank 1 joins only once rank 0's small message is done: the
    trip up must not wait for the collective (a deadlock across the two
    processes). It goes up another way (copy_up), its slot is parked and
    handed back when the collective ends: every slot is free again after."""
    ranks = run_ranks(2, job("""
        import threading, time
        from ringreduce.core import cuda
        go = os.environ["RR_TEST_GO"]
        x = np.ones(1 << 20, dtype=np.float32)
        big = Buf(x)
        out = {}
        if rr.rank() == 0:
            small = Buf(np.arange(16, dtype=np.float32))
            ups = []
            def copy_up(host, ptr):
                ups.append(host.nbytes)
                memory.write(ptr, host.tobytes())
            def collective():
                with cuda.staged(dev):
                    comm.allreduce_device(dev, big.ptr, big.ptr, x.nbytes, codes["float32"], opcodes["sum"])
            t = threading.Thread(target=collective)
            def work(view):
                np.frombuffer(view, np.float32)[:] *= 3
                t.start()
                while not cuda._gate(dev).lock.locked():  # the thread holds the device, waiting for rank 1
                    time.sleep(0.01)
                time.sleep(0.2)  # and is inside the C collective, holding the device's own lock
            start = time.monotonic()
            out["bounced"] = cuda.through_bounce(dev, small.ptr, small.ptr, 64, work, copy_up)
            out["took"] = time.monotonic() - start
            out["small"] = small.get(np.float32).tolist()
            out["ups"] = list(ups)
            open(go, "w").close()  # now rank 1 joins the collective
            t.join()
            out["parked"] = len(cuda._gate(dev).pending)
            ups.clear()
            out["after"] = [cuda.through_bounce(dev, small.ptr, small.ptr, 64, lambda v: None, copy_up)
                            for _ in range(9)]
            out["held"] = [dev.bounce_down(small.ptr, 4) is not None for _ in range(8)]
            out["ups_after"] = list(ups)
        else:
            while not os.path.exists(go):
                time.sleep(0.05)
            comm.allreduce_device(dev, big.ptr, big.ptr, x.nbytes, codes["float32"], opcodes["sum"])
        out["sum"] = float(big.get(np.float32)[-1])
        result = out
    """, kind=device[0]), tmp_path, env=env_for(device, 2, RR_TEST_GO=str(tmp_path / "go")), timeout=60)
    out = ranks[0].result
    assert out["bounced"] is True and out["took"] < 2.0, out
    assert out["small"] == [3.0 * i for i in range(16)] and out["ups"] == [64], out
    assert out["parked"] == 0, "the collective's end hands the parked slot back"
    assert out["after"] == [True] * 9 and out["held"] == [True] * 8 and out["ups_after"] == [], out
    assert out["sum"] == 2.0 and ranks[1].result["sum"] == 2.0


def test_an_array_left_over_the_bounce_buffer_neither_fails_nor_leaks_the_slot(tmp_path, device):
    """through_bounce's host work keeps a numpy array over the buffer past
    the call (so the view cannot be released): the result still goes up and
    the slot is handed back, ten times over (eight slots)."""
    [rank] = run_ranks(1, job("""
        from ringreduce.core.cuda import through_bounce
        x = np.arange(100, dtype=np.float32)
        src, dst = Buf(x), Buf(np.zeros_like(x))
        kept = []
        def work(view):
            a = np.frombuffer(view, dtype=np.float32)
            a += 1
            kept.append(a)  # outlives the call
        result = [through_bounce(dev, src.ptr, dst.ptr, x.nbytes, work) and dst.get(np.float32).tolist()
                  for _ in range(10)]
    """, kind=device[0]), tmp_path, env=env_for(device, 2))
    assert rank.result == [[float(i + 1) for i in range(100)]] * 10


# cupy's part of ringreduce.core.cuda.DeviceArrays, over the host CUDA driver: arrays
# are numpy views of the driver's device memory (bounds-checked there), so
# DeviceArrays itself, unchanged, runs the collectives on the ring's CUDA device.
CUPY_ON_HOSTCUDA = """
import ctypes, types
from ringreduce.core import arrays as core_arrays, cuda

class Place:
    id = 0
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass

class G(np.ndarray):  # a cupy array
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])
    @property
    def device(self):
        return Place()

def empty(shape, dtype=np.float32):
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (ctypes.c_uint8 * max(n, 1)).from_address(memory.alloc(n))
    return np.frombuffer(raw, np.uint8, n).view(dtype).reshape(shape).view(G)

def asarray(a):
    a = np.ascontiguousarray(np.asarray(a))
    out = empty(a.shape, a.dtype)
    np.asarray(out)[...] = a
    return out

stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
def memcpy(dst, src, n, kind, stream_ptr):
    ctypes.memmove(dst, src, n)
xp = types.SimpleNamespace(
    ndarray=G, empty=empty, asarray=asarray, empty_like=lambda a: empty(a.shape, a.dtype),
    ascontiguousarray=lambda a: a if a.flags.c_contiguous else asarray(a),
    asnumpy=lambda a: np.array(np.asarray(a)), may_share_memory=np.may_share_memory, copyto=np.copyto,
    cuda=types.SimpleNamespace(get_current_stream=lambda: stream,
                               runtime=types.SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1)))
family = object.__new__(cuda.DeviceArrays)
family.xp = xp
cuda.ring_device = lambda ordinal: dev
cuda.is_device_array = lambda x: isinstance(x, G)
core_arrays.device_arrays = lambda: family
"""


def test_device_arrays_run_the_small_collectives_through_bounce_buffers(tmp_path, hostcuda_dir):
    """ringreduce.core.cuda.DeviceArrays on the ring's CUDA device (the host
    driver; cupy's few calls stand in): small allreduce, reduce_scatter,
    allgather, broadcast and alltoall of GPU arrays, beside host ranks, give
    the host ring's bits as GPU arrays, each in at most two device copies
    (allreduce, reduce_scatter and broadcast exactly two: down and up through
    a bounce buffer), none from pageable memory; a large allreduce runs staged
    (holding the device's gate) and leaves no slot parked."""
    env = {"LD_LIBRARY_PATH": str(hostcuda_dir)}
    ranks = run_ranks(3, job(CUPY_ON_HOSTCUDA + textwrap.dedent("""
        N, r = rr.size(), rr.rank()
        on = r % 2 == 0
        bad, copies = [], {}

        def run(what, f, x):
            before = dev.counts()["copies"]
            got = f(asarray(x) if on else x)
            copies[what] = dev.counts()["copies"] - before
            want = f(x)
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            for g, w in zip(got, want):
                if on and w.dtype != np.int32 and not isinstance(g, G):
                    bad.append((what, "not a GPU array", type(g)))
                if np.asarray(g).tobytes() != w.tobytes() or g.shape != w.shape:
                    bad.append(what)

        for dtype in ["float32", "bfloat16", "int64"]:
            for count in [1, N + 1, 999]:
                x = make_input(r, (count,), dtype, "sum")
                run(("ar", dtype, count), lambda a: rr.allreduce(a), x)
                run(("rs", dtype, count), rr.reduce_scatter, x)
                run(("ag", dtype, count), rr.allgather, x[:count // 2 + 1])
                run(("bc", dtype, count), lambda a: rr.broadcast(a, root=1), x)
                run(("a2a", dtype, count), rr.alltoall, make_input(r, (N * (count // 3 + 1), 2), dtype, "sum"))
        big = make_input(r, (300_001,), "float32", "sum")
        run(("ar", "big"), lambda a: rr.allreduce(a), big)
        result = bad, copies, memory.stats()["pageable_copies"], len(cuda._gate(dev).pending)
    """), kind="hostcuda"), tmp_path, env=env, timeout=120)
    for k in ranks:
        bad, copies, pageable, parked = k.result
        assert bad == [], f"rank {k.rank}: {bad[:5]}"
        assert pageable == 0 and parked == 0, (k.rank, pageable, parked)
        if k.rank % 2:
            assert set(copies.values()) == {0}, copies
            continue
        small = {w: c for w, c in copies.items() if w[1] != "big"}
        assert max(small.values()) <= 2, {w: c for w, c in small.items() if c > 2}
        assert all(c == 2 for w, c in small.items() if w[0] in ("ar", "rs", "bc") and w[2] >= 3), small  # a chunk on every rank of 3
        assert copies[("ar", "big")] >= 2


def test_a_device_collective_whose_gpu_fails_before_its_header_is_refused(tmp_path):
    """reduce_scatter, allgather, broadcast and alltoall of a GPU array whose
    preparation fails on one rank (its trip down, a GPU allocation of the
    ring's path): that rank raises its error, and the others raise
    MismatchError naming it at once, instead of waiting in the ring for it
    or pairing their collective with its next one. The ring stays usable:
    the same collective right after gives the host ring's bits."""
    ranks = run_ranks(3, job(SMALL_FAMILY + textwrap.dedent("""
        import time
        N, r = rr.size(), rr.rank()
        fail = {"on": False}
        small_trip = Family.small_trip

        def failing_trip(self, x, down=True):
            if fail["on"]:
                raise rr.RingReduceError("CUDA: cuMemcpyDtoHAsync failed: an illegal memory access was encountered")
            return small_trip(self, x, down)
        Family.small_trip = failing_trip

        def wrap(a):
            return a.view(Dev) if r == 0 else a
        small = make_input(r, (1000,), "float32", "sum")
        rows = make_input(r, (N * 5, 3), "float32", "sum")
        calls = {"rs": lambda a: rr.reduce_scatter(a), "ag": rr.allgather,
                 "bc": lambda a: rr.broadcast(a, root=N - 1), "a2a": rr.alltoall}
        out = {}
        for what, f in calls.items():
            x = rows if what == "a2a" else small
            fail["on"] = r == 0
            start = time.monotonic()
            try:
                f(wrap(x))
                first = "no error"
            except rr.RingReduceError as exc:
                first = (type(exc).__name__, str(exc))
            took = time.monotonic() - start
            fail["on"] = False
            got, want = f(wrap(x)), f(x)
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            same = all(np.asarray(g).tobytes() == np.asarray(w).tobytes() for g, w in zip(got, want))
            out[what] = first, took, same
        result = out
    """), "device", 2, "emulated"), tmp_path, timeout=120, env={"RINGREDUCE_TIMEOUT": "20"})
    for what, (first, took, same) in ranks[0].result.items():
        assert first[0] == "RingReduceError" and "cuMemcpyDtoHAsync" in first[1], (what, first)
        assert same, what
    for k in (1, 2):
        for what, (first, took, same) in ranks[k].result.items():
            assert first[0] == "MismatchError" and "rank 0" in first[1] and "cuMemcpyDtoHAsync" in first[1], (what, first)
            assert took < 10, (what, took)
            assert same, (k, what)


def test_a_device_rank_whose_ring_device_cannot_be_made_refuses_a_large_allreduce(tmp_path):
    """The ring's device is made on a GPU's first collective (its stream, its
    kernels compiled where no fatbin was built): a rank where that fails
    raises it before its header goes out, and the others raise MismatchError
    naming it at once instead of waiting in the ring for it; the ring stays
    usable."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        import time
        r = rr.rank()
        def no_device(x):
            raise rr.RingReduceError("GPU arrays need cupy and a CUDA device: no usable CUDA device")
        if r == 1:
            Emulated.ready = staticmethod(no_device)
        x = np.full(1 << 20, r + 1, dtype=np.float32)
        start = time.monotonic()
        try:
            rr.allreduce(x.view(Dev) if r == 1 else x, op="sum")
            first = "no error"
        except rr.RingReduceError as exc:
            first = (type(exc).__name__, str(exc))
        took = time.monotonic() - start
        Emulated.ready = staticmethod(lambda x: None)
        y = rr.allreduce(x.view(Dev) if r == 1 else x, op="sum")
        result = first, took, bool(np.array_equal(np.asarray(y), np.full(1 << 20, 6, dtype=np.float32)))
        """), tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "20"})
    assert ranks[1].result[0][0] == "RingReduceError", ranks[1].result
    for k in (0, 2):
        first, took, _ = ranks[k].result
        assert first[0] == "MismatchError" and "rank 1" in first[1] and "no usable CUDA device" in first[1], first
        assert took < 10, took
    for k in ranks:
        assert k.result[2], (k.rank, "wrong sums after the refusal")


def test_an_out_on_another_gpu_than_x_is_refused_on_every_rank(tmp_path):
    """rr.allreduce(x, out=out) with out on another GPU than x: the result is
    made on x's GPU, so that rank refuses with a ValueError saying so and its
    peers raise MismatchError naming it, before any data moves; the next
    allreduce runs."""
    ranks = run_ranks(3, emulated_family(2) + textwrap.dedent("""
        import types
        class OnGpu0(Dev):
            device = types.SimpleNamespace(id=0)
        class OnGpu1(Dev):
            device = types.SimpleNamespace(id=1)
        r = rr.rank()
        x = np.arange(300_000, dtype=np.float32).view(OnGpu0)
        out = np.empty(300_000, np.float32).view(OnGpu1 if r == 1 else OnGpu0)
        try:
            rr.allreduce(x, out=out)
            first = "no error"
        except (ValueError, rr.MismatchError) as exc:
            first = type(exc).__name__, str(exc)
        again = np.array_equal(np.asarray(rr.allreduce(x)), np.arange(300_000, dtype=np.float32) * 3)
        result = first, again
    """), tmp_path, timeout=60)
    first, again = ranks[1].result
    assert first[0] == "ValueError" and "GPU 1" in first[1] and "GPU 0" in first[1], first
    for r in ranks:
        assert r.result[1] is True, r.result
    for r in (ranks[0], ranks[2]):
        assert r.result[0][0] == "MismatchError" and "rank 1" in r.result[0][1], r.result
