#!/bin/bash
# bench/heavy.sh CMD ARGS... : run CMD in one of two CPU slots (one thread each), first come first served,
# so that several long measurements share a 2-core machine without oversubscribing it.
# Every real-model run, benchmark and training run of docs/results went through it.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
L=${LONGLAB_SLOTS:-${TMPDIR:-/tmp}/longlab-slots}; mkdir -p "$L"
W=$L/wait.$$
date +%s.%N > "$W"
trap 'rm -f "$W"' EXIT
mine=$(cat "$W")
while true; do
  older=0
  for f in "$L"/wait.*; do
    [ -e "$f" ] || continue
    pid=${f##*.}
    if ! kill -0 "$pid" 2>/dev/null; then rm -f "$f"; continue; fi
    [ "$pid" = "$$" ] && continue
    [[ "$(cat "$f" 2>/dev/null)" < "$mine" ]] && older=$((older+1))
  done
  if [ $older -eq 0 ]; then  # strict first come, first served: only the oldest waiter takes a free slot
    for s in 0 1; do
      flock -n -E 75 "$L/slot$s" bash -c 'rm -f "$0"; exec "$@"' "$W" "$@"
      rc=$?
      if [ $rc -ne 75 ]; then exit $rc; fi
    done
  fi
  sleep 3
done
