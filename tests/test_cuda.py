"""The CUDA kernels (csrc/cuda/reduce.cu). Without a GPU: the source must
compile with nvcc (when nvcc is here) for sm_80 and sm_90. With cupy and a
GPU: every dtype and op against the CPU kernels, bit for bit, since both
compile the same arithmetic (reduce_math.h)."""
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from needs import WHY_NO_GPU, gpu
from ranks import REPO
from ringreduce import _core
from ringreduce import cuda

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
                          "-o", str(tmp_path / "k.fatbin"), str(REPO / "csrc" / "cuda" / "reduce.cu")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.fatbin").stat().st_size > 10_000
    # Every kernel the loader asks for is there (a cubin is plain ELF: the names are in it).
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_80", "-o", str(cubin),
                    str(REPO / "csrc" / "cuda" / "reduce.cu")], check=True, capture_output=True, timeout=240)
    symbols = cubin.read_bytes()
    for dtype in DTYPES:
        for op in cuda.OPS:
            assert f"rr_reduce_{dtype}_{op}".encode() in symbols
        assert f"rr_divide_{dtype}".encode() in symbols
    for kind in ("float16", "bfloat16"):
        assert f"rr_cast_float32_to_{kind}".encode() in symbols and f"rr_cast_{kind}_to_float32".encode() in symbols


def test_without_a_gpu_the_loader_says_why_and_import_costs_nothing():
    if WHY_NO_GPU is None:
        pytest.skip("a GPU is here")
    with pytest.raises(Exception, match="cupy|CUDA"):
        cuda._module()


def sample(name, count, seed):
    g = np.random.default_rng(seed)
    if name in ("float16", "bfloat16"):
        bits = g.integers(0, 1 << 16, count, dtype=np.uint16)  # every kind of value: subnormals, inf, NaN
        return bits.view(dt(name))
    if name.startswith("float"):
        return (g.standard_normal(count) * 1e3).astype(name)
    info = np.iinfo(name)
    return g.integers(info.min, info.max, count, dtype=name, endpoint=True)


def on_gpu(x):
    """A cupy copy of x; 16-bit floats as uint16 (cupy has no bfloat16)."""
    import cupy as cp
    return cp.asarray(x.view(np.uint16) if x.dtype in (np.float16, dt("bfloat16")) else x)


def raw(d):
    import cupy as cp
    return cp.asnumpy(d).view(np.uint8).tobytes()


@gpu
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("count", [0, 1, 7, 4096 + 3, 1_000_003])
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(name, op, count):
    import cupy as cp
    a, b = sample(name, count, 1), sample(name, count, 2)
    want = a.copy()
    _core.reduce(want.view(np.uint8), b.view(np.uint8).tobytes(), CODES[name], OPS[op])
    da, db = on_gpu(a), on_gpu(b)
    out = cp.empty_like(da)
    cuda.reduce3(out, da, db, op, dtype=name)
    assert raw(out) == want.view(np.uint8).tobytes()
    cuda.reduce3(da[1:], da[1:], db[1:], op, dtype=name)  # in place and misaligned: the scalar path
    assert raw(da[1:]) == want[1:].view(np.uint8).tobytes()


@gpu
@pytest.mark.parametrize("name", DTYPES)
def test_gpu_divide_matches_the_cpu(name):
    a = sample(name, 10_001, 3)
    want = a.copy()
    _core.divide(want.view(np.uint8), CODES[name], 3)
    d = on_gpu(a)
    cuda.divide(d, 3, dtype=name)
    assert raw(d) == want.view(np.uint8).tobytes()


@gpu
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_gpu_casts_round_like_ml_dtypes(name):
    import cupy as cp
    x = (np.random.default_rng(4).standard_normal(100_003) * 300).astype(np.float32)
    x[:3] = [np.nan, np.inf, 1e-30]
    out = cp.empty(x.size, dtype=cp.uint16)
    cuda.cast(out, cp.asarray(x), dst_dtype=name)
    want = x.astype(dt(name)).view(np.uint16)
    got = cp.asnumpy(out)
    assert got[1:].tobytes() == want[1:].tobytes() and np.isnan(got[:1].view(dt(name)).astype(np.float32)).all()
    back = cp.empty(x.size, dtype=cp.float32)
    cuda.cast(back, out, src_dtype=name)
    assert cp.asnumpy(back)[1:].tobytes() == want[1:].view(dt(name)).astype(np.float32).tobytes()
