#!/bin/bash
# The KV baselines query-aware (they see the question while compressing, as LongLLMLingua and COMI do):
#   bench/heavy.sh bash bench/scripts/compression/run_qa.sh redundant_niah 16 16 600
set -u
TASK=$1; SAMPLES=$2; LIMIT=$3; SECS=${4:-600}
R="full"
for r in 0.5 0.75 0.875; do R="$R,snapkv@$r,tova@$r,hico-drop@$r"; done
uptime
timeout "$SECS" .venv/bin/longlab eval --model smollm2-135m --tasks "$TASK" --lengths 1024 --samples "$SAMPLES" \
  --limit "$LIMIT" --recipes "$R" --out "bench/results/compression/$TASK-qa" --threads 1 --no-progress \
  --max-new-tokens 12 --no-report --query-aware
echo "rc=$?"
uptime
