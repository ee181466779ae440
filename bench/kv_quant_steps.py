"""KV bytes step by step (after the context, after the question, then 6 greedy steps) for KV-quant recipes.

PM-KVQ shrinks its bit width once per append, so its memory right after a one-append context differs from
its memory while decoding; this prints both for each recipe on sample 0 of a task (one thread).

    bench/heavy.sh .venv/bin/python bench/kv_quant_steps.py --length 2048 \
        --recipes kivi2,kivi4,pmkvq:budget_mb=11.71 --out bench/results/kv_quant_2k/kv_bytes_per_step.json
"""

from __future__ import annotations

import argparse
import json

import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.models import load_model
from longlab.prompt import encode_prompts
from longlab.recipe import parse_recipe, split_recipes
from longlab.tasks import generate_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--recipes", required=True, help="comma-separated recipes")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    s = generate_samples(args.task, tok, length=args.length, num_samples=1, seed=0)[0]
    ctx, q = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix or ""])
    out: dict[str, list[float]] = {}
    for recipe in split_recipes(args.recipes):
        stream = Stream(model, LonglabCache(parse_recipe(recipe)), 1)
        stream.pad_id = tok.pad_token_id or 0
        logits = stream.feed(ctx, 128, compress="end")  # the context: compressed once, at its end
        mib = [stream.cache.nbytes() / 2**20]
        logits = stream.feed(q, 128, compress="chunk")
        mib.append(stream.cache.nbytes() / 2**20)
        for _ in range(args.steps):  # greedy steps, one append each
            logits = stream.feed([[int(logits[0].argmax())]], 128, compress="chunk")
            mib.append(stream.cache.nbytes() / 2**20)
        out[recipe] = [round(x, 2) for x in mib]
        r = out[recipe]
        print(recipe, "MiB: context", r[0], "| question", r[1], "| steps", r[2:])
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "task": args.task, "length": args.length, "mib": out}, f, indent=1)


if __name__ == "__main__":
    main()
