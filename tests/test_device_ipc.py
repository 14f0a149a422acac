"""The IPC path for device buffers (csrc/schedule/ipc.c, ringreduce/core/device_ipc.py):
ranks whose devices open each other's memory allreduce device to device, with
the host ring's bits, exchanging window handles once and caching them; the
path is agreed by every rank, and anything that refuses it (the setting off
on one rank, a device that refuses IPC, another GPU, a host rank in the ring)
makes every rank take the staged path instead, never an error.

Each case runs on the emulated device (its IPC windows are memfd mappings,
its work runs late, its pointers fault on the host) and on the CUDA device
(csrc/device/cuda_device.c) over the host CUDA driver (tests/hostcuda.py), whose
cuIpc* calls share memfd-backed device memory between processes and whose
streams run late too: a window read before its owner's work ran gives wrong
bits.
"""
import os
import textwrap

import numpy as np
import pytest

from emulated_family import emulated_family
from ranks import run_ranks

SETUP = """
import os
from cases import DTYPES, OPS, make_input, np_dtype
from ringreduce import _core
from ringreduce.core import collectives, device_ipc
from ringreduce.core.protocol import ALLREDUCE, all_device, exchange, header
ring = collectives.communicator().ring
comm = ring.comm
if kind == "emulated":
    dev = memory = _core.Device.emulated(patience, identity)
else:
    from hostcuda import HostCuda
    memory = HostCuda()  # the driver libcuda.so.1 that the CUDA device opens too
    dev = memory.ring_device(rr.rank() % int(os.environ.get("HOSTCUDA_DEVICES", "1")))  # ranks across its GPUs
codes = {d: collectives.dtype_code(np_dtype(d)) for d in DTYPES}
opcodes = collectives.OPS

class Buf:
    # An array's bytes in device memory.
    def __init__(self, a):
        self.nbytes, self.ptr = a.nbytes, memory.alloc(max(a.nbytes, 1))
        memory.write(self.ptr, a.tobytes())
    def get(self, dtype):
        return np.frombuffer(memory.read(self.ptr, self.nbytes), dtype=dtype).copy()

NAN_BITS = {2: 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

def rough_input(rank, count, dtype, op):
    # Floats whose sums, products and means round, so another fold order or
    # operand role gives other bits; NaNs with this rank's payload, alone or
    # meeting other ranks' (x86 keeps the first operand's payload). Integers
    # as make_input (exact: wrapping is the same in any order).
    x = make_input(rank, (count,), dtype, op)
    if dtype not in ("float16", "bfloat16", "float32", "float64"):
        return x
    rng = np.random.default_rng([rank, count, 7])
    v = rng.standard_normal(count) * np.exp2(rng.integers(-6, 6, count))
    if op == "prod":
        v = 1 + rng.standard_normal(count) / 8
    x = v.astype(np_dtype(dtype))
    bits = x.view(UINT[x.itemsize])
    nan = NAN_BITS[x.itemsize] if dtype != "bfloat16" else 0x7FC0
    i = np.arange(count)
    bits[(i % 101 == rank) | (i % 211 == 0)] = nan | (rank + 1)
    return x

def same_bits(got, want, dtype, op):
    # The host ring's bits. On the CUDA device a sum or product of NaNs may
    # be another NaN (CUDA's canonical one; x86 keeps whichever operand the
    # compiler put first): which NaN it is may differ there, nothing else
    # (tests/test_cuda.py holds the kernels to the same rule). The emulated
    # device reduces with the host kernels: every bit.
    if kind == "emulated" or op in ("min", "max") or dtype not in ("float16", "bfloat16", "float32", "float64"):
        return got.tobytes() == want.tobytes()
    nan = np.isnan(want.astype(np.float64))
    return np.array_equal(np.isnan(got.astype(np.float64)), nan) and got[~nan].tobytes() == want[~nan].tobytes()

def host_allreduce(x, dtype, op):
    out = np.empty_like(x)
    comm.allreduce(x.view(np.uint8), out.view(np.uint8), codes[dtype], opcodes[op])
    return out

def device_allreduce(x, dtype, op, in_place, on_device=True):
    # As collectives' GPU allreduce does it: the header pass, then the path the ring agreed on.
    head = header(ALLREDUCE, opcodes[op], codes[dtype], x.shape, None, device=on_device)
    blobs = exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
    if not on_device:
        return host_allreduce(x, dtype, op), False
    src = Buf(x)
    dst = src if in_place else Buf(np.zeros_like(x))
    ipc = device_ipc.allreduce(ring, dev, src.ptr, dst.ptr, x.nbytes, codes[dtype], opcodes[op], all_device(blobs))
    if not in_place:
        assert src.get(x.dtype).tobytes() == x.tobytes(), "input changed"
    got = dst.get(x.dtype)
    memory.free(src.ptr)
    if not in_place:
        memory.free(dst.ptr)
    return got, ipc

def small_ipc_allreduce(x, dtype, op, in_place, name=None, src_ptr=None, dst_ptr=None):
    # The one-pass small allreduce as collectives' GPU allreduce calls it on a ring that agreed on IPC:
    # (result, None), or (None, every rank's blob) where headers differed.
    head = header(ALLREDUCE, opcodes[op], codes[dtype], x.shape, name, inline=True, device=True)
    src = Buf(x)
    dst = src if in_place else Buf(np.zeros_like(x))
    try:
        blobs = device_ipc.allreduce_small(ring, dev, head, src.ptr if src_ptr is None else src_ptr,
                                           dst.ptr if dst_ptr is None else dst_ptr, x.nbytes, codes[dtype],
                                           opcodes[op])
        return (dst.get(x.dtype) if blobs is None else None), blobs
    finally:
        memory.free(src.ptr)
        if not in_place:
            memory.free(dst.ptr)

def rank_order(xs, dtype, op):
    # The host small paths' bits: every rank's input folded in rank order (collectives._reduce_blobs).
    return collectives._reduce_blobs([a.tobytes() for a in xs], np_dtype(dtype), codes[dtype], opcodes[op],
                                     (xs[0].size,))
"""


def job(body: str, kind: str, patience: int = 2, identity: str = "emulated", pre: str = "") -> str:
    """A rank's code: pre (run before the device is made), SETUP, then body."""
    return (f"kind, patience, identity = {kind!r}, {patience}, {identity!r}\n" + pre + SETUP
            + textwrap.dedent(body))


@pytest.fixture(params=["emulated", "hostcuda"])
def device(request):
    """(kind, environment) for the ranks: the CUDA kind finds the host driver
    through LD_LIBRARY_PATH."""
    if request.param == "emulated":
        return "emulated", {}
    folder = request.getfixturevalue("hostcuda_dir")
    return "hostcuda", {"LD_LIBRARY_PATH": f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def env_for(device, patience=2, **extra):
    return {**device[1], "HOSTCUDA_PATIENCE": str(patience), **extra}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("patience", [0, 2])
def test_ipc_allreduce_equals_the_host_ring(tmp_path, device, n, patience):
    """Every dtype and op (avg included: sum then divide, 16-bit floats as
    running means), sizes of 0, 1, fewer elements than ranks, not divisible
    by N and a few MiB, in place and out of place: the bits of the host ring
    (same_bits), the same bits on every rank, and the IPC path taken, with no
    trip through the host. Queued work runs late (patience 2: after a few
    queries; 0: only when waited for), so a window read before its owner's
    work ran gives other bits."""
    ranks = run_ranks(n, job("""
        import hashlib
        bad, paths, digest = [], set(), hashlib.sha256()
        before = dev.counts()
        N = rr.size()
        for dtype in DTYPES:
            for op in OPS:
                for count in [0, 1, N - 1, 2 * N + 1, 5_003]:
                    x = rough_input(rr.rank(), count, dtype, op)
                    want = host_allreduce(x, dtype, op)  # checked against numpy in test_allreduce.py
                    got, ipc = device_allreduce(x, dtype, op, in_place=count % 2 == 1)
                    paths.add(ipc)
                    digest.update(got.tobytes())
                    if not same_bits(got, want, dtype, op):
                        bad.append((dtype, op, count))
        for dtype, op in [("float32", "sum"), ("bfloat16", "avg")]:  # a few MiB
            x = rough_input(rr.rank(), (3 << 20) // 4 + 3, dtype, op)
            got, ipc = device_allreduce(x, dtype, op, in_place=False)
            paths.add(ipc)
            digest.update(got.tobytes())
            if not same_bits(got, host_allreduce(x, dtype, op), dtype, op):
                bad.append((dtype, op, x.size))
        after = dev.counts()
        result = bad, paths, {k: after[k] - before[k] for k in after}, digest.hexdigest()
    """, device[0], patience), tmp_path, env=env_for(device, patience, RINGREDUCE_SEGMENT_BYTES="4096"), timeout=400)
    assert len({r.result[3] for r in ranks}) == 1, "ranks differ"  # each chunk reduced once, then copied
    for r in ranks:
        bad, paths, counts, _ = r.result
        assert bad == [], f"rank {r.rank}: {sorted(set(b[:2] for b in bad))}"
        assert paths == {True}, paths
        assert counts["host_copies"] == 0, counts  # device to device only
        assert counts["kernels"] > 0 and counts["ipc_opens"] >= n - 1, counts


def test_handles_are_exchanged_once_and_again_when_a_window_grows(tmp_path, device):
    """A peer's window is opened once and cached across calls; when a rank's
    window grows (a larger tensor), its peers open the new one, once."""
    ranks = run_ranks(3, job("""
        def opens():
            return dev.counts()["ipc_opens"], dev.counts()["ipc_exports"]
        x = make_input(rr.rank(), (10_000,), "float32", "sum")
        steps = []
        for _ in range(4):
            got, ipc = device_allreduce(x, "float32", "sum", in_place=False)
            assert ipc and got.tobytes() == host_allreduce(x, "float32", "sum").tobytes()
            steps.append(opens())
        y = make_input(rr.rank(), (400_000,), "float32", "sum")  # larger than every window: all grow
        for _ in range(3):
            got, ipc = device_allreduce(y, "float32", "sum", in_place=True)
            assert ipc and got.tobytes() == host_allreduce(y, "float32", "sum").tobytes()
            steps.append(opens())
        result = steps
    """, device[0]), tmp_path, env=env_for(device), timeout=120)
    for r in ranks:
        steps = r.result
        # the agreement exported a first window and opened the peers'; the first allreduce grew every window
        # and opened each peer's new one, once; later calls open nothing
        assert steps[:4] == [(4, 2)] * 4, steps
        assert steps[4:] == [(6, 3)] * 3, steps  # a larger tensor: each window grows, each opened once more


REFUSALS = ["setting", "device", "other_gpu"]


@pytest.mark.parametrize("refusal", REFUSALS)
def test_one_refusing_rank_sends_every_rank_to_the_staged_path(tmp_path, device, refusal):
    """RINGREDUCE_CUDA_IPC=0 on one rank, a device that refuses IPC on one
    rank (it cannot export memory), or one rank on a GPU the others cannot
    reach (no peer access; not visible to them): every rank takes the staged
    path (the same bits), none raises."""
    run_with_one_refusing_rank(tmp_path, device, refusal)


def test_a_rank_that_cannot_open_its_peers_memory_sends_every_rank_to_the_staged_path(tmp_path, hostcuda_dir):
    """IPC not permitted (cuIpcOpenMemHandle fails on rank 1, as in a
    container that cannot reach its peers' processes; the host CUDA driver
    refuses on request, the emulated device cannot): the agreement's opens
    fail there, and every rank takes the staged path."""
    run_with_one_refusing_rank(tmp_path, ("hostcuda", {"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}),
                       "open")


@pytest.mark.parametrize("peer_access", ["1", "0"])
def test_ranks_on_two_gpus_take_the_ipc_path_where_they_have_peer_access(tmp_path, hostcuda_dir, peer_access):
    """Ranks spread over two GPUs of one host (the host CUDA driver's): device
    to device where the GPUs have peer access, else (HOSTCUDA_PEER_ACCESS=0)
    every rank takes the staged path; the host ring's bits either way."""
    ranks = run_ranks(4, job("""
        out = []
        for dtype, op in [("float32", "sum"), ("float16", "avg"), ("int64", "max")]:
            x = rough_input(rr.rank(), 70_001, dtype, op)
            got, ipc = device_allreduce(x, dtype, op, in_place=False)
            out.append((ipc, same_bits(got, host_allreduce(x, dtype, op), dtype, op)))
        result = out
    """, "hostcuda"), tmp_path, timeout=120,
        env={"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}", "HOSTCUDA_DEVICES": "2",
             "HOSTCUDA_PEER_ACCESS": peer_access})
    for r in ranks:
        assert r.result == [(peer_access == "1", True)] * 3, (r.rank, r.result)


def hostcuda_env(folder, **extra):
    return {"LD_LIBRARY_PATH": f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}", **extra}


@pytest.fixture(scope="module")
def hostcuda_without_uuid_v2(tmp_path_factory):
    """The host CUDA driver as drivers before CUDA 11.4 are: no cuDeviceGetUuid_v2."""
    import hostcuda
    why = hostcuda.why_not_buildable()
    if why:
        pytest.skip(f"the host CUDA driver cannot be built: {why}")
    return hostcuda.build(tmp_path_factory.mktemp("hostcuda_no_v2"), ("HOSTCUDA_NO_UUID_V2",))


UUIDS = """
import ctypes
def uuid(name):
    raw = ctypes.create_string_buffer(16)
    assert getattr(memory.lib, name)(raw, 0) == 0
    return "cuda:" + raw.raw.hex()
identity = dev.ipc_offer()[0]
"""


def test_ranks_on_two_mig_instances_of_one_gpu_take_the_staged_path(tmp_path, hostcuda_dir):
    """Two ranks on two MIG instances of one GPU (HOSTCUDA_MIG: the whole
    GPU's UUID from cuDeviceGetUuid, each instance's own from _v2, no peer
    access, no IPC across instances): their IPC identities are the
    instances' UUIDs, so neither takes the other's device for its own; every
    rank takes the staged path, with the host ring's bits, without trying to
    open a peer's memory."""
    pre = "os.environ['HOSTCUDA_MIG'] = str(int(os.environ['RINGREDUCE_RANK']) + 1)\nrr.init()\n"
    ranks = run_ranks(2, job(UUIDS + textwrap.dedent("""
        out = []
        for count in [7, 100_003]:
            x = make_input(rr.rank(), (count,), "float32", "sum")
            got, ipc = device_allreduce(x, "float32", "sum", in_place=False)
            out.append((ipc, got.tobytes() == host_allreduce(x, "float32", "sum").tobytes()))
        result = out, identity, uuid("cuDeviceGetUuid_v2"), uuid("cuDeviceGetUuid"), memory.stats()["ipc_open_calls"]
    """), "hostcuda", pre=pre), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=120, init=False)
    gpu = {r.result[3] for r in ranks}
    assert len(gpu) == 1  # one GPU ...
    assert len({r.result[1] for r in ranks}) == 2  # ... two devices
    for r in ranks:
        out, identity, v2, _, open_calls = r.result
        assert identity == v2, (r.rank, identity, v2)
        assert out == [(False, True), (False, True)], (r.rank, out)
        assert open_calls == 0, r.rank


def test_without_cuda_11_4s_uuid_call_the_identity_is_cuda_device_get_uuids(tmp_path, hostcuda_without_uuid_v2):
    """A driver without cuDeviceGetUuid_v2: the IPC identity is
    cuDeviceGetUuid's, and ranks on one GPU still take the IPC path."""
    ranks = run_ranks(2, job(UUIDS + textwrap.dedent("""
        assert not hasattr(memory.lib, "cuDeviceGetUuid_v2")
        x = make_input(rr.rank(), (100_003,), "float32", "sum")
        got, ipc = device_allreduce(x, "float32", "sum", in_place=False)
        result = identity == uuid("cuDeviceGetUuid"), ipc, got.tobytes() == host_allreduce(x, "float32", "sum").tobytes()
    """), "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_without_uuid_v2), timeout=120)
    for r in ranks:
        assert r.result == (True, True, True), (r.rank, r.result)


def test_the_host_driver_takes_only_the_flags_cuda_h_documents(hostcuda_dir):
    """The host CUDA driver checks flags as cuda.h documents them (so the CUDA
    device's flags are checked wherever it runs on it): streams take
    CU_STREAM_NON_BLOCKING (1) or none, events BLOCKING_SYNC (1),
    DISABLE_TIMING (2) and INTERPROCESS (4, only with DISABLE_TIMING),
    cuIpcOpenMemHandle exactly CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1)."""
    import ctypes
    from hostcuda import HostCuda
    h = HostCuda(hostcuda_dir / "libcuda.so.1")
    h.make_current()
    lib, made = h.lib, ctypes.c_void_p()
    INVALID_VALUE = 1
    for flags, want in [(0, 0), (1, 0), (2, INVALID_VALUE), (4, INVALID_VALUE)]:
        assert lib.cuStreamCreate(ctypes.byref(made), flags) == want, flags
        if want == 0:
            lib.cuStreamDestroy_v2(made)
    for flags, want in [(0, 0), (1, 0), (2, 0), (3, 0), (6, 0), (7, 0), (4, INVALID_VALUE), (5, INVALID_VALUE),
                        (8, INVALID_VALUE)]:
        assert lib.cuEventCreate(ctypes.byref(made), flags) == want, flags
        if want == 0:
            lib.cuEventDestroy_v2(made)
    class Handle(ctypes.Structure):  # CUipcMemHandle, passed by value
        _fields_ = [("reserved", ctypes.c_char * 64)]

    ptr, handle = ctypes.c_uint64(), Handle()
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), 4096) == 0
    assert lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr) == 0
    for flags in (0, 2, 3):
        assert lib.cuIpcOpenMemHandle_v2(ctypes.byref(made), handle, flags) == INVALID_VALUE, flags
    INVALID_CONTEXT = 201  # the flag taken; CUDA opens no handle of the process's own
    assert lib.cuIpcOpenMemHandle_v2(ctypes.byref(made), handle, 1) == INVALID_CONTEXT
    assert lib.cuMemFree_v2(ptr) == 0
    assert h.stats()["streams"] == h.stats()["events"] == h.stats()["device_blocks"] == 0


def run_with_one_refusing_rank(tmp_path, device, refusal):
    if refusal == "setting":
        pre = "if os.environ['RINGREDUCE_RANK'] == '1':\n    os.environ['RINGREDUCE_CUDA_IPC'] = '0'\nrr.init()\n"
    elif device[0] == "emulated":
        pre = "rr.init()\nidentity = {'device': None, 'other_gpu': 'emulated-1'}[refusal] if rr.rank() == 1 else identity\n"
    else:
        var = {"device": "HOSTCUDA_IPC", "other_gpu": "HOSTCUDA_UUID_SALT", "open": "HOSTCUDA_IPC_OPEN"}[refusal]
        value = {"device": "0", "other_gpu": "1", "open": "0"}[refusal]
        pre = f"if os.environ['RINGREDUCE_RANK'] == '1':\n    os.environ[{var!r}] = {value!r}\nrr.init()\n"
    body = job("""
        out = []
        for count in [7, 100_003]:
            x = make_input(rr.rank(), (count,), "float64", "sum")
            got, ipc = device_allreduce(x, "float64", "sum", in_place=False)
            out.append((ipc, got.tobytes() == host_allreduce(x, "float64", "sum").tobytes()))
        result = out, dev.counts()["host_copies"] > 0
    """, device[0], pre=f"refusal = {refusal!r}\n" + pre)
    ranks = run_ranks(3, body, tmp_path, env=env_for(device), timeout=120, init=False)
    for r in ranks:
        out, staged = r.result
        assert out == [(False, True), (False, True)], (r.rank, out)
        assert staged


def test_a_ring_with_a_host_rank_stays_staged(tmp_path, device):
    """A host rank among device ranks: no agreement is even run, the device
    ranks take the staged path, every rank gets the host ring's bits."""
    ranks = run_ranks(3, job("""
        x = make_input(rr.rank(), (50_001,), "float32", "avg")
        got, ipc = device_allreduce(x, "float32", "avg", in_place=False, on_device=rr.rank() != 2)
        result = ipc, got.tobytes() == host_allreduce(x, "float32", "avg").tobytes(), ring.ipc
    """, device[0]), tmp_path, env=env_for(device), timeout=120)
    for r in ranks:
        assert r.result == (False, True, None), (r.rank, r.result)


def test_a_peer_lost_during_the_ipc_path_fails_every_rank(tmp_path):
    """A rank that dies between two IPC allreduces: the others raise
    PeerLostError naming it, none hangs."""
    ranks = run_ranks(3, job("""
        x = make_input(rr.rank(), (100_000,), "float32", "sum")
        got, ipc = device_allreduce(x, "float32", "sum", in_place=False)
        assert ipc
        if rr.rank() == 1:
            os._exit(0)
        try:
            device_allreduce(x, "float32", "sum", in_place=False)
            result = "no error"
        except rr.RingReduceError as exc:
            result = (type(exc).__name__, str(exc))
    """, "emulated"), tmp_path, timeout=120, check=False)
    for r in (ranks[0], ranks[2]):
        assert r.result != "no error"
        assert r.result[0] == "PeerLostError" and "rank 1" in r.result[1], r.result


def test_a_device_failing_on_one_rank_fails_every_rank_naming_it(tmp_path):
    """Rank 1 hands the IPC path a host pointer: its device refuses the copy,
    and every rank raises naming rank 1, in the same handshake (no hang)."""
    ranks = run_ranks(3, job("""
        x = make_input(rr.rank(), (100_000,), "float32", "sum")
        head = header(ALLREDUCE, opcodes["sum"], codes["float32"], x.shape, None, False, device=True)
        blobs = exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
        src = Buf(x)
        ptr = x.ctypes.data if rr.rank() == 1 else src.ptr
        try:
            device_ipc.allreduce(ring, dev, ptr, src.ptr, x.nbytes, codes["float32"], opcodes["sum"], all_device(blobs))
            result = "no error"
        except rr.RingReduceError as exc:
            result = (type(exc).__name__, str(exc))
    """, "emulated"), tmp_path, timeout=60)
    assert "host pointer" in ranks[1].result[1], ranks[1].result
    for r in (ranks[0], ranks[2]):
        assert r.result[0] == "RingReduceError" and "rank 1" in r.result[1] and "host pointer" in r.result[1], r.result


def test_the_cuda_device_frees_its_window_and_closes_its_peers(tmp_path, hostcuda_dir):
    """On the host CUDA driver: the IPC path copies nothing through pageable
    memory, and dropping the device frees its window (cuMemFree) and closes
    every peer's (cuIpcCloseMemHandle), so nothing stays mapped."""
    ranks = run_ranks(3, job("""
        import gc
        x = make_input(rr.rank(), (30_000,), "int32", "sum")
        for n in (30_000, 300_000):
            x = make_input(rr.rank(), (n,), "int32", "sum")
            got, ipc = device_allreduce(x, "int32", "sum", in_place=False)
            assert ipc and got.tobytes() == host_allreduce(x, "int32", "sum").tobytes()
        during = memory.stats()
        del dev
        gc.collect()
        result = during, memory.stats()
    """, "hostcuda"), tmp_path, env={"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"},
        timeout=120)
    for r in ranks:
        during, after = r.result
        assert during["ipc_open"] == 2 and during["device_blocks"] == 1, during  # peers' windows; its own
        assert during["pageable_copies"] == 0 and during["sticky_error"] == 0, during
        assert after["ipc_open"] == 0 and after["device_blocks"] == 0 and after["contexts"] == 0, after


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_allgather_broadcast_take_the_ipc_path(tmp_path, device, n):
    """reduce_scatter (this rank's chunk, the host ring's bits), allgather of
    uneven blocks (some empty) and broadcast from every root, device to
    device, with no trip through the host."""
    ranks = run_ranks(n, job("""
        N, r = rr.size(), rr.rank()
        out, paths = {}, set()
        before = dev.counts()
        for count in [1, N - 1, 3 * N + 2, 30_011]:
            x = rough_input(r, count, "float32", "sum")
            head = header(ALLREDUCE, opcodes["sum"], codes["float32"], x.shape, None, False, device=True)
            blobs = exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
            src, dst = Buf(x), Buf(np.zeros_like(x))
            paths.add(device_ipc.reduce_scatter(ring, dev, src.ptr, dst.ptr, x.nbytes, codes["float32"],
                                                opcodes["sum"], all_device(blobs)))
            lo, hi = collectives.chunk_bounds(count, N, r)
            want = host_allreduce(x, "float32", "sum")[lo:hi]
            out[("rs", count)] = same_bits(dst.get(x.dtype)[lo:hi], want, "float32", "sum")

            rows = [(count + i * 7) % 50_000 if i != 1 else 0 for i in range(N)]  # uneven, one empty
            full = np.zeros(sum(rows), dtype=np.int16)
            at = sum(rows[:r])
            full[at:at + rows[r]] = np.arange(rows[r], dtype=np.int16) + r
            buf = Buf(full)
            paths.add(device_ipc.allgather(ring, dev, buf.ptr, [k * 2 for k in rows], True))
            want = np.concatenate([np.arange(k, dtype=np.int16) + i for i, k in enumerate(rows)])
            out[("ag", count)] = np.array_equal(buf.get(np.int16), want)

            for root in range(N):
                b = np.arange(count, dtype=np.int64) * (root + 1) if r == root else np.zeros(count, np.int64)
                buf = Buf(b)
                paths.add(device_ipc.broadcast(ring, dev, buf.ptr, b.nbytes, root, True))
                out[("bc", count, root)] = np.array_equal(buf.get(np.int64), np.arange(count, dtype=np.int64) * (root + 1))
        after = dev.counts()
        result = out, paths, after["host_copies"] - before["host_copies"]
    """, device[0]), tmp_path, env=env_for(device), timeout=180)
    for r in ranks:
        out, paths, host_copies = r.result
        assert all(out.values()), (r.rank, [k for k, v in out.items() if not v])
        assert paths == {True} and host_copies == 0, (paths, host_copies)


EMULATED_FAMILY = emulated_family(2)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_public_collectives_take_the_ipc_path_where_agreed(tmp_path, setting):
    """rr.allreduce, reduce_scatter, allgather and broadcast on device arrays
    of every rank: device to device with the setting on (the ring agreed once,
    no host copy), the staged path with RINGREDUCE_CUDA_IPC=0; the same
    results either way."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        r, N = rr.rank(), rr.size()
        x = ((np.arange(300_001) % 13) * (r + 1)).astype(np.float32)
        before = device.counts()
        y = rr.allreduce(x.view(Dev), op="avg")
        s = rr.reduce_scatter(x.view(Dev))
        g = rr.allgather((np.arange(100_003) + r).astype(np.int32).view(Dev))
        b = rr.broadcast((np.arange(200_000) * (r + 1)).astype(np.int64).view(Dev), root=2)
        after = device.counts()
        lo, hi = C.chunk_bounds(x.size, N, r)
        want = (np.arange(300_001) % 13).astype(np.float32) * 6
        ok = (np.array_equal(np.asarray(y), want / 3), np.array_equal(np.asarray(s), want[lo:hi]),
              np.array_equal(np.asarray(g), np.concatenate([np.arange(100_003) + k for k in range(N)]).astype(np.int32)),
              np.array_equal(np.asarray(b), np.arange(200_000) * 3))
        result = ok, C.communicator().ring.ipc, after["host_copies"] - before["host_copies"]
    """), tmp_path, timeout=120, env={"RINGREDUCE_CUDA_IPC": setting})
    for k in ranks:
        ok, ipc, host_copies = k.result
        assert ok == (True, True, True, True), (k.rank, ok)
        assert ipc is (setting == "1")
        assert (host_copies == 0) is (setting == "1"), host_copies


def test_the_agreement_reads_only_its_own_blobs():
    """Every rank's agreement blob carries its head; a blob without it (a rank
    whose collectives are out of step) fails the agreement naming that rank,
    never parsed as an offer."""
    from ringreduce import RingReduceError
    from ringreduce.core import device_ipc
    head = device_ipc.AGREE_HEAD
    assert device_ipc.agreement_payloads([head + b"1", head + b"0"]) == [b"1", b"0"]
    with pytest.raises(RingReduceError, match="rank 1"):
        device_ipc.agreement_payloads([head + b"1", b"RRIPC0junk", head + b"1"])


def test_the_agreement_asks_every_rank_to_be_on_one_host_willing_and_able():
    """The first pass's verdict, the same on every rank from the same offers:
    every rank willing (RINGREDUCE_CUDA_IPC), able to export (an identity),
    on one host and pid namespace; whether the GPUs reach each other is each
    rank's probe, in the second pass."""
    from ringreduce.core import device_ipc

    def offer(**changes):
        return {"host": "h", "pidns": 1, "want": True, "device": "cuda:00", "handle": "", **changes}

    assert device_ipc.candidates([offer(), offer(device="cuda:11")])
    for bad in [{"want": False}, {"device": None}, {"host": "other"}, {"pidns": 2}]:
        assert not device_ipc.candidates([offer(), offer(**bad)]), bad


@pytest.mark.parametrize("n", [2, 4])
def test_an_ipc_allreduce_costs_what_the_docs_say(tmp_path, device, n):
    """Once the peers' windows are open, an allreduce costs each rank N + 1
    copies on the device (in, and every chunk out), none to or from the host,
    N - 1 kernels (N for a sum-average: the division), 3 host waits and no
    opens (docs/api.md's counts)."""
    ranks = run_ranks(n, job("""
        costs = {}
        for op in ["sum", "avg"]:
            x = rough_input(rr.rank(), 100_003, "float32", op)
            device_allreduce(x, "float32", op, in_place=False)  # the windows grow and open
            before = dev.counts()
            got, ipc = device_allreduce(x, "float32", op, in_place=False)
            after = dev.counts()
            costs[op] = {k: after[k] - before[k] for k in after}
        result = costs
    """, device[0]), tmp_path, env=env_for(device), timeout=120)
    for r in ranks:
        for op, kernels in [("sum", n - 1), ("avg", n)]:
            c = r.result[op]
            assert (c["copies"], c["host_copies"], c["kernels"], c["waits"], c["ipc_opens"], c["ipc_exports"]) == \
                (n + 1, 0, kernels, 3, 0, 0), (r.rank, op, c)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_small_ipc_allreduce_is_one_pass_with_the_small_paths_bits(tmp_path, device, n):
    """On a ring that agreed on IPC, a small allreduce is one pass: every
    dtype and op, sizes 0, 1, fewer elements than ranks, not divisible by N
    and past the ring's small window (it grows), in place and out of place,
    give the host small paths' bits (every rank's input folded in rank order)
    and the same bits on every rank; queued work runs late, so a slot read
    before its owner's copy ran, or overwritten while a peer still reads it,
    gives other bits. Once the window is open an allreduce costs one device
    copy, N - 1 kernels (N for a sum-average), 2 host waits, no host copy
    and no open."""
    ranks = run_ranks(n, job("""
        import hashlib
        N, r = rr.size(), rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]  # agreed on IPC
        bad, digest = [], hashlib.sha256()
        limit = ring.allreduce_limit
        for dtype in DTYPES:
            for op in OPS:
                for count in [0, 1, N - 1, 2 * N + 1, 5_003]:
                    x = rough_input(r, count, dtype, op)
                    want = rank_order([rough_input(q, count, dtype, op) for q in range(N)], dtype, op)
                    got, blobs = small_ipc_allreduce(x, dtype, op, in_place=count % 2 == 1)
                    assert blobs is None, "headers differ"
                    digest.update(got.tobytes())
                    if not same_bits(got, want, dtype, op):
                        bad.append((dtype, op, count))
        costs = {}
        for op in ["sum", "avg"]:
            x = rough_input(r, 1000, "float32", op)
            small_ipc_allreduce(x, "float32", op, in_place=False)
            before = dev.counts()
            got, _ = small_ipc_allreduce(x, "float32", op, in_place=False)
            after = dev.counts()
            costs[op] = {k: after[k] - before[k] for k in after}
        big = rough_input(r, limit // 4 * 3, "float32", "sum")  # past the window made for the limit: it grows
        before = dev.counts()
        for _ in range(3):
            got, _ = small_ipc_allreduce(big, "float32", "sum", in_place=False)
            if got.tobytes() != rank_order([rough_input(q, big.size, "float32", "sum") for q in range(N)],
                                           "float32", "sum").tobytes():
                bad.append("grown")
        grown = dev.counts()["ipc_exports"] - before["ipc_exports"], dev.counts()["ipc_opens"] - before["ipc_opens"]
        result = bad, digest.hexdigest(), costs, grown
    """, device[0]), tmp_path, env=env_for(device), timeout=300)
    assert len({r.result[1] for r in ranks}) == 1, "ranks differ"
    for r in ranks:
        bad, _, costs, grown = r.result
        assert bad == [], (r.rank, bad)
        for op, kernels in [("sum", n - 1), ("avg", n)]:
            c = costs[op]
            assert (c["copies"], c["host_copies"], c["kernels"], c["waits"], c["ipc_opens"], c["ipc_exports"]) == \
                (1, 0, kernels, 2, 0, 0), (r.rank, op, c)
        assert grown == (1, n - 1), grown  # one new window each, each peer's opened once


def test_a_small_ipc_window_that_grows_frees_the_old_one(tmp_path, hostcuda_dir):
    """On the host CUDA driver: a ring's small window that grows keeps the
    old one only until that operation's pass (no peer reads it after it),
    then frees it: device memory holds the large window and one small
    window, however often it grew."""
    ranks = run_ranks(3, job("""
        N, r = rr.size(), rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        blocks, exports = [], dev.counts()["ipc_exports"]
        for count in [100, 100, ring.allreduce_limit, 10 * ring.allreduce_limit, 100]:
            x = make_input(r, (count,), "int32", "sum")
            got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
            assert got.tobytes() == rank_order([make_input(q, (count,), "int32", "sum") for q in range(N)],
                                               "int32", "sum").tobytes()
            blocks.append(memory.stats()["device_blocks"])
        result = blocks, dev.counts()["ipc_exports"] - exports
    """, "hostcuda"), tmp_path, env={"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"},
        timeout=120)
    for r in ranks:
        assert r.result == ([2] * 5, 3), r.result  # made, grown twice; the large window beside it


def test_a_small_ipc_allreduce_whose_headers_differ_reduces_nothing(tmp_path):
    """A rank whose header differs (another shape; a host rank's small path)
    makes the pass give every rank every blob and reduce nothing, and the
    caller's agreement raises MismatchError on every rank for a real
    mismatch. A device failing on one rank before the pass (here: a host
    pointer) fails every rank, naming it."""
    ranks = run_ranks(3, job("""
        from ringreduce.core.protocol import agree
        r = rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        x = make_input(r, (10 if r != 2 else 11,), "float32", "sum")
        got, blobs = small_ipc_allreduce(x, "float32", "sum", in_place=False)
        try:
            agree(blobs, header(ALLREDUCE, opcodes["sum"], codes["float32"], x.shape, None, True, device=True),
                  ("op", "dtype", "shape", "name"), "allreduce", ring)
            mismatch = "agreed"
        except rr.MismatchError as exc:
            mismatch = str(exc)
        x = make_input(r, (10,), "float32", "sum")
        try:
            small_ipc_allreduce(x, "float32", "sum", in_place=False, src_ptr=x.ctypes.data if r == 1 else None)
            failed = "no error"
        except rr.RingReduceError as exc:
            failed = str(exc)
        result = got is None and len(blobs) == 3, mismatch, failed
    """, "emulated"), tmp_path, timeout=60)
    for r in ranks:
        nothing, mismatch, failed = r.result
        assert nothing, r.rank
        assert "shape" in mismatch and "rank 2" in mismatch, mismatch
        assert "rank 1" in failed and "host pointer" in failed, failed


def test_a_small_ipc_window_a_peer_cannot_open_fails_every_rank_naming_it(tmp_path, hostcuda_dir):
    """A ring's small window is opened by its peers at its first operation
    (and after it grows); a rank that cannot open its peers' (IPC no longer
    permitted there) makes every rank raise, naming it, in a handshake that
    follows the pass of a window not yet opened: none waits for it, and none
    goes on alone."""
    ranks = run_ranks(3, job("""
        import time
        r = rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        if r == 2:
            os.environ["HOSTCUDA_IPC_OPEN"] = "0"
        start = time.monotonic()
        try:
            small_ipc_allreduce(make_input(r, (100,), "int64", "sum"), "int64", "sum", in_place=False)
            result = "no error"
        except rr.RingReduceError as exc:
            result = type(exc).__name__, str(exc), exc.rank, time.monotonic() - start < 10
    """, "hostcuda"), tmp_path, env={"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
                                     "RINGREDUCE_TIMEOUT": "30"}, timeout=120)
    for r in ranks:
        assert r.result != "no error", r.rank
        kind, message, at_fault, quick = r.result
        assert at_fault == 2 and "rank 2" in message and quick, r.result


def test_a_rank_whose_fold_fails_after_the_pass_is_named_by_its_peers_next_collective(tmp_path):
    """A failure after the small pass (here rank 1's dst is a host pointer:
    its fold fails) is that rank's: it raises; its peers' results are whole
    (they read its slot, not its dst), and their next collective raises
    PeerLostError naming it at once, instead of waiting for a rank that
    stopped."""
    ranks = run_ranks(3, job("""
        import time
        r, N = rr.rank(), rr.size()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        x = make_input(r, (100,), "int32", "sum")
        want = rank_order([make_input(q, (100,), "int32", "sum") for q in range(N)], "int32", "sum")
        host = np.zeros(100, np.int32)
        try:
            got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False,
                                         dst_ptr=host.ctypes.data if r == 1 else None)
            first = got.tobytes() == want.tobytes()
        except rr.RingReduceError as exc:
            first = type(exc).__name__, str(exc), exc.rank
        start = time.monotonic()
        try:
            small_ipc_allreduce(x, "int32", "sum", in_place=False)
            second = "no error"
        except rr.RingReduceError as exc:
            second = type(exc).__name__, str(exc), exc.rank, time.monotonic() - start < 10
        result = first, second
    """, "emulated"), tmp_path, env={"RINGREDUCE_TIMEOUT": "30"}, timeout=120)
    first, second = ranks[1].result
    assert first[0] == "RingReduceError" and "host pointer" in first[1] and first[2] == 1, first
    for r in (ranks[0], ranks[2]):
        first, second = r.result
        assert first is True, r.result
        assert second[0] == "PeerLostError" and second[2] == 1 and "rank 1" in second[1] and second[3], second


@pytest.mark.parametrize("setting", ["1", "0"])
def test_small_public_allreduces_of_device_arrays_take_one_ipc_pass(tmp_path, setting):
    """rr.allreduce of small device arrays: the first on a ring not yet
    agreed takes the ring's device path, which agrees; later ones take one
    IPC pass (one device copy, two waits) with the setting on, the bounce
    buffer with it off. A rank passing a host array and a rank with another
    small limit make every rank take the ring, with the right sums; another
    name raises MismatchError on every rank."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        r, N = rr.rank(), rr.size()
        want = lambda k, c: sum(((np.arange(c) % 5) * (q + 1) + k).astype(np.float32) for q in range(N))
        x = lambda k, c: ((np.arange(c) % 5) * (r + 1) + k).astype(np.float32)
        ok = []
        ok.append(np.array_equal(np.asarray(rr.allreduce(x(0, 1000).view(Dev))), want(0, 1000)))
        agreed = C.communicator().ring.ipc
        before = device.counts()
        for k in range(5):
            ok.append(np.array_equal(np.asarray(rr.allreduce(x(k, 1000).view(Dev))), want(k, 1000)))
        after = device.counts()
        per_op = {key: (after[key] - before[key]) / 5 for key in ("copies", "waits", "host_copies")}
        y = x(7, 333)
        ok.append(np.array_equal(np.asarray(rr.allreduce(y if r == 1 else y.view(Dev))), want(7, 333)))
        ring = C.communicator().ring
        limit = ring.small_limit
        if r == 0:
            ring.small_limit = 0  # this rank's header says the ring, the others' one IPC pass
        ok.append(np.array_equal(np.asarray(rr.allreduce(y.view(Dev))), want(7, 333)))
        ring.small_limit = limit
        try:
            rr.allreduce(x(1, 10).view(Dev), name="b" if r == 2 else "a")
            ok.append("no error")
        except rr.MismatchError as exc:
            ok.append("rank 2" in str(exc))
        ok.append(np.array_equal(np.asarray(rr.allreduce(x(3, 10).view(Dev), op="avg")), want(3, 10) / N))
        result = ok, agreed, per_op
    """), tmp_path, timeout=120, env={"RINGREDUCE_CUDA_IPC": setting})
    for k in ranks:
        ok, agreed, per_op = k.result
        assert ok == [True] * len(ok), (k.rank, ok)
        assert agreed is (setting == "1")
        if setting == "1":
            assert per_op == {"copies": 1, "waits": 2, "host_copies": 0}, per_op
        else:  # the bounce buffer: one copy down, one up
            assert per_op["host_copies"] == 2, per_op


def test_small_device_allreduces_beside_a_host_rank_stop_asking_for_ipc(tmp_path):
    """A ring with a host rank: the first small device allreduce takes the
    ring's device path (it would agree), meets the host rank, and the ring
    stops asking: later ones take the bounce buffer. The sums are right."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        r, N = rr.rank(), rr.size()
        want = lambda k: sum(((np.arange(100) % 5) * (q + 1) + k).astype(np.float32) for q in range(N))
        ok, asks = [], []
        for k in range(3):
            x = ((np.arange(100) % 5) * (r + 1) + k).astype(np.float32)
            ok.append(np.array_equal(np.asarray(rr.allreduce(x.view(Dev) if r != 1 else x)), want(k)))
            asks.append(C.communicator().ring.small_asks_ipc)
        result = ok, asks, C.communicator().ring.ipc
    """), tmp_path, timeout=120)
    for k in ranks:
        ok, asks, ipc = k.result
        assert ok == [True] * 3 and ipc is None, k.result
        if k.rank != 1:
            assert asks == [False] * 3, asks



def hostcuda_env(hostcuda_dir, **extra):
    return {"LD_LIBRARY_PATH": f"{hostcuda_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}", **extra}


def test_removing_a_process_set_frees_its_small_ipc_window_and_closes_its_peers(tmp_path, hostcuda_dir):
    """A ring's small window lives with the ring, not the device: removing a
    process set closes the peers' small windows each rank opened for it and
    (after a handshake, so no peer has it open) frees its own; the world's
    ring and its windows are untouched and keep working."""
    ranks = run_ranks(3, job("""
        from ringreduce.core import process_sets
        world, r = ring, rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        small_ipc_allreduce(make_input(r, (100,), "int32", "sum"), "int32", "sum", in_place=False)  # the world's
        ps = rr.add_process_set([0, 1])
        before = memory.stats()
        if r < 2:
            ring = process_sets.lookup(ps)
            assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
            for _ in range(3):
                x = make_input(r, (100,), "int32", "sum")
                got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
                assert got.tobytes() == rank_order([make_input(q, (100,), "int32", "sum") for q in range(2)],
                                                   "int32", "sum").tobytes()
            ring = world
        during = memory.stats()
        rr.remove_process_set(ps)
        after = memory.stats()
        x = make_input(r, (100,), "int32", "sum")
        got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
        still = got.tobytes() == rank_order([make_input(q, (100,), "int32", "sum") for q in range(3)],
                                            "int32", "sum").tobytes()
        result = before, during, after, still
    """, "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=120)
    for r in ranks:
        before, during, after, still = r.result
        if r.rank < 2:
            assert during["device_blocks"] == before["device_blocks"] + 1, (before, during)  # the set's small window
            assert during["ipc_open"] == before["ipc_open"] + 1, (before, during)  # the other member's
        for key in ("device_blocks", "ipc_open"):
            assert after[key] == before[key], (r.rank, key, before, after)
        assert after["ipc_freed_while_open"] == 0, after
        assert still, r.rank


def test_two_rings_on_one_device_run_small_ipc_allreduces_from_two_threads(tmp_path):
    """The world's ring and a process set's, one thread each, on one device,
    started in opposite orders on ranks 0 and 1: each small IPC pass lets
    the device go while it waits on its peers, so neither thread waits on
    the other's ring (holding the device through the pass, each rank's first
    thread would keep its second one from the ring the other rank's first
    thread waits on). The sums are right, nothing times out."""
    ranks = run_ranks(3, job("""
        import threading, time
        from ringreduce.core import process_sets
        world, r = ring, rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        ps = rr.add_process_set([0, 1])
        if r < 2:
            ring = process_sets.lookup(ps)
            assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        rings = {"world": (world, 3), "set": (ring, 2)}
        out, errors = {}, []

        def run(name):
            on, size = rings[name]
            try:
                x = make_input(r, (100,), "int64", "sum")
                want = rank_order([make_input(q, (100,), "int64", "sum") for q in range(size)], "int64", "sum")
                head = header(ALLREDUCE, opcodes["sum"], codes["int64"], x.shape, None, True, device=True)
                ok = []
                for _ in range(5):
                    src, dst = Buf(x), Buf(np.zeros_like(x))
                    blobs = device_ipc.allreduce_small(on, dev, head, src.ptr, dst.ptr, x.nbytes, codes["int64"],
                                                       opcodes["sum"])
                    ok.append(blobs is None and dst.get(x.dtype).tobytes() == want.tobytes())
                    memory.free(src.ptr)
                    memory.free(dst.ptr)
                out[name] = ok
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

        order = {0: ["world", "set"], 1: ["set", "world"], 2: ["world"]}[r]
        threads = []
        for name in order:
            threads.append(threading.Thread(target=run, args=(name,)))
            threads[-1].start()
            time.sleep(0.5)  # the first thread is in its pass, waiting on the other rank's first thread's ring
        for t in threads:
            t.join()
        ring = world
        result = out, errors
    """, "emulated"), tmp_path, env={"RINGREDUCE_TIMEOUT": "15"}, timeout=120)
    for r in ranks:
        out, errors = r.result
        assert errors == [], (r.rank, errors)
        assert out == ({"world": [True] * 5, "set": [True] * 5} if r.rank < 2 else {"world": [True] * 5}), out


def test_a_peer_window_with_its_owner_and_generation_but_other_handle_bytes_is_opened_afresh(tmp_path):
    """The peers' cache keys a window by its whole handle: a process that
    reuses a dead rank's pid (a restarted rank) can export a window with the
    same owner and generation as one still cached, and must get its own
    mapping, not the stale one. Here rank 0 forges that handle: another
    device's window under the first one's owner and generation."""
    ranks = run_ranks(2, job("""
        import struct
        other = _core.Device.emulated(patience, identity)
        mine = [bytes(d.ipc_offer()[1]) if rr.rank() == 0 else b"" for d in (dev, other)]
        forged = mine[0][:24] + mine[1][24:] if rr.rank() == 0 else b""
        blobs = comm.exchange_blobs(b"H", mine[0] + forged)
        first, second = blobs[0][1:1 + len(blobs[0]) // 2], blobs[0][1 + len(blobs[0]) // 2:]
        opens = []
        if rr.rank() == 1:
            assert struct.unpack("QQ", first[:16]) == struct.unpack("QQ", second[:16]) and first != second
            for h in (first, first, second):
                assert dev.ipc_probe(h, "emulated", comm.ring_id)
                opens.append(dev.counts()["ipc_opens"])
        comm.exchange_blobs(b"done")  # rank 0 keeps its windows until rank 1 has opened them
        result = opens
    """, "emulated"), tmp_path, timeout=60)
    assert ranks[1].result == [1, 1, 2], ranks[1].result  # the first cached; the forged one opened anew


def test_windows_that_grow_are_freed_only_after_every_peer_closed_them(tmp_path, hostcuda_dir):
    """The large IPC window and a ring's small window that grow keep the old
    one until a handshake after which every peer has opened the new one (and
    so closed the old one), then free it: the host CUDA driver never sees
    memory freed while another process has it open, and device memory
    holds one large and one small window however often they grew."""
    ranks = run_ranks(3, job("""
        N, r = rr.size(), rr.rank()
        blocks = []
        for count in [1_000, 100_000, 1_000_000, 1_000, 3_000_000]:
            x = make_input(r, (count,), "int32", "sum")
            got, ipc = device_allreduce(x, "int32", "sum", in_place=False)
            assert ipc and got.tobytes() == host_allreduce(x, "int32", "sum").tobytes()
            blocks.append(memory.stats()["device_blocks"])
        for count in [100, ring.allreduce_limit, 10 * ring.allreduce_limit, 100, 40 * ring.allreduce_limit]:
            x = make_input(r, (count,), "int32", "sum")
            got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
            assert got.tobytes() == rank_order([make_input(q, (count,), "int32", "sum") for q in range(N)],
                                               "int32", "sum").tobytes()
            blocks.append(memory.stats()["device_blocks"])
        result = blocks, memory.stats()["ipc_freed_while_open"]
    """, "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=180)
    for r in ranks:
        blocks, freed_while_open = r.result
        assert freed_while_open == 0, (r.rank, freed_while_open)
        assert blocks == [1] * 5 + [2] * 5, (r.rank, blocks)


@pytest.mark.parametrize("last", ["small", "large"])
def test_shutdown_frees_no_window_a_slower_peer_still_has_open(tmp_path, hostcuda_dir, last):
    """The last collective before shutdown a small IPC allreduce (whose
    slots the peers read after it returned here) or a large one: rank 0
    shuts down and drops its device at once, its peers a second later. Its
    shutdown waits for its peers' (a handshake after each closed the windows
    it opened for the ring), so no window of its goes while a peer still has
    it open or reads it; every window and mapping is gone after."""
    ranks = run_ranks(3, job(f"""
        import gc, time
        N, r = rr.size(), rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        x = make_input(r, (100,), "int32", "sum")
        small_ipc_allreduce(x, "int32", "sum", in_place=False)
        if {last!r} == "large":
            device_allreduce(make_input(r, (100_000,), "int32", "sum"), "int32", "sum", in_place=False)
        else:
            got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
            assert got.tobytes() == rank_order([make_input(q, (100,), "int32", "sum") for q in range(N)],
                                               "int32", "sum").tobytes()
        if r != 0:
            time.sleep(1)
        rr.shutdown()
        del dev
        gc.collect()
        result = memory.stats()
    """, "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=120)
    for r in ranks:
        stats = r.result
        assert stats["ipc_freed_while_open"] == 0, (r.rank, stats)
        assert stats["ipc_open"] == 0 and stats["device_blocks"] == 0, (r.rank, stats)


def test_the_small_ipc_allreduce_of_gpu_arrays_holds_no_device_gate_through_its_pass(monkeypatch):
    """cupy arrays' small IPC allreduce (cuda.DeviceArrays) holds no gate of
    its device while it runs: its pass lets the device go in C, and a gate
    held through it would keep another ring's collective on the same GPU
    (another thread) waiting on this ring's peers all the same."""
    from types import SimpleNamespace
    from ringreduce.core import cuda, device_ipc
    g, device, seen = object.__new__(cuda.DeviceArrays), object(), []
    g._ready = lambda array: device
    monkeypatch.setattr(device_ipc, "allreduce_small",
                        lambda ring, dev, *args: seen.append(cuda._gate(dev).lock.locked()))
    buf = SimpleNamespace(data=SimpleNamespace(ptr=64), nbytes=8)
    g.allreduce_small_ipc(None, b"head", buf, buf, 0, 0)
    assert seen == [False]


def test_a_small_window_grown_twice_before_its_peers_opened_it_frees_only_the_unopened_one(tmp_path, hostcuda_dir):
    """A small window that grows in a pass whose headers differ (nothing
    read: no peer opens the new window) and grows again in the next keeps
    the one its peers still have open and frees the one none opened; the
    first pass its peers do open frees the rest. Nothing is freed while a
    peer has it open, and the sums are right."""
    ranks = run_ranks(3, job("""
        N, r = rr.size(), rr.rank()
        assert device_allreduce(np.ones(8, np.float32), "float32", "sum", in_place=False)[1]
        x = make_input(r, (100,), "int32", "sum")
        small_ipc_allreduce(x, "int32", "sum", in_place=False)  # every peer opens this rank's small window
        big = 4 * ring.allreduce_limit
        x = make_input(r, (big + (r == 2),), "int32", "sum")  # rank 2's shape differs: nothing read
        got, blobs = small_ipc_allreduce(x, "int32", "sum", in_place=False)
        assert got is None and blobs is not None
        ok = []
        for count in [10 * ring.allreduce_limit, 100]:
            x = make_input(r, (count,), "int32", "sum")
            got, _ = small_ipc_allreduce(x, "int32", "sum", in_place=False)
            ok.append(got.tobytes() == rank_order([make_input(q, (count,), "int32", "sum") for q in range(N)],
                                                  "int32", "sum").tobytes())
        stats = memory.stats()
        result = ok, stats["ipc_freed_while_open"], stats["device_blocks"]
    """, "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=120)
    for r in ranks:
        assert r.result == ([True, True], 0, 2), (r.rank, r.result)  # the large window and one small one


def test_a_window_grown_on_a_process_set_waits_for_the_worlds_peers_too(tmp_path, hostcuda_dir):
    """The large window is the device's, shared by its rings: grown in a
    process set's allreduce, its old one is still open on a world rank
    outside the set, so it is freed only after a world handshake after
    which that rank opened the new one, not at the set's handshake."""
    ranks = run_ranks(3, job("""
        from ringreduce.core import process_sets
        world, r = ring, rr.rank()
        x = make_input(r, (1_000,), "int32", "sum")
        assert device_allreduce(x, "int32", "sum", in_place=False)[1]
        ps = rr.add_process_set([0, 1])
        blocks = []
        if r < 2:
            ring = process_sets.lookup(ps)
            y = make_input(r, (1_000_000,), "int32", "sum")  # the members' windows grow
            got, ipc = device_allreduce(y, "int32", "sum", in_place=False)
            want = rank_order([make_input(q, (1_000_000,), "int32", "sum") for q in range(2)], "int32", "sum")
            assert ipc and got.tobytes() == want.tobytes()  # integers: any order gives the ring's bits
            blocks.append(memory.stats()["device_blocks"])  # the old one kept: rank 2 still has it open
            ring = world
        got, ipc = device_allreduce(x, "int32", "sum", in_place=False)
        assert ipc and got.tobytes() == host_allreduce(x, "int32", "sum").tobytes()
        stats = memory.stats()
        blocks.append(stats["device_blocks"])
        result = blocks, stats["ipc_freed_while_open"]
    """, "hostcuda"), tmp_path, env=hostcuda_env(hostcuda_dir), timeout=120)
    for r in ranks:
        blocks, freed_while_open = r.result
        assert freed_while_open == 0, (r.rank, freed_while_open)
        assert blocks == ([2, 1] if r.rank < 2 else [1]), (r.rank, blocks)


@pytest.mark.parametrize("size", [100, 100_000])
def test_a_rank_shutting_down_while_its_peers_run_a_collective_is_named_lost_by_them(tmp_path, size):
    """On a ring that agreed on IPC, shutdown starts with a pass its peers
    must hear (device_ipc.release): a peer that meets it in an allreduce of
    its own, small (the one IPC pass) or large (the header pass), raises
    PeerLostError naming the rank that shut down, at once; that rank's
    shutdown returns at once, freeing nothing a peer may still read."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent(f"""
        import time
        r, N = rr.rank(), rr.size()
        x = ((np.arange({size}) % 5) * (r + 1)).astype(np.float32)
        rr.allreduce(x.view(Dev))
        assert C.communicator().ring.ipc
        start = time.monotonic()
        if r == 1:
            rr.shutdown()
            result = "shut down", time.monotonic() - start
        else:
            try:
                time.sleep(0.5)
                rr.allreduce(x.view(Dev))
                result = "no error", time.monotonic() - start
            except rr.RingReduceError as exc:
                result = type(exc).__name__, str(exc), exc.rank, time.monotonic() - start
    """), tmp_path, timeout=120, env={"RINGREDUCE_TIMEOUT": "30"})
    _named_lost_by_peers(ranks, shutdown_within=10, closed_said=True)


@pytest.mark.parametrize("world_ipc", [True, False])
def test_a_rank_shutting_down_beside_a_process_set_is_named_lost_at_once_on_either_ring(tmp_path, world_ipc):
    """A peer waiting in a collective on any ring of a rank that shuts down
    hears of it at once, whichever ring it waits on: rank 1, in a process
    set with rank 0 that agreed on IPC, shuts down while ranks 0 and 2 run
    an allreduce on the world's ring. Where the world agreed on IPC too, the
    closing passes run on both rings at once (device_ipc.release_all) and
    they meet rank 1's there; where it did not, the world's ring closes
    before the set's closing pass. Either way they raise PeerLostError naming
    rank 1 at once, instead of waiting out RINGREDUCE_TIMEOUT while rank 1's
    closing pass on the set's ring waits for rank 0."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent(f"""
        import time
        from ringreduce.core import process_sets
        r, N = rr.rank(), rr.size()
        x = ((np.arange(100) % 5) * (r + 1)).astype(np.float32)
        on_world = (lambda a: a.view(Dev)) if {world_ipc} else (lambda a: a)
        rr.allreduce(on_world(x))
        ps = rr.add_process_set([0, 1])
        if r < 2:
            rr.allreduce(x.view(Dev), process_set=ps)
            assert process_sets.lookup(ps).ipc
        assert C.communicator().ring.ipc is ({world_ipc} or None)
        start = time.monotonic()
        if r == 1:
            rr.shutdown()
            result = "shut down", time.monotonic() - start
        else:
            try:
                time.sleep(0.5)
                rr.allreduce(on_world(x))
                result = "no error", time.monotonic() - start
            except rr.RingReduceError as exc:
                result = type(exc).__name__, str(exc), exc.rank, time.monotonic() - start
    """), tmp_path, timeout=120, env={"RINGREDUCE_TIMEOUT": "30"})
    _named_lost_by_peers(ranks, shutdown_within=20, closed_said=world_ipc)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_0d_device_array_allreduces_to_a_0d_array_on_every_path(tmp_path, setting):
    """rr.allreduce of a 0-d GPU array returns a 0-d array, as numpy's does,
    whichever path it takes: the ring's device path (the first, which
    agrees), then one IPC pass (setting on) or the bounce buffer (off), and
    the ring's device path again where this rank's small limit says large.
    (ascontiguousarray makes a 0-d array 1-d, in numpy as in cupy.)"""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        r, N = rr.rank(), rr.size()
        got = []
        for k in range(3):
            x = np.array(r + k, np.float32).view(Dev)
            y = rr.allreduce(x)
            out = np.array(-1, np.float32).view(Dev)
            z = rr.allreduce(x, out=out)
            got.append((np.asarray(y).shape, np.asarray(y).tolist(), z is out, np.asarray(out).shape,
                         np.asarray(out).tolist()))
        ring = C.communicator().ring
        ring.small_limit = -1  # the small limit says large: the ring's device path
        y = rr.allreduce(np.array(r, np.float32).view(Dev))
        got.append((np.asarray(y).shape, np.asarray(y).tolist()))
        result = got, ring.ipc
    """), tmp_path, timeout=120, env={"RINGREDUCE_CUDA_IPC": setting})
    total = lambda k: float(sum(q + k for q in range(3)))  # noqa: E731
    for r in ranks:
        got, ipc = r.result
        assert ipc is (setting == "1"), r.result
        assert got[:3] == [((), total(k), True, (), total(k)) for k in range(3)], (r.rank, got)
        assert got[3] == ((), total(0)), (r.rank, got)


def test_a_barrier_named_as_the_closing_pass_is_refused_and_never_pairs_with_a_shutdown(tmp_path):
    """The closing pass's name (protocol.CLOSING_NAME) is reserved: a barrier
    so named would pair with a peer's shutdown on a ring that agreed on IPC,
    returning as if that peer were there, and the next collective would meet
    the peer's release handshake. It is refused (ValueError on the ranks that
    called it); the next collective then names the rank that shut down."""
    ranks = run_ranks(3, EMULATED_FAMILY + textwrap.dedent("""
        import time
        from ringreduce.core.protocol import CLOSING_NAME
        r = rr.rank()
        x = np.ones(100, np.float32)
        rr.allreduce(x.view(Dev))
        assert C.communicator().ring.ipc
        got = []
        if r == 1:
            rr.shutdown()
        else:
            time.sleep(0.3)
            for call in (lambda: rr.barrier(name=CLOSING_NAME), lambda: rr.allreduce(x.view(Dev))):
                try:
                    call()
                    got.append("no error")
                except (ValueError, rr.RingReduceError) as exc:
                    got.append((type(exc).__name__, str(exc), getattr(exc, "rank", None)))
        result = got
    """), tmp_path, timeout=120, env={"RINGREDUCE_TIMEOUT": "30"})
    for k in (ranks[0], ranks[2]):
        barrier, after = k.result
        assert barrier[0] == "ValueError" and "reserved" in barrier[1], k.result
        assert after[0] == "PeerLostError" and after[2] == 1, k.result


def test_a_header_pass_that_meets_no_header_names_the_rank_that_sent_it(tmp_path):
    """A rank out of step, whose blob in another rank's header pass is no
    header (a pass of its own: an IPC handshake, the agreement's), is named
    by the ranks whose header pass met it, never "a peer"."""
    ranks = run_ranks(3, """
        from ringreduce.core import collectives
        comm = collectives.communicator().ring.comm
        try:
            if rr.rank() == 1:
                comm.exchange_blobs(b"XYZ", b"not a header")
            else:
                rr.barrier()
            result = "no error"
        except rr.RingReduceError as exc:
            result = type(exc).__name__, str(exc), exc.rank
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "30"})
    for k in (ranks[0], ranks[2]):
        kind, message, rank = k.result
        assert kind == "RingReduceError" and rank == 1 and "rank 1" in message, k.result


def _named_lost_by_peers(ranks, shutdown_within, closed_said):
    """Rank 1 shut down within shutdown_within seconds; every other rank's
    collective raised PeerLostError naming rank 1 within 10 s (saying it
    closed the ring where closed_said)."""
    for k in ranks:
        if k.rank == 1:
            assert k.result[0] == "shut down" and k.result[1] < shutdown_within, k.result
        else:
            kind, message, rank, took = k.result
            assert kind == "PeerLostError" and rank == 1 and "rank 1" in message, k.result
            assert "rank 1 closed the ring" in message or not closed_said, k.result
            assert took < 10, k.result
