#!/bin/bash
# Several grid pieces in one slot-runner turn, within one time limit (seconds, first argument):
#   bench/heavy.sh bench/scripts/spec_eval/pieces.sh 690 4096:4:summ_events 8192:3:passkey
# Each LENGTH:SAMPLES:TASKS runs piece.sh with the time left; stored rows are skipped on re-runs.
set -u
cd "$(dirname "$0")"
end=$(( $(date +%s) + ${1:?seconds} )); shift
for p in "$@"; do
  left=$(( end - $(date +%s) ))
  [ "$left" -lt 30 ] && { echo "skip $p (time)"; continue; }
  IFS=: read -r L N T <<< "$p"
  ./piece.sh "$L" "$N" "$T" "$left"
done
