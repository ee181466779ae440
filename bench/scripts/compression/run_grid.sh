#!/bin/bash
# One resumable piece of a compression grid (issue #13), run through bench/heavy.sh:
#   bench/heavy.sh bash bench/scripts/compression/run_grid.sh TASK LENGTH SAMPLES LIMIT SECONDS OUTDIR RECIPES [EXTRA...]
# evaluates the first LIMIT of SAMPLES samples of TASK at LENGTH tokens (rows already in OUTDIR are
# skipped), stopping after SECONDS (the store is transactional; a killed piece resumes next time).
set -u
TASK=$1; LEN=$2; SAMPLES=$3; LIMIT=$4; SECS=$5; OUT=$6; R=$7; shift 7
uptime
timeout "$SECS" .venv/bin/longlab eval --model smollm2-135m --tasks "$TASK" --lengths "$LEN" --samples "$SAMPLES" \
  --limit "$LIMIT" --recipes "$R" --out "$OUT" --threads 1 --no-progress --max-new-tokens 12 --no-report "$@"
echo "rc=$?"
uptime
