#!/bin/bash
# The position sweep on SmolLM2-135M in pieces of <= ~12 minutes at one thread, each resumable (rows or
# methods already stored are skipped). Run each piece through the slot runner:
#   bench/heavy.sh bench/position_sweep.sh ppl-a
# Variants come from `longlab train` (see docs/results/position.md).
{  # parsed whole before it runs: editing this file while a piece runs cannot break that piece
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DB=runs/position/eval
PPL=bench/results/position/ppl.json
DROPE=drope:weights=runs/position/drope-smollm2
ROPEID=ropeid:train_len=512,weights=runs/position/ropeid-smollm2
DROPEQK=drope:qk_norm=true,weights=runs/position/drope-qk-smollm2
REPO=repo:weights=runs/position/repo-smollm2
REPO80=repo:weights=runs/position/repo-smollm2-s80       # issue 28: retrained, see W-repo
DROPE150=drope:weights=runs/position/drope-smollm2-s150  # issue 28: 2.5x the budget, see W-drope
# every method at 32k (scaled methods at s = L/8k = 4): the one-method pieces N32-M, P32-M, V32-M
declare -A AT32=([none]=none [pi]=pi:factor=4 [ntk]=ntk:factor=4 [dyn]=dynamic-ntk:factor=4 [yarn]=yarn:factor=4
                 [lr]=longrope:factor=4 [drope]=$DROPE [dropeqk]=$DROPEQK [ropeid]=$ROPEID [repo]=$REPO)
T="$PY bench/position.py tasks"
GM="$T --model gemma3-270m --out runs/position/gemma --committed bench/results/position/gemma_rows.json"
BUDGET="--recipe snapkv:budget=4096 --compress chunk"
SCALED="pi:factor=2,ntk:factor=2,dynamic-ntk:factor=2,yarn:factor=2,longrope:factor=2"
EVAL=(-m longlab.cli eval --model smollm2-135m --recipes full --chunk-size 1024 --threads 1 --no-report
      --no-progress --out "$DB")
uptime
KEY="yarn:factor=2,$DROPE,$ROPEID"  # --positions always adds the model's own RoPE (none), last
case "$1" in
  A) $PY bench/position.py ppl --methods "none,$KEY" --length 16384 --out "$PPL"
     $PY "${EVAL[@]}" --tasks passkey --lengths 4096 --samples 2 --positions "$KEY" ;;
  B) $PY "${EVAL[@]}" --tasks passkey --lengths 8192 --samples 2 --positions "$KEY"
     $PY "${EVAL[@]}" --tasks passkey --lengths 16384 --samples 1 --positions "$KEY" ;;
  C) $PY bench/position.py upi --minutes 5 --out bench/results/position/upi.json
     $PY -m longlab.cli train repo --model smollm2-135m --steps 24 --seq-len 512 --lr 1e-3 --minutes 3 \
       --out runs/position/repo-smollm2
     $PY bench/position.py heldout --out bench/results/position/heldout.json ;;
  D) $PY bench/position.py ppl --methods "$SCALED" --length 16384 --out "$PPL"
     $PY "${EVAL[@]}" --tasks passkey --lengths 4096 --samples 2 --positions "$SCALED" ;;
  E) $PY "${EVAL[@]}" --tasks niah_single_1,vt --lengths 4096 --samples 2 --positions "$KEY" ;;
  F) $PY "${EVAL[@]}" --tasks passkey --lengths 16384 --samples 2 --positions "$KEY" ;;
  A2) $PY bench/position.py ppl --methods "none,$KEY" --length 16384 --out "$PPL"
      $PY bench/position.py heldout --out bench/results/position/heldout.json
      $PY "${EVAL[@]}" --tasks passkey --lengths 4096 --samples 2 --positions "$KEY" ;;
  B2) $PY "${EVAL[@]}" --tasks passkey --lengths 8192 --samples 1 --positions "$KEY" ;;
  C2) $PY -m longlab.cli train repo --model smollm2-135m --steps 10 --seq-len 512 --lr 1e-3 --minutes 2 \
        --out runs/position/repo-smollm2
      $PY bench/position.py heldout --out bench/results/position/heldout.json
      $PY bench/position.py upi --minutes 3.5 --out bench/results/position/upi.json ;;
  # wave 3 (issue 14 follow-up): tasks beyond 4k for the training-free methods, n = 1 per cell per piece
  G8) $PY "${EVAL[@]}" --tasks passkey --lengths 8192 --samples 1 --positions "${SCALED/dynamic-ntk:factor=2,/}" ;;
  G-dyn) $PY bench/position.py ppl --methods dynamic-ntk:factor=2 --length 16384 --out "$PPL" ;;
  G-lr) $PY bench/position.py longrope-search --factor 2 --target 16384 --minutes 5.5 \
          --out bench/results/position/longrope_search.json ;;
  G-lrval) $PY bench/position.py ppl --length 16384 --out "$PPL" \
             --methods longrope:factor=2,factors=bench/results/position/longrope_search.json
           $PY bench/position.py tasks --positions dynamic-ntk:factor=2 --tasks passkey --length 8192 ;;
  G16) $PY bench/position.py tasks --positions yarn:factor=2,dynamic-ntk:factor=2 --tasks passkey --length 16384 ;;
  G-upi) $PY bench/position.py upi --minutes 3 --queries 16 --out bench/results/position/upi_q16.json
         $PY -m longlab.cli train drope --params qk_norm=true --model smollm2-135m --steps 60 --seq-len 512 \
           --lr 3e-4 --minutes 7.5 --out runs/position/drope-qk-smollm2
         $PY bench/position.py heldout --out bench/results/position/heldout.json \
           --specs drope:qk_norm=true,drope:qk_norm=true,weights=runs/position/drope-qk-smollm2 ;;
  # wave 4 (H8a, queued first, runs the UPI piece, the priority): n = 3 per cell at 8k (samples 1-2
  # added; sample 0 is reused from the store), 16k, 32k with a KV budget
  H8) $PY bench/position.py tasks --positions none,yarn:factor=2,ntk:factor=2 --tasks passkey --length 8192 \
         --samples 3 ;;
  H8b) $PY bench/position.py tasks --positions longrope:factor=2,pi:factor=2,dynamic-ntk:factor=2 --tasks passkey \
         --length 8192 --samples 3 ;;   # run in wave 5 (9.8 min)
  H-upi|H8a) $PY bench/position.py upi --task passkey --train-len 64 --steps 1200 --seeds 0 1 2 --eval-n 96 \
           --out bench/results/position/upi_passkey.json ;;
  H-upi2) $PY bench/position.py upi --task passkey --train-len 64 --steps 1200 --seeds 0 1 2 --eval-n 96 --more \
            --mults 1 2 4 8 16 32 --out bench/results/position/upi_passkey_more.json ;;  # wave 9: 30 min
  H16) $PY bench/position.py tasks --positions yarn:factor=2 --tasks passkey --length 16384 --samples 3 ;;  # NOT RUN
  # 32k: chunked prefill, SnapKV cutting the cache back to 4,096 after every 1,024-token chunk
  H32) $T --positions yarn:factor=4 --tasks passkey --length 32768 --samples 1 $BUDGET ;;
  H32b) $T --positions ntk:factor=4 --tasks passkey --length 32768 --samples 1 $BUDGET ;;  # NOT RUN
  # wave 5 (2026-12-02): perplexity with per-block NLL (intervals and paired tests), re-rotation cost
  I1) $PY bench/position.py ppl --methods yarn:factor=2,ntk:factor=2,dynamic-ntk:factor=2 --length 16384 \
        --block 64 --out bench/results/position/ppl_blocks.json ;;
  I2) $PY bench/position.py rerotate --cached 4096 8192 16384 --out bench/results/position/rerotate.json
      $PY bench/position.py ppl --methods longrope:factor=2,none --length 16384 --block 64 \
        --out bench/results/position/ppl_blocks.json ;;
  I3) $PY bench/position.py ppl --methods pi:factor=2 --length 16384 --block 64 \
        --out bench/results/position/ppl_blocks.json ;;
  I-rr) $PY bench/position.py rerotate --cached 4096 8192 16384 --out bench/results/position/rerotate.json ;;
  # wave 6 (2026-12-02): the task grid. niah_single_1 and vt answer within 32 tokens (a 7-digit number; vt's own
  # limit is 30), so they run with --max-new-tokens 32 (niah's own limit, 128, only adds decode time). 16k and
  # 32k: chunked prefill with SnapKV cutting every head back to 4,096 entries after every 1,024-token chunk.
  J4a) $T --positions "none,pi:factor=2,ntk:factor=2,yarn:factor=2" --tasks niah_single_1,vt --length 4096 \
         --samples 2 --max-new-tokens 32 ;;
  J4b) $T --positions "longrope:factor=2,$DROPE,$DROPEQK,$ROPEID" --tasks niah_single_1,vt --length 4096 \
         --samples 2 --max-new-tokens 32 ;;
  J4c) $T --positions "$REPO" --tasks niah_single_1,vt --length 4096 --samples 2 --max-new-tokens 32
       $T --positions "pi:factor=2,ntk:factor=2,longrope:factor=2,$DROPEQK,$REPO" --tasks passkey --length 4096 \
         --samples 2 ;;
  J4d) $T --positions "dynamic-ntk:factor=2" --tasks niah_single_1,vt --length 4096 --samples 2 --max-new-tokens 32
       $T --positions "dynamic-ntk:factor=2" --tasks passkey --length 4096 --samples 2 ;;
  K8a) $T --positions "none,yarn:factor=2,ntk:factor=2" --tasks niah_single_1,vt --length 8192 --max-new-tokens 32 ;;
  K8b) $T --positions "longrope:factor=2,pi:factor=2,$DROPE" --tasks niah_single_1,vt --length 8192 \
         --max-new-tokens 32 ;;
  K8c) $T --positions "$ROPEID,$DROPEQK,$REPO" --tasks niah_single_1,vt --length 8192 --max-new-tokens 32 ;;
  K8d) $T --positions "dynamic-ntk:factor=2" --tasks niah_single_1,vt --length 8192 --max-new-tokens 32 ;;
  K8p) $T --positions "$DROPE,$ROPEID,$DROPEQK,$REPO" --tasks passkey --length 8192 ;;
  K8p2) $T --positions "$DROPE,$ROPEID" --tasks passkey --length 8192 --samples 2 ;;
  L16a) $T --positions "none,yarn:factor=2" --tasks passkey --length 16384 $BUDGET ;;
  L16b) $T --positions "$DROPE,ntk:factor=2" --tasks passkey --length 16384 $BUDGET ;;
  L16c) $T --positions "dynamic-ntk:factor=2,longrope:factor=2" --tasks passkey --length 16384 $BUDGET ;;
  L16d) $T --positions "pi:factor=2,$ROPEID" --tasks passkey --length 16384 $BUDGET ;;
  L16e) $T --positions "$DROPEQK,$REPO" --tasks passkey --length 16384 $BUDGET ;;
  L16f) $T --positions "none,yarn:factor=2" --tasks niah_single_1 --length 16384 --max-new-tokens 32 $BUDGET ;;
  L16g) $T --positions "$DROPE" --tasks niah_single_1 --length 16384 --max-new-tokens 32 $BUDGET
        $T --positions "none" --tasks vt --length 16384 --max-new-tokens 32 $BUDGET ;;
  L16h) $T --positions "yarn:factor=2,$DROPE" --tasks vt --length 16384 --max-new-tokens 32 $BUDGET ;;
  # lead, 07:3x UTC: niah_single_1 at 16k with the FULL cache (no budget to confound the position method)
  L16full) $T --positions "yarn:factor=2,ntk:factor=2" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  L16full2) $T --positions "$DROPE,none" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  L16full3) $T --positions "longrope:factor=2,dynamic-ntk:factor=2" --tasks niah_single_1 --length 16384 \
              --max-new-tokens 32 ;;
  L16full4) $T --positions "yarn:factor=2,$DROPE" --tasks niah_single_1 --length 16384 --samples 2 \
              --max-new-tokens 32 ;;   # sample 1 (sample 0 is in the store)
  L16full5) $T --positions "dynamic-ntk:factor=2,none" --tasks niah_single_1 --length 16384 --samples 2 \
              --max-new-tokens 32 ;;
  M32a) $T --positions "ntk:factor=4" --tasks passkey --length 32768 $BUDGET ;;
  M32b) $T --positions "$DROPE" --tasks passkey --length 32768 $BUDGET ;;
  M32c) $T --positions "none" --tasks passkey --length 32768 $BUDGET ;;
  # wave 7 (2026-12-02, new checkout: runs/ was empty, so the recalibrated variants were retrained with the
  # commands of the page first, pieces T-*): the full cache beyond 16k (no budget to confound the method)
  T-drope) $PY -m longlab.cli train drope --model smollm2-135m --steps 60 --seq-len 512 --lr 3e-4 --minutes 10 \
             --out runs/position/drope-smollm2 ;;
  T-ropeid) $PY -m longlab.cli train ropeid --params train_len=512 --model smollm2-135m --steps 60 --seq-len 512 \
              --lr 3e-4 --minutes 9 --out runs/position/ropeid-smollm2 ;;
  T-dropeqk) $PY -m longlab.cli train drope --params qk_norm=true --model smollm2-135m --steps 60 --seq-len 512 \
               --lr 3e-4 --minutes 7.5 --out runs/position/drope-qk-smollm2 ;;
  T-repo) $PY -m longlab.cli train repo --model smollm2-135m --steps 10 --seq-len 512 --lr 1e-3 --minutes 2 \
            --out runs/position/repo-smollm2 ;;
  # issue 28 (honest rows): RePo retrained until its module moves (lr 5e-3, 80 steps, on CPython's documentation
  # text: 41k tokens, none seen twice), DroPE at 2.5x its earlier budget on the same text (150 x 512), each with
  # 16 held-out windows of 512 scored before and after; then niah_single_1 on the page's cells
  W-repo) $PY -m longlab.cli train repo --model smollm2-135m --data pydoc --steps 80 --seq-len 512 --lr 5e-3 \
            --heldout-windows 16 --minutes 30 --threads 1 --out runs/position/repo-smollm2-s80
          $PY bench/position.py variants --add runs/position/repo-smollm2-s80 ;;
  W-drope) $PY -m longlab.cli train drope --model smollm2-135m --data pydoc --steps 150 --seq-len 512 --lr 3e-4 \
             --heldout-windows 16 --minutes 40 --threads 1 --out runs/position/drope-smollm2-s150
           $PY bench/position.py variants --add runs/position/drope-smollm2-s150 ;;
  W-repo-n) $T --positions "$REPO80" --tasks niah_single_1 --length 4096 --samples 2 --max-new-tokens 32
            $T --positions "$REPO80" --tasks niah_single_1 --length 8192 --max-new-tokens 32 ;;
  W-repo-n16) $T --positions "$REPO80" --tasks niah_single_1 --length 16384 --samples 2 --max-new-tokens 32 ;;
  W-drope-n) $T --positions "$DROPE150" --tasks niah_single_1 --length 4096 --samples 2 --max-new-tokens 32 ;;
  W-n) $T --positions "$REPO80" --tasks niah_single_1 --length 4096 --samples 2 --max-new-tokens 32
       $T --positions "$REPO80" --tasks niah_single_1 --length 8192 --max-new-tokens 32
       $T --positions "$DROPE150" --tasks niah_single_1 --length 4096 --samples 2 --max-new-tokens 32
       $T --positions "$REPO80" --tasks niah_single_1 --length 16384 --samples 2 --max-new-tokens 32 ;;
  V16-c) $T --positions "pi:factor=2,ntk:factor=2" --tasks vt --length 16384 --max-new-tokens 32 ;;
  V16-d) $T --positions "longrope:factor=2,$ROPEID" --tasks vt --length 16384 --max-new-tokens 32 ;;
  V16-e) $T --positions "$DROPEQK,$REPO" --tasks vt --length 16384 --max-new-tokens 32 ;;
  N16-pi) $T --positions "pi:factor=2" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  N16-ropeid) $T --positions "$ROPEID" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  N16-dropeqk) $T --positions "$DROPEQK" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  N16-repo) $T --positions "$REPO" --tasks niah_single_1 --length 16384 --max-new-tokens 32 ;;
  V16-a) $T --positions "yarn:factor=2,dynamic-ntk:factor=2" --tasks vt --length 16384 --max-new-tokens 32 ;;
  V16-b) $T --positions "none,$DROPE" --tasks vt --length 16384 --max-new-tokens 32 ;;
  # more samples of the verdict pair (YaRN vs DroPE beyond 8k, full cache); committed samples are skipped
  N16-yd) $T --positions "yarn:factor=2,$DROPE" --tasks niah_single_1 --length 16384 --samples 4 --max-new-tokens 32 ;;
  N32-yd) $T --positions "yarn:factor=4,$DROPE" --tasks niah_single_1 --length 32768 --samples 2 --max-new-tokens 32 ;;
  # wave 8 (2026-12-02, new checkout again: T-* retrained first): four more niah pairs at 16k for the verdict pair
  # (samples 4-7; 0-3 are committed and skipped), the missing passkey-32k cells, vt at 32k for every method
  # T-dropeqk stopped at 56 of 60 steps at load ~2.8 (its 7.5-minute cap): retrained with a longer cap, 60 steps
  T-dropeqk2) $PY -m longlab.cli train drope --params qk_norm=true --model smollm2-135m --steps 60 --seq-len 512 \
                --lr 3e-4 --minutes 12 --out runs/position/drope-qk-smollm2 ;;
  N16-y8) $T --positions "yarn:factor=2" --tasks niah_single_1 --length 16384 --samples 8 --max-new-tokens 32 ;;
  N16-d8) $T --positions "$DROPE" --tasks niah_single_1 --length 16384 --samples 8 --max-new-tokens 32 ;;
  N32-y4) $T --positions "yarn:factor=4" --tasks niah_single_1 --length 32768 --samples 4 --max-new-tokens 32 ;;
  N32-d4) $T --positions "$DROPE" --tasks niah_single_1 --length 32768 --samples 4 --max-new-tokens 32 ;;
  # one method at 32k with the full cache, n = 1 (8-9.5 min each in wave 7, ~19 min in wave 8): niah_single_1
  # (N32-M), passkey (P32-M), vt (V32-M), M a key of AT32; N32-yd/-y4/-d4 above take more samples
  N32-*|P32-*|V32-*)
    m=${1#*-}; [ -n "${AT32[$m]:-}" ] || { echo "unknown method in piece $1 (one of: ${!AT32[*]})" >&2; exit 2; }
    case "${1%%-*}" in N32) task=niah_single_1 ;; P32) task=passkey ;; V32) task=vt ;; esac
    extra=(); [ "$task" = passkey ] || extra=(--max-new-tokens 32)
    $T --positions "${AT32[$m]}" --tasks "$task" --length 32768 "${extra[@]}" ;;
  # Gemma-3-270M (trained to 32k; 3 of its 18 layers global, the sliding layers keep 512 keys): own RoPE and
  # YaRN s = 2 on the global layers (the sliding layers keep their RoPE), full cache, its own store
  GM8) $GM --positions none --tasks niah_single_1 --length 8192 \
        --max-new-tokens 32 --samples "${2:-1}" ;;
  GM32) $GM --positions "none,yarn:factor=2" --tasks niah_single_1 \
         --length 32768 --max-new-tokens 32 ;;
  GM32n) $GM --positions none --tasks niah_single_1 --length 32768 \
          --max-new-tokens 32 --samples "${2:-1}" ;;
  GM32y) $GM --positions "yarn:factor=2" --tasks niah_single_1 \
          --length 32768 --max-new-tokens 32 --samples "${2:-1}" ;;
  # GM8, GM64n/GM64y and GM32n/GM32y [N]: samples 0..N-1 (default 1; committed samples are skipped), one method per slot
  GM64n) $GM --positions none --tasks niah_single_1 --length 65536 \
          --max-new-tokens 32 --samples "${2:-1}" ;;
  GM64y) $GM --positions "yarn:factor=2" --tasks niah_single_1 \
          --length 65536 --max-new-tokens 32 --samples "${2:-1}" ;;
  suite) $PY -m pytest -q -p no:cacheprovider tests/ || true ;;
    *) echo "unknown piece $1" >&2; exit 2 ;;
esac
uptime
exit
}
