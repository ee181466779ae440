#!/bin/bash
# Runs the pieces one after another (never two at once), each through bench/heavy.sh, while the slot budget
# (35 min of heavy-job wall time) and the clock (no new piece after 04:55 UTC) allow.
# Usage: bench/scripts/sparse_prefill_4k/drive.sh "TASK:LIMIT:NAME ..."
cd /work/main
budget=2100
for p in $1; do
  IFS=: read -r task limit name <<< "$p"
  used=0; est=0
  for f in bench/results/sparse_prefill_4k/logs/*.log; do
    w=$(grep -o 'wall=[0-9]*' "$f" | tail -1 | cut -d= -f2); [ -n "$w" ] || continue
    used=$((used + w)); [ "$w" -gt "$est" ] && est=$w
  done
  now=$(date -u +%H%M)
  if [ $((used + est)) -gt $budget ] || [ "$now" -ge 0455 ]; then
    echo "$(date -u +%T) stop before $name: used ${used}s, next ~${est}s, clock $now"; break
  fi
  echo "$(date -u +%T) start $name (used ${used}s)"
  bench/heavy.sh bench/scripts/sparse_prefill_4k/run.sh "$task" "$limit" "$name"
  echo "$(date -u +%T) done $name rc=$?"
done
