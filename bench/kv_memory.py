"""KV bytes and peak RSS of chunked prefill + compression vs context length, at a fixed budget.

Shows that with a fixed budget the cache (and the process) stays flat in n, while the full cache
grows linearly. Each (length, recipe) runs in a fresh subprocess so peak RSS is its own.

    .venv/bin/python bench/kv_memory.py --model smollm2-135m --lengths 2048,8192,32768 --budget 1024
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = r"""
import json, resource, sys, time, torch
from longlab.models import load_model
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
model_name, recipe, n, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model, tok = load_model(model_name)
rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
gen = torch.Generator().manual_seed(0)
ids = torch.randint(100, min(tok.vocab_size, 30000), (n,), generator=gen).tolist()
stream = Stream(model, LonglabCache(recipe), 1)
start = time.perf_counter()
stream.feed([ids], chunk_size=chunk)
seconds = time.perf_counter() - start
cache = stream.cache
print(json.dumps({
    "model": model_name, "recipe": recipe, "tokens": n, "chunk_size": chunk,
    "kv_bytes": cache.nbytes(), "kv_bytes_full": cache.full_nbytes(),
    "entries_per_head": max(int(x.max()) for x in cache.lengths()),
    "prefill_compress_s": seconds, "compress_s": cache.stats["compress_s"],
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_load_mb": rss_loaded,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument(
        "--recipes", default="full,snapkv,streaming", help="methods; all but full get --budget"
    )
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/kv_memory.json")
    args = parser.parse_args()

    recipes = [r if r == "full" else f"{r}:budget={args.budget}" for r in args.recipes.split(",")]
    rows = []
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(
        f"{'recipe':<24}{'tokens':>8}{'KV MiB':>10}{'full MiB':>10}{'entries':>9}{'peak RSS MiB':>14}{'s':>8}"
    )
    for n in [int(x) for x in args.lengths.split(",")]:
        for recipe in recipes:
            start = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, recipe, str(n), str(args.chunk_size)],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(f"{recipe} at {n}: failed\n{out.stderr[-1500:]}")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["wall_s"] = time.perf_counter() - start
            rows.append(row)
            print(
                f"{recipe:<24}{n:>8}{row['kv_bytes'] / 2**20:>10.1f}{row['kv_bytes_full'] / 2**20:>10.1f}"
                f"{row['entries_per_head']:>9}{row['peak_rss_mb']:>14.0f}{row['prefill_compress_s']:>8.1f}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
