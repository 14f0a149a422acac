#!/usr/bin/env bash
# Everything the GPU rows of docs/performance.md need, in one call on a
# machine with a GPU, as markdown to paste there:
#   1. the command, the commit, and the machine: the GPU (name, memory,
#      driver version, the CUDA version the driver supports, compute
#      capability, compute mode, MIG mode), the versions of python, numpy,
#      ml_dtypes, cupy (with the CUDA runtime, driver and NVRTC it sees),
#      torch, pytest and setuptools
#   2. the build (the CUDA kernels as a fatbin for this GPU where nvcc is on
#      PATH; without the fatbin where that fails; the core alone where the
#      setuptools build fails), then a sanity check of cupy and of where the
#      kernels came from (cuda.kernel_origin(): the fatbin, or NVRTC and why)
#   3. the physical limits (benchmarks/gpu_limits.py): pinned and pageable
#      D2H / H2D copy bandwidth at 256 MiB, device memory bandwidth
#   4. the GPU tests with pytest's summary line: the kernels
#      (tests/test_cuda.py), then the collectives (tests/test_gpu_collectives.py:
#      2 and 4 ranks on one GPU, GPU-only and mixed rings), each test under
#      its own pytest timeout
#   5. the allreduce benchmark (benchmarks/gpu_allreduce_bench.py) at N = 2
#      and N = 4 ranks sharing the GPU: rr on cupy (staged, RINGREDUCE_CUDA_IPC=0,
#      and IPC, =1), torch's gloo on CUDA tensors in the same run, rr on numpy,
#      the mixed CPU/GPU ring; ratios, 64 KiB latency, #wrong
#   6. where a 64 KiB GPU allreduce's time goes (benchmarks/gpu_small_latency.py,
#      N = 2): the public call, the IPC pass alone, the bounce path, and the
#      cupy calls around them
#
#   bash benchmarks/gpu_check.sh                        # with the python3 that has cupy
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   GPU_CHECK_SECONDS=420 GPU_CHECK_LOGS=$OUT bash benchmarks/gpu_check.sh
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh        # no GPU: the script itself, numpy standing in for cupy
#
# Every stage runs under its own `timeout` (a hang costs that stage, not the
# call) and all of them within GPU_CHECK_SECONDS (default 420, the header
# included): a stage's limit is its own maximum or what is left less what
# the stages after it need at least (NEED), so a slow stage never starves
# the later ones of their tables; a stage that would start with too little
# time left says "skipped". The benchmarks read their stage's limit
# (GPU_CHECK_STAGE_SECONDS) and leave out the sizes that would not fit. A
# stage that fails says so and the next one still runs; the exit status is
# the number of stages that failed, timed out or were skipped. GPU_CHECK_LOGS: a folder for each stage's
# full output (the tests' failures in full). Needs numpy, ml_dtypes, pytest,
# pytest-timeout and cupy in that Python; torch (with gloo) for the gloo
# columns, which otherwise say n/a. The staged ring's tests on the emulated
# device and the host CUDA driver (tests/test_device_ring.py) need no GPU:
# they run in CI, not here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_SECONDS:-420}
LOGS=${GPU_CHECK_LOGS:-}
DRY=${GPU_CHECK_DRY:+--dry}
[ -n "$LOGS" ] && mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# cupy's compiled kernels (its own and NVRTC's reduce.cu) in a folder of this
# run, shared by its stages: writable whatever HOME is, and no stale cache
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_cupy.XXXXXX")}
failed=0

# The stages in running order, and the seconds each needs at least to print
# something useful: a stage leaves the sum of its successors' to them.
ORDER="build build-without-fatbin build-core-only sanity limits tests tests-collectives bench-N2 bench-N4 latency-N2"
declare -A NEED=([build]=30 [build-without-fatbin]=0 [build-core-only]=0 [sanity]=10 [limits]=10 [tests]=20
                 [tests-collectives]=40 [bench-N2]=40 [bench-N4]=45 [latency-N2]=15)

# The seconds the stages after $1 need at least.
reserve() {
    local after=0 sum=0 s
    for s in $ORDER; do
        if [ "$after" -eq 1 ]; then sum=$((sum + NEED[$s])); fi
        if [ "$s" = "$1" ]; then after=1; fi
    done
    echo "$sum"
}

# Runs a header command under a timeout, its stderr with its stdout, a line
# saying so if it timed out.
probe() {
    timeout -k 5 60 "$@" 2>&1
    local rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "(timed out after 60s: $*)"; fi
    return 0
}

# stage NAME MAX_SECONDS [--tail K] CMD...: CMD under `timeout` (MAX_SECONDS, or
# what is left of the budget less 5 s and less what the later stages need),
# GPU_CHECK_STAGE_SECONDS set to that limit in its environment, its output
# shown (the last K lines with --tail; all of it in $LOGS/NAME.log).
stage() {
    local name=$1 max=$2 tail=0
    shift 2
    if [ "$1" = "--tail" ]; then tail=$2; shift 2; fi
    local left=$((BUDGET - SECONDS - 5))
    local room=$((left - $(reserve "$name")))
    local limit=$((max < room ? max : room))
    echo
    echo "## $name"
    echo
    if [ "$limit" -lt 10 ]; then
        echo "skipped: ${left}s left of GPU_CHECK_SECONDS=$BUDGET, $(reserve "$name")s of them for the later stages"
        failed=$((failed + 1))
        return 1
    fi
    echo "\$ $* (timeout ${limit}s)"
    echo
    local log=${LOGS:+$LOGS/$name.log}
    log=${log:-$(mktemp)}
    local start=$SECONDS
    GPU_CHECK_STAGE_SECONDS=$limit timeout -k 10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    # ringrun's "[0] " before rank 0's lines would break the markdown
    if [ "$tail" -gt 0 ]; then tail -n "$tail" "$log"; else cat "$log"; fi | sed 's/^\[0\] //'
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "TIMED OUT after ${limit}s: $name"
    elif [ "$rc" -ne 0 ]; then
        echo "FAILED (exit $rc): $name"
    fi
    echo "($name: $((SECONDS - start))s)"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    [ -n "$LOGS" ] || rm -f "$log"
    return "$rc"
}

echo "# ringreduce GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "\$ ${PYTHON:+PYTHON=$PYTHON }bash benchmarks/gpu_check.sh   (GPU_CHECK_SECONDS=$BUDGET)"
if git rev-parse --git-dir >/dev/null 2>&1; then
    echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo ' + local changes'), $(uname -n), $(nproc) cores"
else
    echo "commit unknown (no git checkout here), $(uname -n), $(nproc) cores"
fi
echo
if command -v nvidia-smi >/dev/null; then
    # name, memory, driver version, compute capability, compute mode, MIG mode
    probe nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap,compute_mode,mig.mode.current \
        --format=csv,noheader | head -8 | sed 's/^/GPU /'
    echo "CUDA version the driver supports: $(probe nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)"
    if probe nvidia-smi --query-gpu=compute_mode --format=csv,noheader | grep -qi exclusive; then
        echo "WARNING: compute mode is exclusive: ranks sharing a GPU (the tests, the N=2 and N=4 stages) cannot all open it"
    fi
else
    echo "GPU: no nvidia-smi on PATH"
fi
command -v nvcc >/dev/null && echo "nvcc: $(probe nvcc --version | tail -2 | paste -sd ' ')"
# Each import on its own: a broken one says why and the rest still print.
probe $PY - <<'VERSIONS'
import importlib, importlib.metadata, platform, sys
def version(name):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {str(exc)[:100]})"
    try:
        return getattr(module, "__version__", None) or importlib.metadata.version(name.replace("_", "-"))
    except Exception:
        return "(version unknown)"
print(f"python {platform.python_version()} ({sys.executable})")
print("; ".join(f"{name} {version(name)}" for name in ("numpy", "ml_dtypes", "cupy", "torch", "pytest",
                                                      "pytest_timeout", "setuptools")))
try:
    import cupy as cp
    rt = cp.cuda.runtime
    p = rt.getDeviceProperties(0)
    name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    print(f"cupy sees {rt.getDeviceCount()} GPU(s): {name}, compute capability {p['major']}.{p['minor']}; "
          f"CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
    print(f"NVRTC {cp.cuda.nvrtc.getVersion()}")
except Exception as exc:
    print(f"cupy: no GPU ({type(exc).__name__}: {str(exc)[:200]})")
try:
    import torch
    print(f"torch: CUDA {torch.version.cuda}, available {torch.cuda.is_available()}, "
          f"gloo {torch.distributed.is_gloo_available()}")
except Exception as exc:
    print(f"torch: {type(exc).__name__}: {str(exc)[:200]}")
VERSIONS

if command -v nvcc >/dev/null; then
    # The fatbin for this GPU only (compute capability 9.0 -> 90): half the compile of 80,90.
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    export RINGREDUCE_CUDA=1 RINGREDUCE_CUDA_ARCHS=${RINGREDUCE_CUDA_ARCHS:-${arch:-80,90}}
fi
# scripts/build_inplace.sh builds with this Python's setuptools, however old
built=0
stage build 150 --tail 15 bash scripts/build_inplace.sh $PY && built=1
if [ "$built" -eq 0 ] && [ -n "${RINGREDUCE_CUDA:-}" ]; then
    # the fatbin failed to build, say: without it cupy compiles the kernels with NVRTC at run time
    unset RINGREDUCE_CUDA
    stage build-without-fatbin 120 --tail 15 bash scripts/build_inplace.sh $PY && built=1
fi
if [ "$built" -eq 0 ]; then
    # setuptools failed: the core alone, with the C compiler (no MPI transport, no fatbin)
    stage build-core-only 60 --tail 15 env RINGREDUCE_BUILD_CORE_ONLY=1 bash scripts/build_inplace.sh $PY
fi
# cupy compiles its own elementwise kernels with NVRTC: check that works before the rest leans on it.
[ -n "$DRY" ] || stage sanity 60 $PY -c "
import cupy as cp
from ringreduce import cuda
why = cuda.available()
assert why is None, why
assert (cp.arange(3) * 2).tolist() == [0, 2, 4]
cuda.kernels()
print('ringreduce GPU kernels:', cuda.kernel_origin(), '; NVRTC', cp.cuda.nvrtc.getVersion())"
stage limits 45 $PY benchmarks/gpu_limits.py --bytes 256M --seconds 0.5 $DRY
# -rfEs: every failure, error and skip named on one line each, whatever the tail shows
stage tests 90 --tail 30 $PY -m pytest -q -rfEs -m gpu -p no:cacheprovider --timeout 45 tests/test_cuda.py
stage tests-collectives 150 --tail 30 $PY -m pytest -q -rfEs -m gpu -p no:cacheprovider --timeout 100 \
    tests/test_gpu_collectives.py
stage bench-N2 90 --tail 40 $PY -m ringreduce.launch.ringrun -np 2 $PY benchmarks/gpu_allreduce_bench.py --no-progress $DRY
stage bench-N4 120 --tail 40 $PY -m ringreduce.launch.ringrun -np 4 $PY benchmarks/gpu_allreduce_bench.py --no-progress $DRY
stage latency-N2 40 --tail 20 $PY -m ringreduce.launch.ringrun -np 2 $PY benchmarks/gpu_small_latency.py $DRY

echo
echo "# done in ${SECONDS}s; $failed stage(s) failed, timed out or skipped"
exit "$failed"
