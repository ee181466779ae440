#!/bin/bash
# One resumable piece of the compression sweep (issue #13): run through bench/heavy.sh, e.g.
#   bench/heavy.sh bash bench/scripts/compression/run.sh redundant_niah 12 5 680
# TASK SAMPLES LIMIT SECONDS: evaluate the first LIMIT of SAMPLES samples (rows already stored are
# skipped), stopping after SECONDS (the store is transactional; a killed piece resumes next time).
set -u
TASK=$1; SAMPLES=$2; LIMIT=$3; SECS=${4:-680}
R="full"
for r in 0.5 0.75 0.875; do R="$R,llmlingua@$r,longllmlingua@$r,hico@$r,tpp@$r,comi@$r,snapkv@$r,tova@$r"; done
R="$R,llmlingua@0.5+snapkv@0.5"
uptime
timeout "$SECS" .venv/bin/longlab eval --model smollm2-135m --tasks "$TASK" --lengths 1024 --samples "$SAMPLES" \
  --limit "$LIMIT" --recipes "$R" --out "bench/results/compression/$TASK" --threads 1 --no-progress \
  --max-new-tokens 12 --no-report
echo "rc=$?"
uptime
