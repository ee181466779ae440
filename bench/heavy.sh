#!/bin/bash
# bench/heavy.sh CMD ARGS... : run CMD in one of two CPU slots (one thread each), first come first served,
# so that several long measurements share a 2-core machine without oversubscribing it.
# Every real-model run, benchmark and training run of docs/results went through it.
# Waiting costs no forks (bash builtins only, one sleep per poll): twenty waiters polling with `cat` took
# a third of the two cores in system time (top: 33% sy; each running job ~40% of a core); 16k prefills
# were 364-412 s then and 310-325 s after the fix (prefill_s of the wave-8 rows, 2026-12-02).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
L=${LONGLAB_SLOTS:-${TMPDIR:-/tmp}/longlab-slots}; mkdir -p "$L"
W=$L/wait.$$
date +%s.%N > "$W"
trap 'rm -f "$W"' EXIT
read -r mine < "$W"
while true; do
  older=0
  for f in "$L"/wait.*; do
    [ -e "$f" ] || continue
    pid=${f##*.}
    [ "$pid" = "$$" ] && continue
    if ! kill -0 "$pid" 2>/dev/null; then rm -f "$f"; continue; fi
    stamp=; read -r stamp < "$f" 2>/dev/null || true
    [[ -n "$stamp" && "$stamp" < "$mine" ]] && older=$((older+1))
  done
  if [ $older -eq 0 ]; then  # strict first come, first served: only the oldest waiter takes a free slot
    for s in 0 1; do
      flock -n -E 75 "$L/slot$s" bash -c 'rm -f "$0"; exec "$@"' "$W" "$@"
      rc=$?
      if [ $rc -ne 75 ]; then exit $rc; fi
    done
  fi
  sleep 5
done
