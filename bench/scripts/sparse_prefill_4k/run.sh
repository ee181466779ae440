#!/bin/bash
# One resumable piece of the 4k sparse-prefill re-measurement (issue 10 item 6), run inside a heavy.sh slot:
#   bench/heavy.sh bench/scripts/sparse_prefill_4k/run.sh TASK LIMIT LOGNAME
# Logs start/end time, `uptime` and the state of src/longlab/sparse, then runs longlab eval under timeout 700.
set -u
task=$1; limit=$2; log=bench/results/sparse_prefill_4k/logs/$3.log
# p2 was queued with limit 4 and raised to 8 while it waited (a long queue: fewer, larger pieces).
[ "$3" = p2_mk_l4 ] && limit=8
{
  echo "START $(date -u +%FT%TZ)  $(uptime)"
  echo "sparse diff: $(git diff --stat -- src/longlab/sparse | tail -1) md5=$(cat src/longlab/sparse/*.py | md5sum | cut -c1-12)"
  echo "eval: --tasks $task --limit $limit"
  t0=$(date +%s)
  timeout 700 .venv/bin/longlab eval --model smollm2-135m --recipes full,xattention,prism --tasks "$task" \
    --lengths 4096 --samples 8 --limit "$limit" --chunk-size 2048 --prefill-metrics --max-new-tokens 24 \
    --threads 1 --no-report --no-progress --out runs/sparse4k
  rc=$?
  echo "END $(date -u +%FT%TZ) rc=$rc wall=$(( $(date +%s) - t0 ))s  $(uptime)"
} >> "$log" 2>&1
