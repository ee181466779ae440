"""KV-method overhead: compression time as a fraction of prefill, and decode-step time vs context length.

    python bench/kv_overhead.py                           # SmolLM2-135M, 4k and 16k, every layer
    python bench/kv_overhead.py --layers 4 --threads 1    # first 4 decoder layers (what was run here)
    python bench/kv_overhead.py --quick                   # tiny model, seconds (smoke test)

**Compression** (per length): a real context (RULER niah_single_1 text) is prefilled with the full
cache in chunks of ``--chunk-size`` (timed: ``prefill_s``); the last chunk's queries are kept. Then, for
every method, each layer's compression step as the hook runs it after the last chunk —
``keep = policy.select(ctx); layer.keep(keep)`` — is timed on a copy of that layer (best of
``--repeats`` rounds, methods interleaved within a round) and summed over layers:
``fraction = compress_s / prefill_s`` and ``vs_snapkv = compress_s / compress_s(snapkv)``. Goals
(issue 4): fraction <= 5% for score-based methods; ReST-KV and OBCache within 1.5x of SnapKV.
H2O-style methods are not in this table: their cost is the per-forward accumulation inside the
prefill, not a compression step.
``--layers N`` keeps the first N decoder layers: every layer has the same shapes, so the fraction of a
truncated model is the per-layer fraction of the full one (the embedding and the 1-token LM head are
negligible).

**Decode** (per length): the cache of every layer is filled with random post-RoPE keys/values of the
model's shapes (decode cost depends on shapes, not values) and ``--steps`` decode steps of the full
model are timed (median) for ``full``, ``quest:budget=B`` and ``retro:budget=B`` (RetroAttention with
its output cache, page table and K/V refresh of the layer above). With ``--rounds R`` the three recipes'
streams live side by side and take turns (order rotated each round), ``--steps`` steps each per round,
so a change of machine load hits all three alike; the value is the median over all rounds' steps.

**Fidelity** (``--parts fidelity``): on a real ``--fidelity-length`` context, full attention decodes
``--fidelity-steps`` tokens greedily; Quest and RetroAttention (``--fidelity-budget``) then decode the
same tokens (teacher forcing); reported: mean ``KL(full || method)`` of the next-token distributions
and top-1 agreement. RetroAttention's claim is that its refreshed past states bring sparse decoding
closer to full attention than Quest at the same budget.

Writes JSON to ``--out`` (default ``bench/results/kv_overhead.json``) with a hardware header.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from common import hardware, write_json

from longlab.attention import LayerContext, dense_attention
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.kv.base import KVPolicy
from longlab.recipe import Recipe, parse_method

COMPRESS_METHODS = (
    "snapkv", "pyramidkv", "adakv", "tova", "restkv", "restkv:pyramid=true",
    "snapkv-obcv", "snapkv-obck", "snapkv-obcvk", "tova-obcvk",
)
DECODE_RECIPES = ("full", "quest:budget={budget}", "retro:budget={budget}")


class _LastQueries(KVPolicy):
    """Keeps each layer's queries of the latest forward (the observation window of the compression)."""

    needs_observe = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.q: dict[int, torch.Tensor] = {}

    def observe(self, ctx) -> None:
        self.q[ctx.layer_idx] = ctx.q


def _truncate(model, layers: int):
    if layers and layers < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


def _context_ids(tokenizer, length: int) -> list[int]:
    from longlab.tasks import generate_samples

    sample = generate_samples("niah_single_1", tokenizer, length, 1, 0)[0]
    ids = tokenizer(sample.context, add_special_tokens=False)["input_ids"]
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def _copy_layer(layer):
    twin = copy.copy(layer)
    twin.extras = dict(layer.extras)
    return twin


def bench_compression(model, tokenizer, length: int, chunk_size: int, repeats: int) -> dict[str, Any]:
    ids = _context_ids(tokenizer, length)
    recorder = _LastQueries()
    cache = LonglabCache(Recipe(kv=[recorder]))
    stream = Stream(model, cache, 1)
    start = time.perf_counter()
    stream.feed([ids], chunk_size, compress="none")
    prefill_s = time.perf_counter() - start
    out: dict[str, Any] = {"length": length, "prefill_s": prefill_s, "layers": len(cache.layers)}
    out["methods"] = {}
    outputs = {}  # the hook runs select after attention: the chunk's outputs exist (OBCache reuses them)
    for idx, layer in enumerate(cache.layers):
        q = recorder.q[idx]
        ctx = LayerContext(layer_idx=idx, num_layers=len(cache.layers), module=None, phase="prefill", q=q,
                           scaling=model.model.layers[idx].self_attn.scaling,
                           query_index=layer.index[:, 0, -q.shape[-2]:], layer=layer, cache=cache)
        outputs[idx] = dense_attention(q, layer.keys, layer.values, ctx.mask(), ctx.scaling)
    policies = {}
    for spec in COMPRESS_METHODS:
        name, _, params = spec.partition(":")
        policies[spec] = parse_method(f"{name}@0.5" + (f":{params}" if params else ""))
    best = {(spec, idx): float("inf") for spec in policies for idx in range(len(cache.layers))}
    for _ in range(repeats):  # round-robin over methods, so load changes on a shared machine hit all alike
        for spec, policy in policies.items():
            for idx, layer in enumerate(cache.layers):
                attn = model.model.layers[idx].self_attn
                q = recorder.q[idx]
                twin = _copy_layer(layer)
                ctx = LayerContext(
                    layer_idx=idx, num_layers=len(cache.layers), module=attn, phase="prefill", q=q,
                    scaling=attn.scaling, query_index=layer.index[:, 0, -q.shape[-2]:], layer=twin,
                    cache=cache,
                )
                ctx.attn_output = outputs[idx]
                t0 = time.perf_counter()
                keep = policy.select(ctx)
                if keep is not None:
                    twin.keep(keep)
                best[spec, idx] = min(best[spec, idx], time.perf_counter() - t0)
    for spec in policies:
        total = sum(best[spec, idx] for idx in range(len(cache.layers)))
        out["methods"][spec] = {"compress_s": total, "fraction": total / prefill_s}
        print(f"  {length:>6} {spec:<22} compress {total * 1e3:8.1f} ms = {100 * total / prefill_s:5.2f}% "
              f"of prefill ({prefill_s:.1f} s)", flush=True)
    snap = out["methods"]["snapkv"]["compress_s"]
    for row in out["methods"].values():
        row["vs_snapkv"] = row["compress_s"] / snap
    return out


def _filled_stream(model, recipe: str, length: int) -> Stream:
    cfg = model.config
    H_kv = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = LonglabCache(recipe)
    stream = Stream(model, cache, 1)
    gen = torch.Generator().manual_seed(0)
    for idx in range(cfg.num_hidden_layers):
        k = torch.randn(1, H_kv, length, D, generator=gen)
        v = torch.randn(1, H_kv, length, D, generator=gen)
        cache.update(k, v, idx)
    cache._updates_of_layer0 = 0  # the fill is not a model forward (the cache's hook check counts those)
    stream.seen_mask = torch.ones(1, length, dtype=torch.bool)
    stream.next_pos = torch.tensor([length])
    return stream


def bench_decode(model, length: int, budget: int, steps: int, rounds: int = 1) -> dict[str, Any]:
    """``rounds`` rounds of ``steps`` timed steps per recipe, recipes interleaved (order rotated each
    round) on streams that live side by side, so load changes hit every recipe alike; the value is the
    median over all rounds' steps, with the per-round medians kept."""
    import os

    out: dict[str, Any] = {"length": length, "budget": budget, "rounds": rounds, "recipes": {},
                           "load_avg_1m_start": os.getloadavg()[0]}
    recipes = [template.format(budget=budget) for template in DECODE_RECIPES]
    streams, tokens = {}, {}
    for recipe in recipes:
        streams[recipe] = _filled_stream(model, recipe, length)
        tokens[recipe] = 42
        for _ in range(2):  # warm-up: first steps install hooks / build page summaries
            tokens[recipe] = int(streams[recipe].feed([[tokens[recipe]]], compress="none")[0].argmax())
    times: dict[str, list[float]] = {r: [] for r in recipes}
    per_round: dict[str, list[float]] = {r: [] for r in recipes}
    for rnd in range(rounds):
        for recipe in recipes[rnd % len(recipes):] + recipes[: rnd % len(recipes)]:
            block = []
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = streams[recipe].feed([[tokens[recipe]]], compress="none")
                block.append(time.perf_counter() - t0)
                tokens[recipe] = int(logits[0].argmax())
            times[recipe] += block
            per_round[recipe].append(1e3 * statistics.median(block))
    for recipe in recipes:
        xs = sorted(times[recipe])
        out["recipes"][recipe] = {"step_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * xs[0],
                                  "q1_ms": 1e3 * xs[len(xs) // 4], "q3_ms": 1e3 * xs[(3 * len(xs)) // 4],
                                  "n_steps": len(xs), "round_medians_ms": per_round[recipe]}
    # per-round ratios (same round, adjacent in time) and their median
    full_rounds = per_round["full"]
    for recipe, row in out["recipes"].items():
        row["vs_full"] = row["step_ms"] / out["recipes"]["full"]["step_ms"]
        ratios = sorted(a / b for a, b in zip(per_round[recipe], full_rounds))
        row["vs_full_round_ratios"] = ratios
    out["load_avg_1m_end"] = os.getloadavg()[0]
    del streams
    print("  " + f"{length:>6} " + "  ".join(f"{r} {v['step_ms']:7.1f} ms ({v['vs_full']:.2f}x)"
                                            for r, v in out["recipes"].items()), flush=True)
    return out


def bench_fidelity(model, tokenizer, length: int, budget: int, steps: int) -> dict[str, Any]:
    """Teacher-forced decode on a real context: how far Quest and RetroAttention drift from full attention.

    ``steps`` tokens are decoded greedily with the full cache; each sparse recipe then decodes the same
    tokens (teacher forcing) and the per-step ``KL(full || method)`` and top-1 agreement are averaged."""
    ids = _context_ids(tokenizer, length)
    out: dict[str, Any] = {"length": length, "budget": budget, "steps": steps, "recipes": {}}
    ref_logits, tokens = [], []
    for template in DECODE_RECIPES:
        recipe = template.format(budget=budget)
        stream = Stream(model, LonglabCache(recipe), 1)
        logits = stream.feed([ids], 1024, compress="none")
        kls, agree = [], []
        for i in range(steps):
            if recipe == "full":
                ref_logits.append(logits[0].float())
                tokens.append(int(logits[0].argmax()))
            else:
                ref = ref_logits[i].log_softmax(-1)
                cur = logits[0].float().log_softmax(-1)
                kls.append(float((ref.exp() * (ref - cur)).sum()))
                agree.append(float(int(cur.argmax()) == tokens[i]))
            logits = stream.feed([[tokens[i]]], compress="none")
        if recipe != "full":
            out["recipes"][recipe] = {"kl": statistics.mean(kls), "top1_agreement": statistics.mean(agree)}
            print(f"  fidelity {length:>6} {recipe:<22} KL {statistics.mean(kls):.4f}  "
                  f"top-1 agreement {statistics.mean(agree):.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="4096,16384", help="compression lengths (tokens)")
    p.add_argument("--decode-lengths", default="2048,4096,8192,16384")
    p.add_argument("--layers", type=int, default=0, help="first N decoder layers for compression (0: all)")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=int, default=1024, help="Quest/RetroAttention token budget")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="decode: interleaved rounds of --steps per recipe")
    p.add_argument("--threads", type=int)
    p.add_argument("--parts", default="decode,compression,fidelity", help="which measurements to run")
    p.add_argument("--fidelity-length", type=int, default=2048)
    p.add_argument("--fidelity-budget", type=int, default=256)
    p.add_argument("--fidelity-steps", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="tiny model, short lengths (smoke test)")
    p.add_argument("--out", default="bench/results/kv_overhead.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from longlab.models import load_model

    if args.quick:
        args.model, args.lengths, args.decode_lengths = "tiny-llama", "512", "256,512"
        args.budget, args.steps = 64, 3
        args.fidelity_length, args.fidelity_budget, args.fidelity_steps = 512, 64, 6
    lengths = [int(x) for x in args.lengths.split(",") if x]
    decode_lengths = [int(x) for x in args.decode_lengths.split(",") if x]
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"hardware": hardware(), "config": vars(args), "compression": [], "decode": []}
    threads = torch.get_num_threads()
    print(f"# kv overhead: {args.model}, torch {torch.__version__}, {threads} threads", flush=True)
    with torch.inference_mode():
        model, tokenizer = load_model(args.model)
        if "fidelity" in parts:
            result["fidelity"] = bench_fidelity(
                model, tokenizer, args.fidelity_length, args.fidelity_budget, args.fidelity_steps
            )
        for n in decode_lengths if "decode" in parts else ():
            result["decode"].append(bench_decode(model, n, args.budget, args.steps, args.rounds))
        model = _truncate(model, args.layers)
        for n in lengths if "compression" in parts else ():
            row = bench_compression(model, tokenizer, n, args.chunk_size, args.repeats)
            result["compression"].append(row)
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
