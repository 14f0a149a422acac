#!/usr/bin/env bash
# Everything the GPU rows of docs/performance.md need, in one call on a
# machine with a GPU, as markdown to paste there:
#   1. the GPU's name, the command, the commit
#   2. the build (the CUDA kernels as a fatbin for this GPU where nvcc is on PATH)
#   3. the physical limits (benchmarks/gpu_limits.py): pinned and pageable
#      D2H / H2D copy bandwidth at 256 MiB, device memory bandwidth
#   4. the GPU tests (tests/test_cuda.py, tests/test_gpu_collectives.py: 2 and
#      4 ranks on one GPU, GPU-only and mixed rings) with pytest's summary line
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
# call) and all of them within GPU_CHECK_SECONDS (default 420): a stage that
# would start with too little time left says "skipped". A stage that fails
# says so and the next one still runs; the exit status is the number of
# stages that failed or timed out. GPU_CHECK_LOGS: a folder for each stage's
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
failed=0

# stage NAME MAX_SECONDS [--tail K] CMD...: CMD under `timeout` (MAX_SECONDS, or
# what is left of the budget less 5 s), its output shown (the last K lines
# with --tail; all of it in $LOGS/NAME.log).
stage() {
    local name=$1 max=$2 tail=0
    shift 2
    if [ "$1" = "--tail" ]; then tail=$2; shift 2; fi
    local left=$((BUDGET - SECONDS - 5))
    local limit=$((max < left ? max : left))
    echo
    echo "## $name"
    echo
    if [ "$limit" -lt 10 ]; then
        echo "skipped: ${left}s left of GPU_CHECK_SECONDS=$BUDGET"
        failed=$((failed + 1))
        return 1
    fi
    echo "\$ $* (timeout ${limit}s)"
    echo
    local log=${LOGS:+$LOGS/$name.log}
    log=${log:-$(mktemp)}
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
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
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' + local changes'), $(hostname), $(nproc) cores"
if command -v nvidia-smi >/dev/null; then
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | head -4 | paste -sd ';')"
fi
$PY -c "import cupy as cp; p = cp.cuda.runtime.getDeviceProperties(0); n = p['name']; print('cupy', cp.__version__, 'sees', cp.cuda.runtime.getDeviceCount(), 'GPU(s):', n.decode() if isinstance(n, bytes) else n, ', CUDA runtime', cp.cuda.runtime.runtimeGetVersion())" 2>&1 | tail -1
$PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available(), 'gloo', torch.distributed.is_gloo_available())" 2>&1 | tail -1

if command -v nvcc >/dev/null; then
    # The fatbin for this GPU only (compute capability 9.0 -> 90): half the compile of 80,90.
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    export RINGREDUCE_CUDA=1 RINGREDUCE_CUDA_ARCHS=${RINGREDUCE_CUDA_ARCHS:-${arch:-80,90}}
fi
# scripts/build_inplace.sh builds with this Python's setuptools, however old
if ! stage build 180 --tail 15 bash scripts/build_inplace.sh $PY && [ -n "${RINGREDUCE_CUDA:-}" ]; then
    # the fatbin failed to build, say: without it cupy compiles the kernels with NVRTC at run time
    unset RINGREDUCE_CUDA
    stage build-without-fatbin 120 --tail 15 bash scripts/build_inplace.sh $PY
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
stage tests 150 --tail 30 $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_cuda.py tests/test_gpu_collectives.py
stage bench-N2 90 --tail 40 $PY -m ringreduce.launch.ringrun -np 2 $PY benchmarks/gpu_allreduce_bench.py --no-progress $DRY
stage bench-N4 120 --tail 40 $PY -m ringreduce.launch.ringrun -np 4 $PY benchmarks/gpu_allreduce_bench.py --no-progress $DRY
stage latency-N2 40 --tail 20 $PY -m ringreduce.launch.ringrun -np 2 $PY benchmarks/gpu_small_latency.py $DRY

echo
echo "# done in ${SECONDS}s; $failed stage(s) failed, timed out or skipped"
exit "$failed"
