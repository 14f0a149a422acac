#!/usr/bin/env bash
# On a machine with a GPU: the GPU tests with 2 and 4 ranks sharing it and a
# mixed CPU/GPU ring, then the GPU allreduce benchmark (N=2, N=4, N=4 mixed).
# Tables go to stdout; record them in docs/performance.md.
#
#   bash benchmarks/gpu_check.sh            # with the python3 that has cupy
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Needs numpy, ml_dtypes, pytest, pytest-timeout and cupy in that Python (it
# installs cupy-cuda13x when a package index is reachable). Builds ringreduce
# in place, with the CUDA kernels as a fatbin when nvcc is on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import cupy" 2>/dev/null || $PY -m pip install -q cupy-cuda13x
if command -v nvcc >/dev/null; then export RINGREDUCE_CUDA=1 RINGREDUCE_CUDA_ARCHS=${RINGREDUCE_CUDA_ARCHS:-80,90}; fi
# The build's own status counts (pipefail); only its chatter is filtered.
$PY setup.py -q build_ext --inplace 2>&1 | { grep -v "^running\|^copying" || true; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "from ringreduce import cuda; why = cuda.available(); print('GPU:', why or 'ok'); assert why is None"
# cupy compiles its own elementwise kernels with NVRTC: check that works before the tests lean on it.
$PY -c "import cupy as cp; assert (cp.arange(3) * 2).tolist() == [0, 2, 4]; print('cupy', cp.__version__, 'NVRTC', cp.cuda.nvrtc.getVersion())"

echo "== GPU tests (kernels; collectives with 2 and 4 ranks on one GPU, GPU-only and mixed CPU/GPU rings)"
$PY -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda.py tests/test_gpu_collectives.py
echo "== staged ring on the emulated device and the host CUDA driver (no GPU needed)"
$PY -m pytest -q -p no:cacheprovider tests/test_device_ring.py

echo "== GPU allreduce benchmark"
$PY -m ringreduce.launch.ringrun -np 2 $PY benchmarks/gpu_allreduce_bench.py
$PY -m ringreduce.launch.ringrun -np 4 $PY benchmarks/gpu_allreduce_bench.py
$PY -m ringreduce.launch.ringrun -np 4 $PY benchmarks/gpu_allreduce_bench.py --mixed
