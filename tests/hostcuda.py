"""A CUDA driver over host memory, with csrc/kernels/cuda/reduce.cu's kernels compiled
for the host (tests/hostcuda/driver.cpp): the code written for a GPU runs here.

Built once per test session into a folder as libcuda.so.1. A rank whose
LD_LIBRARY_PATH holds that folder gets it when the ring's CUDA device
(csrc/device/cuda_device.c) opens the driver; `HostCuda` drives it from Python:
device memory, kernel launches through cuLaunchKernel, and counts of what is
alive. The driver's rules (strict contexts, bounds, late work) are in its
source.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from ranks import REPO

SOURCES = Path(__file__).resolve().parent / "hostcuda"
STATS = ("contexts", "streams", "events", "device_blocks", "pinned_blocks", "pageable_copies", "launches",
         "sticky_error", "ipc_open", "registered", "ipc_open_calls", "ipc_freed_while_open")


def why_not_buildable() -> str | None:
    return None if shutil.which("g++") else "g++ is not on PATH"


def build(folder: Path, defines: tuple[str, ...] = ()) -> Path:
    """Compiles the driver and the kernels into folder/libcuda.so.1; returns
    folder. defines: the driver's build variants (-D<name>, e.g.
    HOSTCUDA_NO_UUID_V2: a driver without cuDeviceGetUuid_v2)."""
    cmd = ["g++", *[f"-D{d}" for d in defines], "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wno-unknown-pragmas", "-Werror",
           "-Wl,-soname,libcuda.so.1", "-include", str(SOURCES / "cuda_builtins.h"),
           "-x", "c++", str(REPO / "csrc" / "kernels" / "cuda" / "reduce.cu"), "-x", "none", str(SOURCES / "driver.cpp"),
           "-o", str(folder / "libcuda.so.1"), "-ldl", "-pthread"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"building the host CUDA driver failed:\n{out.stderr}")
    return folder


class HostCuda:
    """The loaded driver. `path` None finds libcuda.so.1 through LD_LIBRARY_PATH,
    the same library the ring's CUDA device then opens."""

    def __init__(self, path: Path | str | None = None):
        self.lib = ctypes.CDLL(str(path) if path else "libcuda.so.1")
        self.lib.hostcuda_function.restype = ctypes.c_void_p
        self.lib.hostcuda_alloc.restype = ctypes.c_uint64
        self.lib.hostcuda_alloc.argtypes = [ctypes.c_size_t]
        self.lib.hostcuda_free.argtypes = [ctypes.c_uint64]
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self._context = None

    def function(self, name: str) -> int:
        handle = self.lib.hostcuda_function(name.encode())
        if not handle:
            raise KeyError(f"no kernel {name}")
        return handle

    def ring_device(self, ordinal: int = 0):
        """The ring's CUDA device (csrc/device/cuda_device.c) on this driver, with the
        kernels ringreduce.core.cuda would hand it on a GPU."""
        from ringreduce import _core
        from ringreduce.core import cuda
        return _core.Device.cuda(ordinal, *cuda.kernel_table(self.function))

    # Device memory, the way cupy would hand it out.
    def alloc(self, nbytes: int) -> int:
        return self.lib.hostcuda_alloc(max(nbytes, 1))

    def free(self, ptr: int) -> None:
        self.lib.hostcuda_free(ptr)

    def write(self, ptr: int, data: bytes) -> None:
        ctypes.memmove(ptr, data, len(data))  # device memory is host memory here

    def read(self, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_longlong * len(STATS))()
        self.lib.hostcuda_stats(out)
        return dict(zip(STATS, out))

    # The driver API, for launching kernels from a test.
    def _check(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise RuntimeError(f"{name} returned CUDA error {rc}")

    def make_current(self) -> None:
        if self._context is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self._check("cuInit", 0)
            self._check("cuDeviceGet", ctypes.byref(dev), 0)
            self._check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self._context = ctx
        self._check("cuCtxSetCurrent", self._context)

    def launch(self, name: str, grid: int, block: int, *args) -> None:
        """Runs kernel `name` over args (ctypes values, as its C signature
        takes them) on the default stream and waits for it."""
        self.make_current()
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._check("cuLaunchKernel", self.function(name), grid, 1, 1, block, 1, 1, 0, None, params, None)
        self._check("cuStreamSynchronize", None)
