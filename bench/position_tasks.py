"""Task rows for chosen position methods only (``longlab eval --positions`` always adds the model's own RoPE,
which at 16k costs a ~4-minute prefill per sample; this runs exactly the methods given, ``none`` = own RoPE).

    bench/heavy.sh .venv/bin/python bench/position_tasks.py --positions yarn:factor=2,dynamic-ntk:factor=2 \\
        --tasks passkey --length 16384 --samples 1

Same settings as ``bench/position_sweep.sh``'s ``longlab eval`` (full cache, chunk 1,024, greedy, one
thread), same results store (``runs/position/eval``), so rows are resumable and paired by sample id.
With ``--recipe snapkv:budget=4096 --compress chunk`` the cache is cut back to the budget after every
1,024-token chunk (``longlab eval --compress chunk``: bounded memory and attention work at 16k-32k).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", required=True, help="comma-separated position specs; none = own RoPE")
    ap.add_argument("--tasks", default="passkey")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--recipe", default="full", help="KV recipe, e.g. snapkv:budget=4096 (default full)")
    ap.add_argument("--compress", default="end", choices=("end", "chunk"),
                    help="chunk: the recipe cuts the cache after every chunk (longlab eval --compress chunk)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap on each sample's own answer limit (longlab eval --max-new-tokens)")
    ap.add_argument("--out", default="runs/position/eval")
    ap.add_argument("--committed", default="bench/results/position/task_rows.json",
                    help="rows already committed (runs/ is not): longlab eval --skip-rows, their cells "
                         "are not run again; '' = none")
    args = ap.parse_args()
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.recipe import split_recipes

    config = EvalConfig(
        out=args.out, model=args.model, recipes=[args.recipe], tasks=args.tasks.split(","),
        lengths=[args.length], samples=args.samples, chunk_size=1024, threads=1, report=False, progress=False,
        compress=args.compress, max_new_tokens=args.max_new_tokens,
        skip_rows=args.committed if args.committed and Path(args.committed).exists() else None,
    )
    for spec in split_recipes(args.positions):
        t0 = time.perf_counter()
        summary = run_eval(dataclasses.replace(config, position=None if spec == "none" else spec))
        print(f"{spec}@{args.length}: {summary.written} new rows, {summary.skipped} skipped, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
