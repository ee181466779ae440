"""Passkey past 16k with a bounded KV cache: chunked prefill that compresses after every chunk.

    bench/heavy.sh .venv/bin/python bench/position_long.py --length 32768 --positions yarn:factor=4 \\
        --recipe snapkv:budget=4096 --samples 1 --out bench/results/position/long.json

``longlab eval`` feeds every context token before the last chunk uncompressed (the shared prefix of its
recipes) and compresses once at the end, so a 32k sample costs a full 32k prefill (~13 min at one thread,
over a slot). Here each sample goes through ``longlab.generate(..., compress="chunk")`` instead: after
every 1,024-token chunk the KV policy (e.g. SnapKV with ``budget`` entries per head, scored by the chunk's
last 32 queries) cuts the cache back to its budget, so every chunk attends to at most ``budget + 1,024``
keys and the prefill is linear in the length. Samples are ``longlab eval``'s own (same generator, same
sample ids, same scorer); rows are appended to ``--out`` (JSON), done rows skipped, so pieces resume.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", required=True, help="comma-separated position specs; none = own RoPE")
    ap.add_argument("--recipe", default="snapkv:budget=4096", help="KV policy compressing after every chunk")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--first", type=int, default=0, help="skip the first N samples (run a later piece)")
    ap.add_argument("--out", default="bench/results/position/long.json")
    args = ap.parse_args()
    import torch

    from longlab import generate, load_model
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import build_samples
    from longlab.recipe import split_recipes
    from longlab.tasks import score_sample

    torch.set_num_threads(1)
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["position"], r["recipe"], r["length"], r["sample_id"]) for r in rows}
    config = EvalConfig(
        out="/tmp/unused", model=args.model, recipes=[args.recipe], tasks=[args.task], lengths=[args.length],
        samples=args.samples, chunk_size=1024, threads=1, report=False, progress=False,
    )
    model, tokenizer = load_model(args.model)
    samples = build_samples(config, tokenizer)[args.first :]
    for spec in split_recipes(args.positions):
        for s in samples:
            key = (spec, args.recipe, args.length, s.sample_id)
            if key in done:
                print(f"{spec} {s.sample_id}: done, skipped", flush=True)
                continue
            chat = s.metadata.get("prompt", "chat") != "plain"
            t0 = time.perf_counter()
            res = generate(
                model, tokenizer, s.context, s.question, args.recipe, answer_prefix=s.answer_prefix,
                max_new_tokens=config.max_new_for(s.max_new_tokens), chunk_size=1024, compress="chunk",
                chat_template=chat, position=None if spec == "none" else spec,
            )
            wall = time.perf_counter() - t0
            pred = res.texts[0]
            row = {
                "position": spec, "recipe": args.recipe, "task": s.task, "length": args.length,
                "sample_id": s.sample_id, "depth": s.depth, "answers": s.answers, "prediction": pred,
                "score": score_sample(s, pred), "context_tokens": res.context_tokens[0],
                "prefill_s": res.prefill_s, "compress_s": res.compress_s, "decode_s": res.decode_s,
                "wall_s": wall, "kv_bytes_before": res.kv_bytes_before, "kv_bytes_after": res.kv_bytes_after,
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rows, indent=1))  # after every sample: a killed piece keeps its rows
            print(f"{spec} {s.sample_id}: score {row['score']:.2f} pred {pred[:40]!r} "
                  f"prefill {res.prefill_s:.0f}s wall {wall:.0f}s load {row['load']:.1f}", flush=True)


if __name__ == "__main__":
    main()
