#!/bin/bash
# Guidance on cite_qa (citation F1 with and without guidance) and the LLMLingua family on multidoc_qa_1:
#   bench/heavy.sh bash bench/scripts/compression/run_extra.sh cite 8 600
#   bench/heavy.sh bash bench/scripts/compression/run_extra.sh multidoc 6 600
set -u
WHAT=$1; N=$2; SECS=${3:-600}
uptime
if [ "$WHAT" = cite ]; then
  timeout "$SECS" .venv/bin/longlab eval --model smollm2-135m --tasks cite_qa --lengths 1024 --samples "$N" \
    --recipes full,guidance,guidance:threshold=0.5,guidance+snapkv@0.5,snapkv@0.5 \
    --out bench/results/compression/cite_qa --threads 1 --no-progress --max-new-tokens 48 --no-report
else
  timeout "$SECS" .venv/bin/longlab eval --model smollm2-135m --tasks multidoc_qa_1 --lengths 1024 --samples "$N" \
    --recipes full,llmlingua@0.5,longllmlingua@0.5,tpp@0.5,snapkv@0.5,tova@0.5,hico-drop@0.5,llmlingua@0.75,longllmlingua@0.75,snapkv@0.75,tova@0.75 \
    --out bench/results/compression/multidoc_qa_1 --threads 1 --no-progress --max-new-tokens 12 --no-report
fi
echo "rc=$?"
uptime
