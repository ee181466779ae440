#!/bin/bash
# One resumable piece of the spec-decode eval grid (docs/results/spec-decode.md), run through the slot
# runner:  bench/heavy.sh bench/scripts/spec_eval/piece.sh LENGTH SAMPLES TASKS [SECONDS]
# Stored rows are skipped, so re-running a piece that hit its time limit continues where it stopped.
set -u
cd "$(dirname "$0")/../../.."
L=${1:?length}; N=${2:?samples}; TASKS=${3:-passkey,vt,summ_events}; T=${4:-690}
echo "start $(date -u +%T) $(uptime)"
timeout "$T" .venv/bin/longlab eval --model smollm2-135m --tasks "$TASKS" --lengths "$L" \
  --samples "$N" --threads 1 --speculative lookup self:streaming:budget=256 --verify full dustin:budget=1024 \
  --out bench/results/spec_eval
rc=$?
echo "end $(date -u +%T) $(uptime) rc=$rc"
exit $rc
