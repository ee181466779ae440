#!/bin/bash
# InftyThink (summarise=ask) vs one long context on lookup_chain(reason=True), Qwen2.5-Coder-0.5B-Instruct;
# resumable (rows already in the JSON are skipped): bench/heavy.sh bash bench/scripts/compression/run_inftythink_qwen.sh 560
set -u
SECS=${1:-560}
# lengths 96,128,192 in the first piece (03:59 UTC); 64,96,128 after it (the 192 cell cost ~4 min a sample)
uptime; date -u
timeout $((SECS + 120)) .venv/bin/python bench/compression_inftythink.py --model qwen2.5-0.5b --lengths ${LENGTHS:-64,96,128} \
  --samples 8 --seconds "$SECS" --probe \
  --recipes 'full;inftythink:summarise=ask,segment=48,iterations=10,summary_tokens=32' \
  --out bench/results/compression/inftythink_qwen.json
echo "rc=$?"
uptime; date -u
