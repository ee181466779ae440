#!/bin/bash
# GPU-machine check for the fused decode kernels (issue 32), for a lent GPU machine:
#   bash bench/decode_speed_gpu.sh [OUT_DIR]        (about 5 minutes; OUT_DIR default bench/results/gpu)
# longlab's fused decode kernels (longlab.ops.qdecode) are C++ for the CPU; there is no Triton/CUDA path yet,
# so on a CUDA device the quant recipes take the PyTorch chunked path and Quest the PyTorch gather. This
# script checks, on that machine: (1) the C++ kernels build there and pass their tests, including the CUDA
# test that is skipped elsewhere (a CUDA layer falls back and agrees with the CPU kernel); (2) the kernel
# micro-benchmark on its CPU with one thread and with every core (a server's memory channels); (3) the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${1:-bench/results/gpu}
mkdir -p "$OUT"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) | tee "$OUT/gpu.txt"
export PYTHONPATH=src HF_HUB_OFFLINE=1
$PY -m pytest -q -p no:warnings tests/test_qdecode.py tests/test_ops_build.py 2>&1 | tee "$OUT/tests.txt"
$PY bench/decode_speed.py speed --micro --lengths 8192,32768 --rounds 5 --threads 1 --out "$OUT/micro_1thread.json"
$PY bench/decode_speed.py speed --micro --lengths 8192,32768 --rounds 5 --threads "$(nproc)" \
    --out "$OUT/micro_allthreads.json"
