#!/usr/bin/env bash
# One command on a fresh GPU box (< 8 min): build the CUDA extension, run the GPU tests, print
# GEMV/GEMM throughput of the exl kernels as a fraction of the GPU's memory bandwidth.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
echo "== compile check (nvcc, all archs)"
$PY -m cuda_ext.compile_check
echo "== building the CUDA extension (JIT, cached)"
$PY -c "from cuda_ext import build; build.load_cuda(); print('ok')"
echo "== GPU tests"
$PY -m pytest -m gpu tests/gpu -q -p no:cacheprovider
echo "== throughput"
$PY bench/kernels.py --cuda
