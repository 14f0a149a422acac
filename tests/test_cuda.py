"""The CUDA kernels (csrc/kernels/cuda/reduce.cu): every dtype and op against the CPU
kernels, bit for bit, since both compile the same arithmetic (reduce_math.h).
They run on a GPU where cupy has one, and always on the host: g++ compiles the
same source and the host CUDA driver (tests/hostcuda.py) launches it, thread
by thread, so the vector loads, grid-stride loops and tails are checked here
too. The source must also compile with nvcc (when nvcc is here) for sm_80
and sm_90."""
import ctypes
import shutil
import subprocess
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from hostcuda import HostCuda
from needs import GPU_MARKS, WHY_NO_GPU
from ranks import REPO
from ringreduce import _core
from ringreduce.core import cuda

KERNEL = REPO / "csrc" / "kernels" / "cuda" / "reduce.cu"

DTYPES = list(cuda.DTYPES)
CODES = {name: getattr(_core, name.upper()) for name in DTYPES}
OPS = {"sum": _core.SUM, "prod": _core.PROD, "min": _core.MIN, "max": _core.MAX}

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def dt(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_kernels_compile_with_nvcc_for_sm80_and_sm90(tmp_path):
    out = subprocess.run(["nvcc", "-std=c++17", "-O3", "-fatbin", "-gencode=arch=compute_80,code=sm_80",
                          "-gencode=arch=compute_90,code=sm_90", "-Werror", "all-warnings",
                          "-o", str(tmp_path / "k.fatbin"), str(KERNEL)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.fatbin").stat().st_size > 10_000
    # Every kernel the loader asks for is there (a cubin is plain ELF: the names are in it).
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_80", "-o", str(cubin),
                    str(KERNEL)], check=True, capture_output=True, timeout=240)
    symbols = cubin.read_bytes()
    for dtype in DTYPES:
        for op in cuda.OPS:
            assert f"rr_reduce_{dtype}_{op}".encode() in symbols
        assert f"rr_divide_{dtype}".encode() in symbols
    for dtype in cuda.MEAN_DTYPES:
        assert f"rr_mean_{dtype}".encode() in symbols
    for kind in ("float16", "bfloat16"):
        assert f"rr_cast_float32_to_{kind}".encode() in symbols and f"rr_cast_{kind}_to_float32".encode() in symbols


def nvrtc():
    """NVRTC and CUDA's C++ headers from their wheels (the test extras), or None."""
    try:
        import nvidia.cu13
    except ImportError:
        return None
    root = Path(nvidia.cu13.__path__[0])
    lib, builtins = root / "lib" / "libnvrtc.so.13", sorted((root / "lib").glob("libnvrtc-builtins.so.*"))
    if not lib.exists() or not builtins:
        return None
    ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)  # NVRTC opens it by name, not by path
    return ctypes.CDLL(str(lib)), root / "include" / "cccl"


@pytest.mark.skipif(nvrtc() is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc nvidia-cuda-cccl)")
def test_kernels_compile_at_run_time_with_nvrtc():
    """Where no fatbin was built, cupy.RawModule compiles reduce.cu with NVRTC,
    which has no C library headers: the source must build there as it is,
    with the include path cupy gives it (CUDA's C++ library)."""
    lib, cccl = nvrtc()
    src = KERNEL.read_bytes()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"reduce.cu", 0, None, None) == 0
    opts = [b"-std=c++17", b"-arch=sm_90", f"-I{KERNEL.parent.parent}".encode(), f"-I{KERNEL.parent}".encode(),
            f"-I{cccl}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, cubin) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    names = [f"rr_reduce_{d}_{op}" for d in DTYPES for op in cuda.OPS] + [f"rr_divide_{d}" for d in DTYPES]
    names += [f"rr_mean_{d}" for d in cuda.MEAN_DTYPES]
    missing = [n for n in names if n.encode() not in cubin.raw]
    assert not missing, missing


def test_without_a_gpu_the_loader_says_why_and_import_costs_nothing():
    if WHY_NO_GPU is None:
        pytest.skip("a GPU is here")
    with pytest.raises(Exception, match="cupy|CUDA"):
        cuda.kernels()


class FakeCupy:
    """cupy's RawModule over the host CUDA driver (HostCuda): a module given a
    path loads that file at its first get_function, one given code compiles
    it then with "NVRTC" for the device's compute capability, as cupy does;
    driver errors raise as cupy's CUDADriverError does."""

    class DriverError(Exception):
        pass

    def __init__(self, h: HostCuda):
        self.h, self.compiled = h, []
        cupy = self

        class RawModule:
            def __init__(self, code=None, path=None, options=()):
                self.code, self.path, self.options, self.handle = code, path, options, None

            def _load(self):
                if self.handle is None:
                    cupy.h.make_current()
                    handle = ctypes.c_void_p()
                    if self.path:
                        cupy.check(cupy.h.lib.cuModuleLoad(ctypes.byref(handle), self.path.encode()))
                    else:
                        assert self.code == KERNEL.read_text() and "-std=c++17" in self.options  # reduce.cu
                        cc = [ctypes.c_int(), ctypes.c_int()]
                        for attribute, value in zip((75, 76), cc):  # compute capability major, minor
                            cupy.check(cupy.h.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, 0))
                        image = f"hostcuda-module sm_{cc[0].value}{cc[1].value}".encode()
                        cupy.compiled.append(image)
                        cupy.check(cupy.h.lib.cuModuleLoadData(ctypes.byref(handle), image))
                    self.handle = handle
                return self.handle

            def get_function(self, name):
                f = ctypes.c_void_p()
                cupy.check(cupy.h.lib.cuModuleGetFunction(ctypes.byref(f), self._load(), name.encode()))
                return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=f.value))

        self.RawModule = RawModule

    def check(self, rc):
        if rc:
            text = ctypes.c_char_p()
            self.h.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise self.DriverError(f"CUDA_ERROR {rc}: {text.value.decode()}")


@pytest.mark.parametrize("fatbin, arch, origin", [
    ("sm_80 sm_90 compute_90", 90, "fatbin"),
    ("sm_80 sm_90 compute_90", 100, "fatbin"),  # a newer GPU compiles the fatbin's PTX as it loads
    ("sm_80 sm_90", 100, "NVRTC"),  # nothing for it: reduce.cu compiled for it
    (None, 90, "NVRTC"),  # no fatbin built
])
def test_kernels_come_from_the_fatbin_where_it_loads_else_from_nvrtc(monkeypatch, tmp_path, hostcuda_dir, fatbin,
                                                                     arch, origin):
    """cuda.kernels() loads the fatbin on the GPU where it holds code for it;
    where it holds none (built for other architectures, without PTX for
    this one: the driver refuses it with CUDA_ERROR_NO_BINARY_FOR_GPU) or
    where none was built, it compiles reduce.cu with NVRTC through cupy for
    this GPU. cuda.kernel_origin() says which, and why NVRTC; every kernel
    the ring's device takes is there either way."""
    cupy = FakeCupy(HostCuda(hostcuda_dir / "libcuda.so.1"))
    monkeypatch.setenv("HOSTCUDA_ARCH", str(arch))
    monkeypatch.setattr(cuda, "cupy_or_none", lambda: cupy)
    monkeypatch.setattr(cuda, "available", lambda: None)
    monkeypatch.setattr(cuda, "FATBIN", tmp_path / "reduce_kernels.fatbin")
    if fatbin:
        cuda.FATBIN.write_text(f"hostcuda-module {fatbin}")
    cuda._loaded.cache_clear()
    try:
        said = cuda.kernel_origin()
        assert said.startswith(origin), said
        if origin == "NVRTC":
            assert cupy.compiled == [f"hostcuda-module sm_{arch}".encode()]
            assert ("no kernel image is available" in said) == bool(fatbin), said
            assert ("no fatbin was built" in said) == (not fatbin), said
        else:
            assert cupy.compiled == []
        reduce, divide, mean = cuda.kernel_table(lambda name: cuda.kernels().get_function(name).kernel.ptr)
        assert all(reduce[i][j] for i in range(len(reduce)) for j in range(len(cuda.OPS)))
        assert all(divide) and all(mean)
    finally:
        cuda._loaded.cache_clear()


def sample(name, count, seed):
    g = np.random.default_rng(seed)
    if name in ("float16", "bfloat16"):
        bits = g.integers(0, 1 << 16, count, dtype=np.uint16)  # every kind of value: subnormals, inf, NaN
        return bits.view(dt(name))
    if name.startswith("float"):
        return (g.standard_normal(count) * 1e3).astype(name)
    info = np.iinfo(name)
    return g.integers(info.min, info.max, count, dtype=name, endpoint=True)


class GpuKernels:
    """reduce.cu on a GPU, through ringreduce.core.cuda and cupy (16-bit floats as
    uint16: cupy has no bfloat16)."""

    def __init__(self):
        import cupy
        self.cp = cupy

    def put(self, x):
        return self.cp.asarray(x.view(np.uint16) if x.dtype.itemsize == 2 and x.dtype.kind in "fV" else x)

    def reduce(self, a, b, name, op, skip=0, in_place=False):
        da, db = self.put(a)[skip:], self.put(b)[skip:]
        out = da if in_place else self.cp.empty_like(da)
        cuda.reduce3(out, da, db, op, dtype=name)
        return self.cp.asnumpy(out).tobytes()

    def mean_fold(self, x, mean, name, k, skip=0, into=None):
        dx, dm = self.put(x)[skip:], self.put(mean)[skip:]
        out = {"x": dx, "mean": dm}.get(into) if into else self.cp.empty_like(dx)
        cuda.mean_fold(out, dx, dm, k, dtype=name)
        return self.cp.asnumpy(out).tobytes()

    def divide(self, a, name, n):
        d = self.put(a)
        cuda.divide(d, n, dtype=name)
        return self.cp.asnumpy(d).tobytes()

    def cast(self, x, frm, to, itemsize):
        out = self.cp.empty(x.size, dtype=self.cp.uint16 if itemsize == 2 else self.cp.float32)
        cuda.cast(out, self.put(x), dst_dtype=to, src_dtype=frm)
        return self.cp.asnumpy(out).tobytes()


class HostKernels:
    """reduce.cu compiled for the host, launched through the host CUDA driver
    (tests/hostcuda.py) with the grid ringreduce.core.cuda would use, or `grid`."""

    def __init__(self, driver, grid=None):
        self.h, self.grid = driver, grid
        self.ptrs = []

    def put(self, x):
        p = self.h.alloc(x.nbytes)
        self.h.write(p, x.tobytes())
        self.ptrs.append(p)
        return p

    def _launch(self, name, count, *args):
        """Runs kernel name over count elements; args as its C signature takes them."""
        grid, block = (self.grid, 32) if self.grid else (cuda.launch_grid(count)[0], cuda.THREADS)
        self.h.launch(name, grid, block, *args)

    def reduce(self, a, b, name, op, skip=0, in_place=False):
        k = skip * a.dtype.itemsize
        pa, pb = self.put(a) + k, self.put(b) + k
        out = pa if in_place else self.put(np.zeros_like(a[skip:]))
        count = a.size - skip
        self._launch(f"rr_reduce_{name}_{op}", count, *map(ctypes.c_uint64, (out, pa, pb)), ctypes.c_size_t(count))
        return self.h.read(out, count * a.dtype.itemsize)

    def mean_fold(self, x, mean, name, k, skip=0, into=None):
        off = skip * x.dtype.itemsize
        px, pm = self.put(x) + off, self.put(mean) + off
        count = x.size - skip
        out = {"x": px, "mean": pm}.get(into) if into else self.put(np.zeros_like(x[skip:]))
        self._launch(f"rr_mean_{name}", count, *map(ctypes.c_uint64, (out, px, pm)), ctypes.c_size_t(count),
                     ctypes.c_int(k))
        return self.h.read(out, count * x.dtype.itemsize)

    def divide(self, a, name, n):
        p = self.put(a)
        self._launch(f"rr_divide_{name}", a.size, ctypes.c_uint64(p), ctypes.c_size_t(a.size), ctypes.c_int(n))
        return self.h.read(p, a.nbytes)

    def cast(self, x, frm, to, itemsize):
        out = self.put(np.zeros(x.size * itemsize, np.uint8))
        self._launch(f"rr_cast_{frm}_to_{to}", x.size, ctypes.c_uint64(out), ctypes.c_uint64(self.put(x)),
                     ctypes.c_size_t(x.size))
        return self.h.read(out, x.size * itemsize)

    def close(self):
        for p in self.ptrs:
            self.h.free(p)


@pytest.fixture(params=["host", "host-small-grid", pytest.param("gpu", marks=GPU_MARKS)])
def kernels(request):
    """Where reduce.cu runs: a GPU, or the host driver (with the usual grid, or
    3 blocks of 32 threads, so every thread loops many times)."""
    if request.param == "gpu":
        yield GpuKernels()
        return
    k = HostKernels(HostCuda(request.getfixturevalue("hostcuda_dir") / "libcuda.so.1"),
                    grid=3 if request.param == "host-small-grid" else None)
    yield k
    k.close()


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("count", [0, 1, 7, 4096 + 3, 1_000_003])
def test_cuda_kernels_match_the_cpu_kernels_bit_for_bit(kernels, name, op, count):
    a, b = sample(name, count, 1), sample(name, count, 2)
    want = a.copy()
    _core.reduce(want.view(np.uint8), b.view(np.uint8).tobytes(), CODES[name], OPS[op])
    assert_same_bits_but_nan_payloads(kernels.reduce(a, b, name, op), want)
    if count:  # in place and misaligned: the scalar path
        assert_same_bits_but_nan_payloads(kernels.reduce(a, b, name, op, skip=1, in_place=True), want[1:])


def assert_same_bits_but_nan_payloads(got: bytes, want: np.ndarray):
    """Bit for bit, except which NaN a NaN is: arithmetic on NaNs gives an
    operand's payload on x86 (whichever operand the compiler put first) and
    CUDA's canonical NaN on a GPU. min/max pick an operand, so theirs match too."""
    got = np.frombuffer(got, dtype=want.dtype)
    if want.dtype.kind in "iu":
        assert got.tobytes() == want.tobytes()
        return
    nan = np.isnan(want.astype(np.float64))
    assert np.array_equal(np.isnan(got.astype(np.float64)), nan)
    assert got[~nan].tobytes() == want[~nan].tobytes()


@pytest.mark.parametrize("name", cuda.MEAN_DTYPES)
@pytest.mark.parametrize("k", [2, 3, 7])
@pytest.mark.parametrize("count", [1, 4096 + 3, 300_007])
def test_cuda_running_mean_matches_the_cpu_bit_for_bit(kernels, name, k, count):
    """The 16-bit average's fold (double arithmetic, one rounding) gives the
    CPU's bits: mixed CPU/GPU rings depend on it. Every bit pattern, in and
    out of place (dst = x in the ring, dst = mean in the rank-order fold)."""
    x, m = sample(name, count, 5), sample(name, count, 6)
    want = m.copy()
    _core.mean_fold(want.view(np.uint8), x.view(np.uint8).tobytes(), CODES[name], k)
    assert_same_bits_but_nan_payloads(kernels.mean_fold(x, m, name, k), want)
    assert_same_bits_but_nan_payloads(kernels.mean_fold(x, m, name, k, into="x"), want)
    assert_same_bits_but_nan_payloads(kernels.mean_fold(x, m, name, k, skip=1, into="mean"), want[1:])


@pytest.mark.parametrize("name", DTYPES)
def test_cuda_divide_matches_the_cpu(kernels, name):
    a = sample(name, 10_001, 3)
    want = a.copy()
    _core.divide(want.view(np.uint8), CODES[name], 3)
    assert kernels.divide(a, name, 3) == want.tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_cuda_casts_round_like_ml_dtypes(kernels, name):
    x = (np.random.default_rng(4).standard_normal(100_003) * 300).astype(np.float32)
    x[:3] = [np.nan, np.inf, 1e-30]
    want = x.astype(dt(name)).view(np.uint16)
    got = np.frombuffer(kernels.cast(x, "float32", name, 2), np.uint16)
    assert got[1:].tobytes() == want[1:].tobytes() and np.isnan(got[:1].view(dt(name)).astype(np.float32)).all()
    back = kernels.cast(got, name, "float32", 4)
    assert back[4:] == want[1:].view(dt(name)).astype(np.float32).tobytes()


def test_the_kernel_wrappers_refuse_strided_or_mismatched_arrays():
    """The kernels take bare pointers and walk dst's count of elements from
    each one: a strided view would be read as if contiguous (silently wrong)
    and a shorter input past its end (faulting the GPU context). The
    wrappers refuse both with ValueError before anything launches, so this
    holds with or without a GPU (cupy arrays where there is one)."""
    xp = np
    if WHY_NO_GPU is None:
        import cupy as xp
    a, b, out = (xp.arange(64, dtype=xp.float32) for _ in range(3))
    h16 = xp.zeros(64, dtype=xp.uint16)
    calls = [
        lambda: cuda.reduce3(out[:32], a[::2], b[:32], "sum"),
        lambda: cuda.reduce3(out, a, b[:32], "sum"),
        lambda: cuda.mean_fold(h16[::2], h16[:32], h16[:32], 2, dtype="float16"),
        lambda: cuda.mean_fold(h16, h16, h16[:32], 2, dtype="float16"),
        lambda: cuda.divide(a[::2], 3),
        lambda: cuda.cast(h16[:32], a, dst_dtype="float16"),
        lambda: cuda.cast(h16[::2], a[:32], dst_dtype="float16"),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError, match="C-contiguous arrays of"):
            call()
