"""Builds ringreduce._core from csrc/, and ringreduce._mpi where an MPI is
found, and lists the packages and their data. Metadata lives in pyproject.toml.

The CUDA kernels are optional too: RINGREDUCE_CUDA=1 compiles
csrc/kernels/cuda/reduce.cu with nvcc into ringreduce/reduce_kernels.fatbin (sm_80,
sm_90; RINGREDUCE_CUDA_ARCHS to change), which ringreduce.cuda loads through
cupy. Without it cupy compiles the same source at run time.

The MPI transport is optional: set MPICC=/path/to/mpicc (for example the one
pip's `mpich` package puts in the environment's bin/), or have mpicc on PATH,
when building. Without it the package builds and runs over TCP alone.
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

# -fno-trapping-math: we never enable floating-point traps, and without it gcc
# will not turn the 16-bit conversions' selects (reduce_math.h) into vector
# blends, so the portable float16 loops would stay scalar. Results are the same.
FLAGS = ["-O3", "-std=gnu11", "-fno-trapping-math", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
         "-Wno-cast-function-type"]
# csrc/ in its layers, each folder leaning only on the ones listed before it
# (docs/architecture.md, "The C core"); includes name paths from csrc/.
CORE_SOURCES = ["csrc/common/error.c",
                "csrc/kernels/reduce.c", "csrc/kernels/reduce16_x86.c",
                "csrc/device/device.c", "csrc/device/ipc_windows.c", "csrc/device/device_emulated.c", "csrc/device/cuda_device.c",
                "csrc/transport/tcp.c", "csrc/transport/control_star.c", "csrc/transport/shm_link.c",
                "csrc/memory/shared_region.c", "csrc/memory/peer_map.c",
                "csrc/schedule/ring.c", "csrc/schedule/recursive_doubling.c", "csrc/schedule/alltoall.c",
                "csrc/schedule/host_arena.c", "csrc/schedule/cma.c", "csrc/schedule/ipc.c",
                "csrc/binding/module.c", "csrc/binding/comm.c", "csrc/binding/errors.c", "csrc/binding/signals.c",
                "csrc/binding/collectives.c", "csrc/binding/tuning.c", "csrc/binding/counters.c",
                "csrc/binding/kernels.c", "csrc/binding/device_binding.c", "csrc/binding/shared_region_binding.c"]
MPI_SOURCES = ["csrc/binding/mpi_module.c", "csrc/transport/mpi_transport.c", "csrc/common/error.c"]
INCLUDE_DIRS = ["csrc"]
HEADERS = sorted(str(p) for p in Path("csrc").rglob("*.h"))


def find_mpicc():
    for candidate in [os.environ.get("MPICC"), shutil.which("mpicc"),
                      os.path.join(os.path.dirname(sys.executable), "mpicc")]:
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def mpi_extension():
    """ringreduce._mpi, compiled with the flags mpicc would use; None without MPI."""
    mpicc = find_mpicc()
    if not mpicc:
        print("ringreduce: no mpicc found (set MPICC=...): building without the MPI transport", file=sys.stderr)
        return None
    try:
        show = subprocess.run([mpicc, "-show"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"ringreduce: {mpicc} -show failed ({exc}): building without MPI", file=sys.stderr)
        return None
    inc = [a[2:] for a in show if a.startswith("-I")]
    libdirs = [a[2:] for a in show if a.startswith("-L")]
    libs = [a[2:] for a in show if a.startswith("-l")]
    link = [a for a in show if a.startswith("-Wl,")] + [f"-Wl,-rpath,{d}" for d in libdirs]
    print(f"ringreduce: building the MPI transport with {mpicc}: {shlex.join(show)}", file=sys.stderr)
    return Extension("ringreduce._mpi", sources=MPI_SOURCES,
                     depends=HEADERS, include_dirs=INCLUDE_DIRS + inc, library_dirs=libdirs,
                     libraries=libs, extra_compile_args=FLAGS, extra_link_args=link)


def cuda_fatbin():
    """ringreduce/reduce_kernels.fatbin from csrc/kernels/cuda/reduce.cu, when asked for."""
    if os.environ.get("RINGREDUCE_CUDA", "0") in ("", "0"):
        return []
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        sys.exit("ringreduce: RINGREDUCE_CUDA=1 but nvcc is not on PATH")
    archs = os.environ.get("RINGREDUCE_CUDA_ARCHS", "80,90").split(",")
    cmd = [nvcc, "-std=c++17", "-O3", "-fatbin", "-o", "ringreduce/reduce_kernels.fatbin",
           "csrc/kernels/cuda/reduce.cu"]
    cmd += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX: newer GPUs compile it at load
    print("ringreduce: " + shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return ["reduce_kernels.fatbin"]


core = Extension("ringreduce._core", sources=CORE_SOURCES, depends=HEADERS, include_dirs=INCLUDE_DIRS,
                 extra_compile_args=FLAGS,
                 libraries=["pthread", "dl"])

# Every subpackage, and the sources compiled at run time: the CUDA kernels
# (ringreduce.cuda, through cupy) and the TensorFlow op for TF1 graphs
# (ringreduce/tensorflow/async_op.py, against the TensorFlow installed then,
# which pip's isolated build cannot import). csrc/ ships as ringreduce/csrc/
# holding those files only (an editable install reads ./csrc itself).
setup(ext_modules=[core] + [e for e in [mpi_extension()] if e is not None],
      packages=find_packages(include=["ringreduce", "ringreduce.*"]) + ["ringreduce.csrc.kernels",
                                                                        "ringreduce.csrc.kernels.cuda",
                                                                        "ringreduce.csrc.tf"],
      package_dir={"ringreduce.csrc": "csrc"},
      include_package_data=False,
      package_data={"ringreduce": cuda_fatbin(), "ringreduce.csrc.kernels": ["reduce_math.h"],
                    "ringreduce.csrc.kernels.cuda": ["reduce.cu"], "ringreduce.csrc.tf": ["async_call.cc"]})
