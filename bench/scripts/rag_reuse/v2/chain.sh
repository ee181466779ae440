#!/bin/bash
# sequential heavy pieces for issue 11 (one at a time through the slot runner)
cd /work/main
V2=bench/results/rag_reuse/v2
while pgrep -f "bench/rag_reuse.py accuracy" > /dev/null; do sleep 5; done
i=3
while [ "$(date -u +%H%M)" -lt "1940" ]; do
  RAG_REUSE_OUT=$V2 bench/heavy.sh .venv/bin/python bench/rag_reuse.py accuracy --task multidoc_qa_1 \
     --samples 200 --max-minutes 10.5 > $V2/acc_qa1_p$i.log 2>&1
  i=$((i+1))
done
bench/heavy.sh .venv/bin/python -m pytest -q -p no:cacheprovider -m slow tests/test_reuse_compose.py \
   tests/test_reuse.py -k "real_model" > $V2/slow_tests.log 2>&1
(uptime; time bench/heavy.sh .venv/bin/python -m pytest -q -p no:cacheprovider) > $V2/full_suite.log 2>&1
RAG_REUSE_OUT=$V2 bench/heavy.sh .venv/bin/python bench/rag_reuse.py ttft --num-docs 4,8 --doc-tokens 400 \
   --rounds 3 > $V2/ttft.log 2>&1
j=1
while [ "$(date -u +%H%M)" -lt "2024" ]; do
  RAG_REUSE_OUT=$V2/qwen bench/heavy.sh .venv/bin/python bench/rag_reuse.py accuracy --model qwen2.5-0.5b \
     --task multidoc_qa_1 --samples 100 --ratios 0.1,0.2 --extra "" --max-minutes 10.5 > $V2/qwen_qa1_p$j.log 2>&1
  j=$((j+1))
done
echo chain done $(date -u) > $V2/chain.done
