#!/bin/bash
# HGMem vs its baselines on Qwen2.5-0.5B (issue #31), docs/results/memory-hgmem.md. Run each part in a slot:
#   PYTHONPATH=src bench/heavy.sh bash bench/scripts/memory_hgmem.sh hgmem      # HGMem (~50 min of one core)
#   PYTHONPATH=src bench/heavy.sh bash bench/scripts/memory_hgmem.sh baselines  # the 5 baselines (~20 min)
# then: python -m longlab.cli memory page bench/results/memory-hgmem/hgmem bench/results/memory-hgmem/baselines
#        --out docs/results/memory-hgmem.md
set -euo pipefail
PART=${1:?hgmem or baselines}
OUT=${MEMORY_OUT:-bench/results/memory-hgmem}/$PART
case $PART in
  hgmem) SYSTEMS="hgmem" ;;
  baselines) SYSTEMS="rag:k=4 context:full context:snapkv@0.5 context:kivi4 reuse" ;;
  *) echo "part must be hgmem or baselines" >&2; exit 2 ;;
esac
# 2 documents of 2048 tokens x 12 two-hop questions (n = 24); equal answer budget (16 tokens) for every system
exec ${PYTHON:-/work/main/.venv/bin/python} -m longlab.cli memory eval --model qwen2.5-0.5b --threads 1 \
  --task longdoc_multihop --length 2048 --samples 24 --questions-per-doc 12 --distractors 4 --seed 0 \
  --systems $SYSTEMS --answer-tokens 16 --max-rounds 2 --top-chunks 3 --retries 1 \
  --embedder minilm --out "$OUT"
