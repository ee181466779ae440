"""UPI on a small hybrid Mamba2-attention model trained on a synthetic recall task, evaluated at 1×-8× the
training length with no scaling, YaRN alone, UPI (Δ/n on the top-20% ERF heads + YaRN) and all heads scaled.

    bench/heavy.sh .venv/bin/python bench/upi_hybrid.py --task passkey --train-len 64 --steps 1000 \
        --seeds 0 1 2 --eval-n 96 --out bench/results/position/upi_passkey.json

``--task passkey`` (default; the layers lab's task, ``longlab.lab.tasks.PasskeyTask``: BOS, filler from 8
symbols, KEY and 5 digits at a random place, more filler, QUERY, the 5 digits; a sequence's score is the
fraction of the 5 digits predicted right, greedy, teacher-forced): the 2-attention-layer models of the lab
learn it at 64 tokens in a few hundred steps. Training follows the lab: AdamW (0.9, 0.95), weight decay 0.1,
lr 3e-3 with 5% linear warm-up and cosine to 10%, batch 32, clip 1. Every variant is scored on the same
``eval-n`` test sequences per length (drawn once, the same for every seed), so differences are paired.

``--task kv`` (the two earlier runs, kept to reproduce them): random filler with ``pairs`` key-value pairs,
``queries`` × (QUERY, key) each followed by its value; the hybrid never got past picking one of the planted
values there. The model: ``HybridLM`` (longlab.position.upi), layers MAMA, d_model 64, 4 heads.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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


VARIANTS = {
    "none": None,
    "yarn only": "upi:heads=none",
    "UPI (top 20% + YaRN)": "upi",
    "all heads + YaRN": "upi:heads=all",
}
#: ``--more``: the Mamba part alone (no YaRN on the attention layers)
MORE = {"top 20% Δ/n only": "upi:yarn=false", "all heads Δ/n only": "upi:heads=all,yarn=false"}


def lr_at(step: int, steps: int, lr: float) -> float:
    """The lab's schedule: linear warm-up over 5% of the steps, then cosine to 10% of ``lr``."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def passkey_scores(model, task, tokens: torch.Tensor, targets: torch.Tensor, answer: torch.Tensor,
                   chunk: int = 16) -> list[float]:
    """Per-sequence fraction of the answer digits predicted right (``tokens [N, T]``)."""
    out = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], chunk):
            logits = model(tokens[i : i + chunk])
            right = (logits.argmax(-1) == targets[i : i + chunk]) & answer[i : i + chunk]
            out += (right.sum(-1).float() / answer[i : i + chunk].sum(-1).float()).tolist()
    return out


def run_passkey(args) -> dict:
    from longlab.lab.tasks import PasskeyTask
    from longlab.position import apply_position
    from longlab.position.upi import HybridConfig, HybridLM

    task = PasskeyTask()
    variants = {**VARIANTS, **(MORE if args.more else {})}
    tests = {}
    for mult in args.mults:
        length = args.train_len * mult
        b = task.sample(args.eval_n, length, torch.Generator().manual_seed(12_345 + length), exact=False)
        tests[mult] = (b.tokens, b.targets, b.answer)
    result: dict = {"task": "passkey", "train_len": args.train_len, "steps": args.steps, "batch": args.batch,
                    "lr": args.lr, "eval_n": args.eval_n, "layers": args.layers, "seeds": [],
                    "load_start": os.getloadavg()[0]}
    for seed in args.seeds:
        torch.manual_seed(seed)
        cfg = HybridConfig(vocab_size=task.vocab_size, layers=args.layers,
                           max_position_embeddings=args.train_len)
        model = HybridLM(cfg)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        start, losses = time.perf_counter(), []
        model.train()
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
            bt = task.sample(args.batch, args.train_len, g, exact=False)
            loss = task.loss(model(bt.tokens), bt)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if (step + 1) % 100 == 0:
                print(f"seed {seed} step {step + 1} loss {sum(losses[-100:]) / 100:.4f} "
                      f"{time.perf_counter() - start:.0f}s", flush=True)
        train_s = time.perf_counter() - start
        model.eval()
        rows = []
        for mult, (tokens, targets, answer) in tests.items():
            for name, spec in variants.items():
                m = copy.deepcopy(model)
                erf = None  # the Δ divisor of every Mamba head (which heads UPI chose)
                if spec is not None and mult > 1:
                    apply_position(m, f"{spec}{',' if ':' in spec else ':'}factor={mult}")
                    erf = [float(x) for mx in m.mixers if hasattr(mx, "dt_scale") for x in mx.dt_scale]
                chunk = max(1, 16 * 512 // tokens.shape[1])  # bounds the [B, H, T, T] scan tensors
                scores = passkey_scores(m, task, tokens, targets, answer, chunk=chunk)
                rows.append({"length": args.train_len * mult, "factor": mult, "variant": name,
                             "mean": sum(scores) / len(scores), "scores": [round(x, 3) for x in scores],
                             "dt_scale": erf})
                print(f"seed {seed} {args.train_len * mult:5d} {name:22s} score {rows[-1]['mean']:.3f}",
                      flush=True)
        result["seeds"].append({"seed": seed, "train_seconds": train_s, "final_train_loss":
                                sum(losses[-50:]) / min(50, len(losses)), "load": os.getloadavg()[0],
                                "rows": rows})
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after every seed: a partial run is kept
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4, help="key-value pairs planted per sequence")
    ap.add_argument("--queries", type=int, default=2, help="queries per sequence (answers scored)")
    ap.add_argument("--out", default="bench/results/position/upi.json")
    ap.add_argument("--task", choices=("passkey", "kv"), default="passkey")
    ap.add_argument("--train-len", type=int, default=64, help="passkey: training length")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="passkey: training seeds")
    ap.add_argument("--lr", type=float, default=3e-3, help="passkey: peak learning rate")
    ap.add_argument("--layers", default="MAMA", help="passkey: M = Mamba2 mixer, A = attention")
    ap.add_argument("--mults", type=int, nargs="+", default=[1, 2, 4, 8], help="passkey: test/train length")
    ap.add_argument("--more", action="store_true", help="passkey: also the Δ/n variants without YaRN")
    args = ap.parse_args()
    if args.task == "passkey":
        if args.batch == 16:
            args.batch = 32
        run_passkey(args)
        return
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
