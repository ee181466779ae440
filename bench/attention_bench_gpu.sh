#!/usr/bin/env bash
# LongCA-bench, GPU variant: bf16 kernels x masks at 4k-32k on cuda:0, and context parallel over NCCL when the
# machine has >= 2 GPUs. PREPARED BUT NOT YET RUN ON A GPU (written on a CPU-only machine); expect to fix small
# things on first contact. Budget: a few minutes on one H100/H200-class GPU (the first flex call per shape
# compiles for ~30-60 s; FlashAttention / FlashInfer rows appear only when those packages are installed).
#
#   bash bench/attention_bench_gpu.sh            # writes bench/results/attention_bench_gpu*.json + PNGs
#   QUICK=1 bash bench/attention_bench_gpu.sh    # 4k and 8k only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LENGTHS=${LENGTHS:-4096,8192,16384,32768}
[ "${QUICK:-0}" = 1 ] && LENGTHS=4096,8192
nvidia-smi --query-gpu=name,memory.total --format=csv || true
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"
$PY -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('flash_attn', 'flashinfer', 'triton')})"

# 1. kernels x all 15 masks, GQA 9:3 and MHA 9:9 (SmolLM2 heads, D=64), bf16, forward and backward
timeout 900 $PY bench/attention_bench.py --part kernels --device cuda --dtype bfloat16 --shapes gqa,mha \
  --lengths "$LENGTHS" --repeats 5 --mem-cap-gb 40 --bwd-max 32768 \
  --kernels naive,sdpa-math,sdpa,flex,gather,executor-gather,executor-flex,flash-attn,flashinfer \
  --out bench/results/attention_bench_gpu.json

# 2. context parallel over NCCL (one rank per GPU; NCCL cannot put two ranks on one GPU)
if [ "$NGPU" -ge 2 ]; then
  WORLDS=1,2
  [ "$NGPU" -ge 4 ] && WORLDS=1,2,4
  timeout 600 $PY bench/attention_bench.py --part cp --cp-backend nccl --cp-dtype bfloat16 --cp-worlds "$WORLDS" \
    --cp-lengths 8192,16384 --cp-shapes gqa --cp-repeats 5 --cp-check-max 8192 \
    --out bench/results/attention_bench_gpu_cp.json
else
  echo "one GPU: skipping the NCCL context-parallel part (run the CPU gloo part: python bench/attention_bench.py --part cp)"
fi
