"""Perplexity vs position for position methods on one long text (chunked prefill, so memory is O(chunk · n)).

    bench/heavy.sh .venv/bin/python bench/position_ppl.py --methods none,yarn:factor=2 --length 16384 \\
        --out bench/results/position/ppl.json

The text is Python's own documentation (``pydoc_data.topics``, shipped with CPython: natural English prose
none of the recalibrated variants saw), topics in sorted order, joined. One forward pass per method, fed
in ``--chunk`` token chunks through a transformers cache; the per-token negative log-likelihood is binned
by position. Resumable: methods already in ``--out`` are skipped (one JSON object per method).

``--block B`` also keeps the NLL sums of consecutive ``B``-token blocks (``block_nll``: block ``j`` holds
the NLL of predicting tokens ``jB+1 .. (j+1)B``), so that ``bench/position_report.py`` can give each
perplexity a block-bootstrap interval and each pair of methods a paired test on the same blocks:

    bench/heavy.sh .venv/bin/python bench/position_ppl.py --methods yarn:factor=2,ntk:factor=2 \\
        --length 16384 --block 64 --out bench/results/position/ppl_blocks.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch


def long_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def nll_by_position(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """NLL ``[T-1]`` of each next token, prefilling ``ids [1, T]`` in chunks through a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    prev_last = None
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()  # [C, V]
            logp = torch.log_softmax(logits, dim=-1)
            if prev_last is not None:  # the previous chunk's last token predicts this chunk's first
                out.append(-prev_last[piece[0, 0]].reshape(1))
            out.append(-logp[:-1].gather(1, piece[0, 1:, None])[:, 0])
            prev_last = logp[-1]
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", required=True, help="comma-separated position specs (none = own RoPE)")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument(
        "--bins", default="0,1024,2048,4096,6144,8192,10240,12288,14336,16384,20480,24576,28672,32768"
    )
    ap.add_argument("--block", type=int, default=0, help="keep NLL sums of blocks of N tokens (0: off)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from longlab.models import load_model
    from longlab.recipe import split_recipes

    out = Path(args.out)
    done = json.loads(out.read_text()) if out.exists() else {}
    bins = [int(b) for b in args.bins.split(",") if int(b) <= args.length]
    for spec in split_recipes(args.methods):
        key = f"{spec}@{args.length}"
        if key in done:
            print(f"skip {key}", flush=True)
            continue
        model, tok = load_model(
            args.model, attn_implementation="sdpa", position=None if spec == "none" else spec
        )
        ids = torch.tensor([tok.encode(long_text(), add_special_tokens=False)[: args.length]])
        start = time.perf_counter()
        nll = nll_by_position(model, ids, args.chunk)
        seconds = time.perf_counter() - start
        rows = []
        for lo, hi in zip(bins, bins[1:]):
            part = nll[lo : hi - 1] if hi - 1 <= len(nll) else nll[lo:]
            if len(part):
                rows.append(
                    {"lo": lo, "hi": hi, "nll": part.mean().item(), "ppl": math.exp(part.mean().item())}
                )
        done[key] = {
            "method": spec,
            "length": args.length,
            "bins": rows,
            "seconds": seconds,
            "tokens": ids.shape[1],
            "chunk": args.chunk,
            "load": os.getloadavg()[0],
        }
        if args.block > 0:
            done[key]["block"] = args.block
            done[key]["block_nll"] = [
                round(nll[j : j + args.block].sum().item(), 4) for j in range(0, len(nll), args.block)
            ]
        print(
            key, " ".join(f"{r['lo']}-{r['hi']}:{r['ppl']:.1f}" for r in rows), f"{seconds:.0f}s", flush=True
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=1))
        os.replace(tmp, out)
        del model


if __name__ == "__main__":
    main()
