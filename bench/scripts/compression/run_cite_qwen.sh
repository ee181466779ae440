#!/bin/bash
# Guidance on cite_qa with Qwen2.5-Coder-0.5B-Instruct (citation P/R/F1 with and without guidance);
# resumable (same --out): bench/heavy.sh bash bench/scripts/compression/run_cite_qwen.sh 12 660
set -u
N=$1; SECS=${2:-660}
uptime; date -u
# (first slot only, 03:26 UTC: a short InftyThink prompt-format probe on Qwen, 1-2 samples, before the cite run)
timeout 300 .venv/bin/python bench/compression_inftythink.py --lengths 160 --samples 2 --seconds 230 --probe \
  --recipes 'full;inftythink:summarise=ask,segment=64,iterations=12;inftythink:summarise=ask,segment=64,iterations=12|Progress so far: {summary}\nContinuing from there:\n' \
  --out /tmp/compression_probe/inftythink_probe.json
uptime; date -u
timeout $((SECS - 260)) .venv/bin/longlab eval --model qwen2.5-0.5b --tasks cite_qa --lengths 1024 --samples "$N" \
  --recipes full,guidance --out bench/results/compression/cite_qa_qwen --threads 1 --no-progress \
  --max-new-tokens 48 --no-report
echo "rc=$?"
uptime; date -u
