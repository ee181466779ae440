"""Where longlab's side of ``bench/vs_kvpress.py`` spends its time: ``longlab eval``'s default path
(prefill once per sample, batched decode) on the vs-kvpress recipes, under cProfile.

    bench/heavy.sh .venv/bin/python bench/vs_kvpress_profile.py --out /tmp/vs_kvpress_profile

Prints the wall time and the top functions by cumulative and by own time (``torch._C._nn.linear`` is the
model's linear layers, ``scaled_dot_product_attention`` its attention). Defaults: 2 samples each of
``niah_single_1`` and ``vt`` at 1,600 tokens, full + snapkv/streaming/tova/knorm at 0.5 and 0.75, chunk
4,096, answers capped at 32 tokens, one thread (as vs_kvpress)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time

from longlab.eval.config import EvalConfig
from longlab.eval.driver import run_eval


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/vs_kvpress_profile", help="scratch results directory (replaced)")
    ap.add_argument("--length", type=int, default=1600)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    params = (("snapkv", ":window_size=64"), ("streaming", ""), ("tova", ""), ("knorm", ""))
    recipes = ["full"] + [f"{m}@{r}{p}" for m, p in params for r in (0.5, 0.75)]
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = EvalConfig(out=args.out, model="smollm2-135m", recipes=recipes, tasks=["niah_single_1", "vt"],
                     lengths=[args.length], samples=args.samples, chunk_size=4096, threads=1, report=False,
                     progress=False, max_new_tokens=32)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    summary = run_eval(cfg, log=lambda msg: None)
    prof.disable()
    print(f"wall {time.perf_counter() - t0:.1f} s, sweep {summary.sweep_s:.1f} s")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
