"""UPI on a small hybrid Mamba2-attention model trained on a synthetic recall task, evaluated at 1×-8× the
training length with no scaling, YaRN alone, UPI (Δ/n on the top-20% ERF heads + YaRN) and all heads scaled.

    bench/heavy.sh .venv/bin/python bench/upi_hybrid.py --minutes 6 --out bench/results/position/upi.json

Task (exact ground truth): random filler tokens with ``pairs`` key-value pairs planted at random places,
then ``queries`` × (QUERY, key) each followed by its value; the loss and the accuracy are on the values.
``--queries 16`` gives 8× the supervised answers per sequence of the default 2 (the run that learned).
The model: ``HybridLM`` (longlab.position.upi), layers MAMA, d_model 64, 4 heads. Training length 128.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

KEYS, VALUES, FILLER, QUERY = range(0, 16), range(16, 32), range(32, 62), 62


def batch(n: int, length: int, pairs: int = 4, queries: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FILLER.start, FILLER.stop, (n, length), generator=g)
    targets = torch.full((n, length), -100)
    body = length - 3 * queries
    for b in range(n):
        keys = torch.randperm(16, generator=g)[:pairs]
        vals = torch.randint(VALUES.start, VALUES.stop, (pairs,), generator=g)
        slots = torch.randperm(body // 2 - 1, generator=g)[:pairs] * 2
        for k, v, s in zip(keys, vals, slots):
            ids[b, s], ids[b, s + 1] = k, v
        for q in range(queries):
            i = torch.randint(0, pairs, (1,), generator=g).item()
            at = body + 3 * q
            ids[b, at], ids[b, at + 1], ids[b, at + 2] = QUERY, keys[i], vals[i]
            targets[b, at + 1] = vals[i]  # logits at the key predict the value
    return ids, targets


def accuracy(model, length: int, n: int, seed: int, pairs: int = 4, queries: int = 2) -> tuple[float, float]:
    ids, targets = batch(n, length, pairs, queries, seed=seed)
    with torch.no_grad():
        logits = model(ids)
    mask = targets != -100
    acc = (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask]).item()
    return acc, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4, help="key-value pairs planted per sequence")
    ap.add_argument("--queries", type=int, default=2, help="queries per sequence (answers scored)")
    ap.add_argument("--out", default="bench/results/position/upi.json")
    args = ap.parse_args()
    from longlab.position import apply_position
    from longlab.position.upi import HybridConfig, HybridLM

    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, layers="MAMA", max_position_embeddings=128)
    model = HybridLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    start, step, losses = time.perf_counter(), 0, []
    while step < args.steps and time.perf_counter() - start < 60 * args.minutes:
        ids, targets = batch(args.batch, 128, args.pairs, args.queries, seed=1000 + step)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 100 == 0:
            print(
                f"step {step} loss {sum(losses[-100:]) / 100:.3f} {time.perf_counter() - start:.0f}s",
                flush=True,
            )
    train_s = time.perf_counter() - start
    model.eval()
    variants = {
        "none": None,
        "yarn only": "upi:heads=none",
        "UPI (top 20% + YaRN)": "upi",
        "all heads + YaRN": "upi:heads=all",
    }
    result = {
        "train_steps": step,
        "train_seconds": train_s,
        "train_tokens": step * args.batch * 128,
        "final_train_loss": sum(losses[-100:]) / min(100, len(losses)),
        "eval_n": args.eval_n,
        "pairs": args.pairs,
        "queries": args.queries,
        "answers_per_cell": args.eval_n * args.queries,
        "load": os.getloadavg()[0],
        "rows": [],
    }
    for mult in (1, 2, 4, 8):
        length = 128 * mult
        for name, spec in variants.items():
            m = copy.deepcopy(model)
            if spec is not None and mult > 1:
                apply_position(m, f"{spec}{',' if ':' in spec else ':'}factor={mult}")
            acc, loss = accuracy(m, length, args.eval_n, seed=99, pairs=args.pairs, queries=args.queries)
            result["rows"].append(
                {"length": length, "factor": mult, "variant": name, "acc": acc, "loss": loss}
            )
            print(f"{length:5d} {name:24s} acc {acc:.3f} loss {loss:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
