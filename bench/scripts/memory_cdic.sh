#!/bin/bash
# C-DIC (issue #31 item 3): per seed, train C-DIC (ra-TBPTT) and the token LM in the layers lab, then evaluate all
# five systems on the same dialogue_threads probes into one results store. One core per job via bench/heavy.sh.
# Usage: bench/scripts/memory_cdic.sh OUTDIR [SEEDS...]   (the store: OUTDIR/store/results.sqlite)
set -e
OUT=${1:?OUTDIR}; shift
PY=${PY:-/work/main/.venv/bin/python}
for s in "${@:-0 1 2}"; do
  PYTHONPATH=src bench/heavy.sh bash -c "$PY -m longlab.cli memory cdic train --system cdic --out $OUT/cdic-s$s --minutes 6 --seed $s && \
    $PY -m longlab.cli memory cdic train --system tokens --out $OUT/tokens-s$s --minutes 3 --seed $s && \
    $PY -m longlab.cli memory cdic eval --cdic $OUT/cdic-s$s --tokens $OUT/tokens-s$s --out $OUT/store --per-cell 12" &
  sleep 1
done
wait
