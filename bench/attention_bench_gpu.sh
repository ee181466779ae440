#!/usr/bin/env bash
# LongCA-bench, GPU variant: bf16 kernels x masks at 8k and 32k on cuda:0, and context parallel over NCCL when the
# machine has >= 2 GPUs. PREPARED BUT NOT YET RUN ON A GPU (written on a CPU-only machine; its flow, flags
# and CPU-side parts were dry-run on CPU with DRY_RUN=1). Budget: at most 8.5 minutes on one H100/H200-class GPU,
# every piece under its own `timeout` and writing its own JSON, so a piece that runs long loses only itself
# (the first flex call per shape and mask compiles, ~10-30 s; FlashAttention / FlashInfer rows appear only
# when those packages are installed, else the JSON says why they were skipped).
#
#   bash bench/attention_bench_gpu.sh            # writes bench/results/attention_bench_gpu_*.json + PNGs
#   QUICK=1 bash bench/attention_bench_gpu.sh    # 8k only
#   DRY_RUN=1 bash bench/attention_bench_gpu.sh  # the same commands on CPU, fp32, T=256, gloo: checks flow
set -euo pipefail
cd "$(dirname "$0")/.."
# the device machine has no .venv (its python3 holds CUDA torch) and longlab is not installed there
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
LENGTHS=${LENGTHS:-8192,32768}
[ "${QUICK:-0}" = 1 ] && LENGTHS=8192
DEV=(--device cuda --dtype bfloat16)
CPB=nccl
CPDT=bfloat16
PREFIX=bench/results/attention_bench_gpu
T_KERN=${T_KERN:-90}  # seconds per piece (caps: 2 x (90 + 120) + 90 s = 8.5 min on one GPU)
T_FLEX=${T_FLEX:-120}
REP=5
if [ "${DRY_RUN:-0}" = 1 ]; then
  LENGTHS=256; DEV=(--device cpu --dtype float32); CPB=gloo; CPDT=float32; PREFIX=${TMPDIR:-/tmp}/attention_bench_gpu_dry
  T_KERN=300; T_FLEX=300; REP=1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv || echo "no nvidia-smi"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"
$PY -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('flash_attn', 'flashinfer', 'triton')})"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# 1. kernels x all 15 masks, GQA 9:3 and MHA 9:9 (SmolLM2 heads, D=64), forward and backward, per length:
#    (a) the kernels that need no compile, every mask, both shapes (naive / sdpa-math skip themselves above
#    --mem-cap-gb); (b) compiled flex (backward timed on CUDA) on five representative masks, GQA only:
#    every new mask_mod and shape compiles a Triton kernel (~5-20 s each), so all 15 x 2 would not fit.
FLEX_MASKS=CAUSAL,CAUSAL_DOCUMENT,SLIDING_WINDOW_CAUSAL,SHARE_QUESTION,RANDOM_BLOCK_0.5
for T in ${LENGTHS//,/ }; do
  timeout "$T_KERN" $PY bench/attention.py bench --part kernels "${DEV[@]}" --shapes gqa,mha \
    --lengths "$T" --repeats "$REP" --mem-cap-gb 40 --bwd-max 32768 \
    --kernels naive,sdpa-math,sdpa,gather,flash-attn,flashinfer \
    --out "${PREFIX}_${T}.json" > "${PREFIX}_${T}.md" || echo "kernels T=$T: exit $? (timeout or error; see ${PREFIX}_${T}.md)"
  timeout "$T_FLEX" $PY bench/attention.py bench --part kernels "${DEV[@]}" --shapes gqa --masks "$FLEX_MASKS" \
    --lengths "$T" --repeats "$REP" --mem-cap-gb 40 --bwd-max 32768 --kernels flex,executor-flex \
    --out "${PREFIX}_${T}_flex.json" > "${PREFIX}_${T}_flex.md" || echo "flex T=$T: exit $?"
done

# 2. the sparse-prefill executor (per-head block masks, chunked prefill) against density x dense
timeout 90 $PY bench/attention.py bench --part executor "${DEV[@]}" --exec-lengths "${LENGTHS##*,}" \
  --exec-chunk 2048 --exec-backends flex,flex-prebuilt,gather --repeats "$REP" \
  --out "${PREFIX}_executor.json" > "${PREFIX}_executor.md" || echo "executor: exit $?"

# 3. context parallel over NCCL (one rank per GPU; NCCL cannot put two ranks on one GPU)
if [ "$NGPU" -ge 2 ] || [ "${DRY_RUN:-0}" = 1 ]; then
  WORLDS=1,2
  [ "$NGPU" -ge 4 ] && WORLDS=1,2,4
  CPL=8192,16384; CHK=8192
  [ "${DRY_RUN:-0}" = 1 ] && CPL=512 && CHK=512
  timeout 150 $PY bench/attention.py bench --part cp --cp-backend "$CPB" --cp-dtype "$CPDT" --cp-worlds "$WORLDS" \
    --cp-lengths "$CPL" --cp-shapes gqa --cp-repeats "$REP" --cp-check-max "$CHK" \
    --out "${PREFIX}_cp.json" > "${PREFIX}_cp.md" || echo "cp: exit $?"
else
  echo "one GPU: skipping the NCCL context-parallel part (run the CPU gloo part: python bench/attention.py bench --part cp)"
fi
ls -la "${PREFIX}"_* || true
# on the device machine ($OUT comes back, at most 8 files): everything in one archive
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then tar czf "$OUT/attention_bench_gpu.tgz" "${PREFIX}"_*; fi
