#!/bin/bash
# PersistBench companion (issue #31 item 4): memory_safety (200 items per kind) with and without memories, one
# model at a time through bench/heavy.sh (one thread). Usage: bench/scripts/memory_persist.sh OUTDIR [MODELS...]
set -e
OUT=${1:?OUTDIR}; shift
PY=${PY:-/work/main/.venv/bin/python}
for m in "${@:-smollm2-135m gemma3-270m qwen2.5-0.5b}"; do
  PYTHONPATH=src bench/heavy.sh $PY -m longlab.cli memory persist safety --model "$m" --out "$OUT" --n 200 --threads 1
done
