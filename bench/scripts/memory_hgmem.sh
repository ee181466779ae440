#!/bin/bash
# HGMem vs its baselines on Qwen2.5-0.5B (issue #31), docs/results/memory-hgmem.md. Each part in its own slot:
#   PYTHONPATH=src bench/heavy.sh bash bench/scripts/memory_hgmem.sh hgmem       # HGMem on document 0
#   PYTHONPATH=src bench/heavy.sh bash bench/scripts/memory_hgmem.sh hgmem1      # HGMem on document 1
#   PYTHONPATH=src bench/heavy.sh bash bench/scripts/memory_hgmem.sh baselines   # the 5 baselines, both docs
# then: python -m longlab.cli memory page bench/results/memory-hgmem/* --out docs/results/memory-hgmem.md
set -euo pipefail
PART=${1:?hgmem, hgmem1 or baselines}
OUT=${MEMORY_OUT:-bench/results/memory-hgmem}/$PART
case $PART in
  hgmem) SYSTEMS="hgmem"; DOCS="--first-doc 0 --docs 1" ;;
  hgmem1) SYSTEMS="hgmem"; DOCS="--first-doc 1 --docs 1" ;;
  baselines) SYSTEMS="rag:k=4 context:full context:snapkv@0.5 context:kivi4 reuse"; DOCS="" ;;
  *) echo "part must be hgmem, hgmem1 or baselines" >&2; exit 2 ;;
esac
# 2 documents of 1024 tokens x 12 two-hop questions (n = 24); the same 16-token answer budget for every system.
# HGMem: 2 rounds (official default 4), 2 chunks a round, JSON calls capped at 128 generated tokens (CPU budget;
# a reply cut there keeps its complete items, memory.backend.repair_json).
exec ${PYTHON:-/work/main/.venv/bin/python} -m longlab.cli memory eval --model qwen2.5-0.5b --threads 1 \
  --task longdoc_multihop --length 1024 --samples 24 --questions-per-doc 12 --distractors 4 --seed 0 $DOCS \
  --systems $SYSTEMS --answer-tokens 16 --max-rounds 2 --top-chunks 2 --json-tokens 128 --retries 1 \
  --embedder minilm --out "$OUT"
