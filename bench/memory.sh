#!/bin/bash
# Memory systems (issue #31), one part per call; every model run goes through bench/heavy.sh (one thread a slot).
#   bench/memory.sh hgmem|hgmem1|baselines      HGMem on document 0 / 1, or its 5 baselines, on Qwen2.5-0.5B
#                                               (docs/results/memory-hgmem.md; store under $MEMORY_OUT)
#   bench/memory.sh cdic OUTDIR [SEEDS...]      C-DIC and the token LM trained per seed (CDIC_MINUTES, default 6;
#                                               CDIC_TOKEN_MINUTES, default 3), then all five systems evaluated
#                                               on the same dialogue_threads probes (OUTDIR/store)
#   bench/memory.sh persist OUTDIR [MODELS...]  memory_safety, 200 items per kind (MEMORY_PERSIST_N), with and without memories
# Pages: PYTHONPATH=src python bench/memory_docs.py --cdic DIR --persist DIR
set -euo pipefail
PY=${PY:-${PYTHON:-.venv/bin/python}}
PART=${1:?part: hgmem, hgmem1, baselines, cdic or persist}; shift
case $PART in
  hgmem|hgmem1|baselines)
    OUT=${MEMORY_OUT:-bench/results/memory-hgmem}/$PART
    case $PART in
      hgmem) SYSTEMS="hgmem"; DOCS="--first-doc 0 --docs 1" ;;
      hgmem1) SYSTEMS="hgmem"; DOCS="--first-doc 1 --docs 1" ;;
      *) SYSTEMS="rag:k=4 context:full context:snapkv@0.5 context:kivi4 reuse"; DOCS=${MEMORY_BASELINE_DOCS:-} ;;
    esac
    # 2 documents of 1024 tokens x 12 two-hop questions (n = 24); a 16-token answer budget for every system.
    # HGMem: 2 rounds (official default 4), 2 chunks a round, JSON calls capped at 128 tokens (CPU budget;
    # a reply cut there keeps its complete items, memory.backend.repair_json).
    # MEMORY_BASELINE_DOCS="--first-doc 0 --docs 1" restricts the baselines to the questions HGMem answered.
    # shellcheck disable=SC2086
    exec bench/heavy.sh "$PY" -m longlab.cli memory eval --model qwen2.5-0.5b --threads 1 \
      --task longdoc_multihop --length 1024 --samples 24 --questions-per-doc 12 --distractors 4 --seed 0 $DOCS \
      --systems $SYSTEMS --answer-tokens 16 --max-rounds 2 --top-chunks 2 --json-tokens 128 --retries 1 \
      --embedder minilm --out "$OUT" ;;
  cdic)
    OUT=${1:?OUTDIR}; shift
    for s in ${@:-0 1 2}; do
      bench/heavy.sh bash -c "$PY -m longlab.cli memory cdic train --system cdic --out $OUT/cdic-s$s --minutes ${CDIC_MINUTES:-6} --seed $s && \
        $PY -m longlab.cli memory cdic train --system tokens --out $OUT/tokens-s$s --minutes ${CDIC_TOKEN_MINUTES:-3} --seed $s && \
        $PY -m longlab.cli memory cdic eval --cdic $OUT/cdic-s$s --tokens $OUT/tokens-s$s --out $OUT/store --per-cell 12" &
      sleep 1
    done
    wait ;;
  persist)
    OUT=${1:?OUTDIR}; shift
    for m in ${@:-smollm2-135m gemma3-270m qwen2.5-0.5b}; do
      bench/heavy.sh "$PY" -m longlab.cli memory persist safety --model "$m" --out "$OUT" --n "${MEMORY_PERSIST_N:-200}" --threads 1
    done ;;
  *) echo "part must be hgmem, hgmem1, baselines, cdic or persist" >&2; exit 2 ;;
esac
