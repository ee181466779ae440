"""Decode fidelity of IndexMem against SnapKV: does the latent memory bring the output closer to full?

For each RULER sample (query-aware, context + question compressed once at the end, 256-token chunks as in
``longlab eval``), full attention decodes the answer greedily; every recipe then decodes the same tokens
(teacher forcing) and we record KL(full || recipe) of the next-token distribution and top-1 agreement.
The context before the last chunk is prefilled once and forked per recipe, like the eval harness.

    OMP_NUM_THREADS=1 python bench/indexmem_fidelity.py --out runs/indexmem/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.models import load_model
from longlab.prompt import encode_prompts
from longlab.tasks import generate_samples as make_samples

RECIPES = (
    "snapkv@0.75",
    "indexmem@0.75:memory=false",
    "indexmem@0.75",
    "snapkv@0.9",
    "indexmem@0.9:memory=false",
    "indexmem@0.9",
)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="niah_single_1,vt")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--out", default="runs/indexmem/fidelity.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    rows = []
    start = time.perf_counter()
    for task in args.tasks.split(","):
        for s in make_samples(task, tok, args.length, args.samples, 0):
            (c_ids,), (q_ids,) = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix])
            ids = c_ids + q_ids
            tail = ids[-args.chunk_size :]
            shared = Stream(model, LonglabCache(None), 1)
            shared.feed([ids[: -len(tail)]], args.chunk_size, compress="none")
            full = shared.fork()
            logits = full.feed([tail], args.chunk_size, compress="none")
            answer, ref = [], []
            for _ in range(args.tokens):  # greedy under full attention
                ref.append(torch.log_softmax(logits.float(), -1))
                answer.append(int(logits.argmax(-1)))
                logits = full.feed([[answer[-1]]], compress="none")
            for recipe in RECIPES:
                branch = shared.fork(recipe)
                logits = branch.feed([tail], args.chunk_size, compress="end")
                kls, agree = [], []
                for i in range(args.tokens):
                    lp = torch.log_softmax(logits.float(), -1)
                    kls.append(float((ref[i].exp() * (ref[i] - lp)).sum()))
                    agree.append(int(logits.argmax(-1)) == answer[i])
                    logits = branch.feed([[answer[i]]], compress="none")
                rows.append(
                    {
                        "task": task,
                        "sample": s.sample_id,
                        "recipe": recipe,
                        "kl": sum(kls) / len(kls),
                        "top1": sum(agree) / len(agree),
                    }
                )
                print(f"{task} {s.sample_id} {recipe}: KL {rows[-1]['kl']:.3f} top1 {rows[-1]['top1']:.2f}")
    summary = {}
    for recipe in RECIPES:
        mine = [r for r in rows if r["recipe"] == recipe]
        summary[recipe] = {
            "kl": round(sum(r["kl"] for r in mine) / len(mine), 4),
            "top1": round(sum(r["top1"] for r in mine) / len(mine), 3),
            "n": len(mine),
        }
    out = {
        "args": vars(args),
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary,
        "rows": rows,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
