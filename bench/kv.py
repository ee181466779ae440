"""KV-cache methods: memory, overhead, quantization speed and bytes per step, and fidelity to reference
selections (PyramidKV, IndexMem).

Subcommands (``python bench/kv.py SUB --help`` for each one's options):

- ``memory``: KV bytes and peak RSS of chunked prefill + compression vs context length, at a fixed budget.
- ``overhead``: KV-method overhead: compression time as a fraction of prefill, and decode-step time vs
  context length.
- ``quant-speed``: KV-cache quantization speed: quantize cost per token and decode-step time vs context
  length.
- ``quant-steps``: KV bytes step by step (after the context, after the question, then 6 greedy steps) for
  KV-quant recipes.
- ``pyramidkv-fidelity``: PyramidKV fidelity: longlab's kept sets against the official selection, layer by
  layer.
- (IndexMem's decode fidelity against SnapKV is a ``longlab eval`` run,
  ``bench/configs/indexmem-fidelity.toml``: teacher-forced rows with ``extra.fidelity`` and
  ``extra.kl_vs_full``.)
- ``indexmem-pairs``: IndexMem against SnapKV at equal ratio, from a ``longlab eval`` store (issue 10, item
  6).
- ``eviction-pairs``: OBCache / ReST-KV against their baselines at 2k, from a ``longlab eval`` store (the
  kv-eviction page's pairs.json).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import ROOT, best_of, hardware, read_store, run_subcommand, write_json

from longlab.attention import LayerContext, dense_attention
from longlab.cache import LonglabCache, LonglabLayer
from longlab.engine.stream import Stream
from longlab.eval.stats import score_estimate, stratified_difference, stratified_estimate
from longlab.kv import kept_indices
from longlab.kv.base import KVPolicy
from longlab.models import load_model
from longlab.prompt import encode_prompts
from longlab.recipe import Recipe, parse_method, parse_recipe, split_recipes
from longlab.tasks import generate_samples

# ---- memory (was bench/kv.py memory) ----------------------------------------

DOC_MEMORY = """
KV bytes and peak RSS of chunked prefill + compression vs context length, at a fixed budget.

Shows that with a fixed budget the cache (and the process) stays flat in n, while the full cache
grows linearly. Each (length, recipe) runs in a fresh subprocess so peak RSS is its own.

    .venv/bin/python bench/kv.py memory --model smollm2-135m --lengths 2048,8192,32768 --budget 1024
""".lstrip("\n")

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


def memory_main() -> None:
    parser = argparse.ArgumentParser(description=DOC_MEMORY.splitlines()[0])
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


def _run_memory() -> object:
    memory_main()


# ---- overhead (was bench/kv.py overhead) ----------------------------------------

DOC_OVERHEAD = """
KV-method overhead: compression time as a fraction of prefill, and decode-step time vs context length.

    python bench/kv.py overhead                           # SmolLM2-135M, 4k and 16k, every layer
    python bench/kv.py overhead --layers 4 --threads 1    # first 4 decoder layers (what was run here)
    python bench/kv.py overhead --quick                   # tiny model, seconds (smoke test)

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

(Decode fidelity of Quest and RetroAttention against full attention, once a loop here, is a ``longlab eval``
run: ``bench/configs/decode-fidelity.toml``, teacher-forced rows with ``extra.kl_vs_full``.)

Writes JSON to ``--out`` (default ``bench/results/kv_overhead.json``) with a hardware header.
""".lstrip("\n")

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
    cache.reset_hook_check()  # the fill is not a model forward (the cache's hook check counts those)
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


def overhead_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_OVERHEAD.splitlines()[0])
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
    p.add_argument("--parts", default="decode,compression", help="which measurements to run")
    p.add_argument("--quick", action="store_true", help="tiny model, short lengths (smoke test)")
    p.add_argument("--out", default="bench/results/kv_overhead.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from longlab.models import load_model

    if args.quick:
        args.model, args.lengths, args.decode_lengths = "tiny-llama", "512", "256,512"
        args.budget, args.steps = 64, 3
    lengths = [int(x) for x in args.lengths.split(",") if x]
    decode_lengths = [int(x) for x in args.decode_lengths.split(",") if x]
    parts = set(args.parts.split(","))
    if parts - {"decode", "compression"}:
        raise SystemExit(f"--parts: decode and/or compression, got {args.parts!r} (fidelity is "
                         "bench/configs/decode-fidelity.toml)")
    result: dict[str, Any] = {"hardware": hardware(), "config": vars(args), "compression": [], "decode": []}
    threads = torch.get_num_threads()
    print(f"# kv overhead: {args.model}, torch {torch.__version__}, {threads} threads", flush=True)
    with torch.inference_mode():
        model, tokenizer = load_model(args.model)
        for n in decode_lengths if "decode" in parts else ():
            result["decode"].append(bench_decode(model, n, args.budget, args.steps, args.rounds))
        model = _truncate(model, args.layers)
        for n in lengths if "compression" in parts else ():
            row = bench_compression(model, tokenizer, n, args.chunk_size, args.repeats)
            result["compression"].append(row)
    print(f"wrote {write_json(args.out, result)}")
    return 0


def _run_overhead() -> object:
    raise SystemExit(overhead_main())


# ---- quant-speed (was bench/kv.py quant-speed) ----------------------------------------

DOC_QUANT_SPEED = """
KV-cache quantization speed: quantize cost per token and decode-step time vs context length.

    python bench/kv.py quant-speed                       # layer level + SmolLM2 end to end
    python bench/kv.py quant-speed --quick               # layer level only, short lengths
    python bench/kv.py quant-speed --lengths 1024,4096,16384 --e2e-lengths 1024,2048

Three measurements, each best of ``--repeats`` after a warm-up:

1. **quantize cost** (one layer, SmolLM2 KV shapes H_kv=3, D=64, random K/V): converting a
   full-precision layer of T entries (``kivi2``, ``kivi4``: keys per channel, values per token;
   ``pmkvq``: per token at 16 bits, then 16 -> 8 -> 4 -> 2 by the equivalent right shift), in
   microseconds per token; and the per-step cost of a decode append (``apply`` after each token).
2. **decode attention** (one layer, H=9 query heads, one query): dense SDPA over the full-precision
   layer (the hook's path) vs ``QuantizedLayer.attend`` (dequantises ``chunk_tokens`` entries at a time,
   online softmax), vs T; plus the layer's bytes per entry.
3. **end to end** (``--model``, default smollm2-135m; skipped with ``--quick``): context prefilled once
   uncompressed, then forked per recipe; the first decode step converts the cache (timed apart),
   then ``--steps`` decode steps are timed (ms per token) with the cache's bytes.

Writes ``bench/results/kv_quant_speed.json`` (hardware header with the load average: the machine is
shared, wall times are noisy) and prints tables.
""".lstrip("\n")

def best_time(fn, repeats: int) -> float:
    """Best of ``repeats`` timed calls after one warm-up call."""
    return best_of(fn, repeats, warmup=True)[0]


H, H_KV, D = 9, 3, 64  # SmolLM2-135M heads


QUANT_SPEED_RECIPES = ("kivi2", "kivi4", "pmkvq:budget_mb=1000000")


def _fp_layer(T: int, seed: int = 0) -> LonglabLayer:
    g = torch.Generator().manual_seed(seed)
    layer = LonglabLayer()
    layer.update(torch.randn(1, H_KV, T, D, generator=g), torch.randn(1, H_KV, T, D, generator=g))
    return layer


def _quantize(recipe: str, T: int):
    """A fresh cache whose one layer holds T entries, converted by the recipe's quant policy."""
    cache = LonglabCache(recipe)
    cache.layers.append(_fp_layer(T))
    layer = cache.layers[0]
    q = torch.randn(1, H, 1, D)
    ctx = LayerContext(0, 1, None, "decode", q, D**-0.5, layer.index[:, 0, -1:], None, layer, cache)
    cache.recipe.kv[-1].apply(ctx)
    if "pmkvq" in recipe:
        for _ in range(3):  # 16 -> 8 -> 4 -> 2 with the equivalent right shift
            ctx.layer.key_store.shrink()
            ctx.layer.value_store.shrink()
    return cache, ctx


def quantize_cost(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for T in lengths:
        for recipe in QUANT_SPEED_RECIPES:
            convert_s = best_time(lambda recipe=recipe, T=T: _quantize(recipe, T), repeats)
            cache, ctx = _quantize(recipe, T)
            policy, layer = cache.recipe.kv[-1], ctx.layer
            steps = 128  # one key block flush for KIVI, one window flush for PM-KVQ
            g = torch.Generator().manual_seed(1)
            new = [
                (torch.randn(1, H_KV, 1, D, generator=g), torch.randn(1, H_KV, 1, D, generator=g))
                for _ in range(steps)
            ]
            start = time.perf_counter()
            for k, v in new:
                layer.update(k, v)
                ctx.query_index = layer.index[:, 0, -1:]
                policy.apply(ctx)
            append_s = (time.perf_counter() - start) / steps
            rows.append({
                "recipe": recipe.split(":")[0], "T": T, "convert_us_per_token": 1e6 * convert_s / T,
                "decode_apply_us_per_step": 1e6 * append_s,
            })  # fmt: skip
            r = rows[-1]
            print(
                f"quantize  {r['recipe']:6s} T={T:6d}  convert {r['convert_us_per_token']:7.2f} us/token"
                f"  decode apply {r['decode_apply_us_per_step']:8.1f} us/step"
            )
    return rows


def decode_attention(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for T in lengths:
        layer = _fp_layer(T)
        q = torch.randn(1, H, 1, D)
        qidx = torch.tensor([[T - 1]], dtype=torch.int32)
        ctx = LayerContext(0, 1, None, "decode", q, D**-0.5, qidx, None, layer)
        full_s = best_time(
            lambda ctx=ctx, layer=layer: dense_attention(
                ctx.q, layer.keys, layer.values, ctx.mask(), ctx.scaling
            ),
            repeats,
        )
        row = {"T": T, "full_ms": 1e3 * full_s, "full_bytes_per_token": layer.nbytes() / T}
        for recipe in QUANT_SPEED_RECIPES:
            _, qctx = _quantize(recipe, T)
            qctx.q, qctx.query_index = q, qidx
            name = recipe.split(":")[0]
            row[f"{name}_ms"] = 1e3 * best_time(lambda qctx=qctx: qctx.layer.attend(qctx), repeats)
            row[f"{name}_bytes_per_token"] = qctx.layer.nbytes() / T
        rows.append(row)
        names = ["full"] + [r.split(":")[0] for r in QUANT_SPEED_RECIPES]
        cells = [f"{n} {row[n + '_ms']:7.3f} ms ({row[n + '_bytes_per_token']:.0f} B/tok)" for n in names]
        print(f"decode    T={T:6d}  " + "  ".join(cells))
    return rows


def end_to_end(
    model_name: str, lengths: list[int], steps: int, budget_fraction: float
) -> list[dict[str, Any]]:
    from longlab.engine.stream import Stream
    from longlab.models import load_model
    from longlab.tasks import essay_sentences

    model, tok = load_model(model_name)
    _, sentences = essay_sentences()
    text = " ".join(sentences * 20)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = []
    for T in lengths:
        base = Stream(model, LonglabCache("full"), 1)
        start = time.perf_counter()
        logits = base.feed([ids[:T]], chunk_size=1024, compress="none")
        prefill_s = time.perf_counter() - start
        full_bytes = base.cache.full_nbytes()
        pm_budget = full_bytes * budget_fraction / 2**20
        for recipe in ("full", "kivi2", "kivi4", f"pmkvq:budget_mb={pm_budget:.3f}"):
            stream = base.fork(recipe)
            token = int(logits.argmax(-1))
            start = time.perf_counter()
            out = stream.feed([[token]], compress="none")  # first decode step: the quant policy converts here
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(steps):
                out = stream.feed([[int(out.argmax(-1))]], compress="none")
            step_s = (time.perf_counter() - start) / steps
            kv = stream.cache.nbytes()
            row = {
                "recipe": recipe, "T": T, "prefill_s": prefill_s, "first_step_s": first_s,
                "decode_ms_per_token": 1e3 * step_s, "kv_bytes": kv,
                "kv_fraction_of_fp32": kv / stream.cache.full_nbytes(),
            }  # fmt: skip
            rows.append(row)
            print(
                f"e2e       T={T:6d}  {recipe:26s} first step {first_s:6.2f} s"
                f"  decode {row['decode_ms_per_token']:7.1f} ms/token"
                f"  KV {kv / 2**20:7.2f} MiB ({row['kv_fraction_of_fp32']:.3f} of fp32)"
            )
    return rows


def quant_speed_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DOC_QUANT_SPEED.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="layer-level context lengths")
    parser.add_argument("--e2e-lengths", default="1024,2048", help="end-to-end context lengths")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps end to end")
    parser.add_argument("--budget-fraction", type=float, default=0.25, help="PM-KVQ budget, fraction of fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is steadier on a busy machine)"
    )
    parser.add_argument("--quick", action="store_true", help="layer level only, lengths 1024,4096")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_quant_speed.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [1024, 4096] if args.quick else [int(x) for x in args.lengths.split(",")]
    result: dict[str, Any] = {
        "hardware": hardware(),
        "shapes": {"H": H, "H_kv": H_KV, "D": D},
        "args": vars(args),
    }
    with torch.inference_mode():
        result["quantize"] = quantize_cost(lengths, args.repeats)
        result["decode_attention"] = decode_attention(lengths, args.repeats)
        if not args.quick:
            e2e = [int(x) for x in args.e2e_lengths.split(",") if x]
            result["end_to_end"] = end_to_end(args.model, e2e, args.steps, args.budget_fraction)
    result["hardware"]["loadavg_end"] = os.getloadavg()
    print(f"wrote {write_json(args.out, result)}")
    return 0


def _run_quant_speed() -> object:
    raise SystemExit(quant_speed_main())


# ---- quant-steps (was bench/kv.py quant-steps) ----------------------------------------

DOC_QUANT_STEPS = """
KV bytes step by step (after the context, after the question, then 6 greedy steps) for KV-quant recipes.

PM-KVQ shrinks its bit width once per append, so its memory right after a one-append context differs from
its memory while decoding; this prints both for each recipe on sample 0 of a task (one thread).

    bench/heavy.sh .venv/bin/python bench/kv.py quant-steps --length 2048 \
        --recipes kivi2,kivi4,pmkvq:budget_mb=11.71 --out bench/results/kv_quant_2k/kv_bytes_per_step.json
""".lstrip("\n")

def quant_steps_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_QUANT_STEPS.splitlines()[0])
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


def _run_quant_steps() -> object:
    quant_steps_main()


# ---- pyramidkv-fidelity (was bench/kv.py pyramidkv-fidelity) ----------------------------------------

DOC_PYRAMIDKV_FIDELITY = """
PyramidKV fidelity: longlab's kept sets against the official selection, layer by layer.

The reference below is written here from the behaviour of the official code (KVCache-Factory,
``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster.update_kv``, with K/V repeated to the query heads
before it as its ``llama_model.py`` does, run with ``window_size=8, kernel_size=7, pooling=maxpool,
beta=20`` as its ``run_longbench.py``): per-layer capacity from ``max_capacity_prompt``, the last W queries'
attention (additive causal mask, fp32 softmax cast back to the query dtype) summed over the window rows,
max-pooled over the prefix, ``topk`` of the prefix plus the window. Both run on the same random tensors
(fresh ones per layer); for each layer and head we report |A ∩ B| / |A ∪ B| (Jaccard) of the kept
positions and both kept counts. Two layouts: MHA (``pyramidkv:budget=C``, the default ``gqa=mean``) and
GQA (``pyramidkv:budget=C,gqa=query``, one set per query head, as the official code keeps).

    PYTHONPATH=src python bench/kv.py pyramidkv-fidelity            # 32 layers, T=1024, budgets 64 and 128
    PYTHONPATH=src python bench/kv.py pyramidkv-fidelity --dtype bfloat16
""".lstrip("\n")

def official_kept(q, k, capacity, window, layer_idx, num_layers, beta=20, kernel=7):
    """Kept positions per (row, query head) under the official rule. q [B, H, T, D], k [B, H_kv, T, D]."""
    B, H, T, D = q.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)  # the official code repeats K/V before selecting
    rest = capacity - window
    low = rest // beta
    high = 2 * rest - low
    if high >= T - window:
        high = T - window
        low = 2 * rest - high
    steps = (high - low) // (num_layers - 1)
    layer_capacity = high - layer_idx * steps
    if T < capacity:
        return [[set(range(T)) for _ in range(H)] for _ in range(B)]
    n_top = rest if T < 2 * rest else layer_capacity
    logits = q[..., -window:, :] @ k.transpose(2, 3) / math.sqrt(D)  # [B, H, W, T]
    causal = torch.full((window, window), torch.finfo(logits.dtype).min)
    causal = causal.triu(1)  # 0 on and below the diagonal
    logits[..., -window:] = logits[..., -window:] + causal
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    scores = probs[..., : T - window].sum(dim=-2)  # [B, H, T - W]
    scores = F.max_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    top = scores.topk(n_top, dim=-1).indices
    recent = set(range(T - window, T))
    return [[set(top[b, h].tolist()) | recent for h in range(H)] for b in range(B)]


def compare(args, heads: int, kv_heads: int, budget: int, extra: str) -> list[dict]:
    rows = []
    dtype = getattr(torch, args.dtype)
    for layer in range(args.layers):
        g = torch.Generator().manual_seed(args.seed * 100_003 + layer)
        T, D = args.length, args.head_dim
        q = torch.randn(1, heads, T, D, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, T, D, generator=g).to(dtype)
        v = torch.randn(1, kv_heads, T, D, generator=g).to(dtype)
        want = official_kept(q, k, budget, 8, layer, args.layers)
        spec = f"pyramidkv:budget={budget}{extra}"
        got = kept_indices(spec, q, k, v, layer_idx=layer, num_layers=args.layers)
        got = [[set(t.tolist()) for t in row] for row in got]
        if len(got[0]) != len(want[0]):
            raise SystemExit(f"{spec}: {len(got[0])} head sets, the official code keeps {len(want[0])}")
        jac = [len(a & b) / len(a | b) for a, b in zip(want[0], got[0])]
        rows.append({
            "layer": layer,
            "kept_official": len(want[0][0]),
            "kept_longlab": len(got[0][0]),
            "jaccard_mean": sum(jac) / len(jac),
            "jaccard_min": min(jac),
        })
    return rows


def pyramidkv_fidelity_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_PYRAMIDKV_FIDELITY.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--gqa-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default="mha,gqa", help="mha and/or gqa (gqa runs gqa=query)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/pyramidkv_fidelity.json"))
    args = ap.parse_args()
    if not (2 <= args.layers <= 128 and 64 <= args.length <= 16384 and args.heads % args.gqa_kv_heads == 0):
        raise SystemExit(
            "need 2 <= --layers <= 128, 64 <= --length <= 16384, --heads a multiple of --gqa-kv-heads"
        )
    wanted = set(args.layouts.split(","))
    if not wanted <= {"mha", "gqa"}:
        raise SystemExit(f"--layouts takes mha and/or gqa, got {args.layouts!r}")
    torch.set_num_threads(1)
    result = {"hardware": hardware(), "args": vars(args), "runs": []}
    layouts = (("mha", args.heads, args.heads, ""), ("gqa", args.heads, args.gqa_kv_heads, ",gqa=query"))
    for budget in (int(b) for b in args.budgets.split(",")):
        for name, heads, kv_heads, extra in (lay for lay in layouts if lay[0] in wanted):
            rows = compare(args, heads, kv_heads, budget, extra)
            result["runs"].append({"layout": name, "heads": heads, "kv_heads": kv_heads, "budget": budget,
                                   "layers": rows})
            print(f"\n{name} H={heads} H_kv={kv_heads} budget={budget} ({args.dtype}, T={args.length})")
            print("layer  kept(official)  kept(longlab)  jaccard mean  jaccard min")
            for r in rows:
                print(f"{r['layer']:5d}  {r['kept_official']:14d}  {r['kept_longlab']:13d}  "
                      f"{r['jaccard_mean']:12.4f}  {r['jaccard_min']:11.4f}")
            worst = min(r["jaccard_min"] for r in rows)
            same = all(r["kept_official"] == r["kept_longlab"] for r in rows)
            print(f"worst layer/head Jaccard {worst:.4f}; kept counts equal on every layer: {same}")
    print("wrote", write_json(args.out, result))


def _run_pyramidkv_fidelity() -> object:
    pyramidkv_fidelity_main()


# ---- indexmem-pairs (was bench/pairs.py) ----------------------------------------

DOC_INDEXMEM_PAIRS = """
IndexMem against SnapKV at equal ratio, from a ``longlab eval`` store (issue 10, item 6).

    .venv/bin/python bench/kv.py indexmem-pairs runs/indexmem/results.sqlite bench/results/indexmem_24

Writes ``rows.csv`` (every scored row: recipe, task, length, sample, score, prediction, timings, KV
bytes) and ``pairs.json``: per recipe, task and length the mean score with its 95% interval
(Wilson for pass/fail cells, percentile bootstrap for graded ones, :func:`score_estimate`); per recipe
and length the average over the tasks with a stratified bootstrap interval; and every
``indexmem@r`` − ``snapkv@r`` difference (and ``indexmem@r`` − ``indexmem@r:memory=false``) as a paired
stratified bootstrap on the same samples (:func:`stratified_difference`, 10,000 resamples, seed 0),
with the count of samples better / worse and an exact two-sided sign test on them. The newest row per
(recipe, task, length, sample) counts. Prints a markdown table.
""".lstrip("\n")

TASKS = ("niah_single_1", "niah_multikey_1", "vt")


def sign_test(up: int, down: int) -> float:
    """Exact two-sided binomial sign test on ``up`` better and ``down`` worse samples (ties dropped)."""
    n = up + down
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(up, down) + 1)) / 2**n)


def indexmem_pairs_main(db: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    cols = ("recipe", "task", "length", "sample_id", "score", "prediction", "answers", "prefill_s",
            "compress_s", "decode_s", "kv_bytes_after", "created_at")
    rows = conn.execute(f"select {', '.join(cols)} from results order by created_at, id").fetchall()
    newest = {(r[0], r[1], r[2], r[3]): r for r in rows}  # later rows replace earlier ones
    with open(out / "rows.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for key in sorted(newest):
            w.writerow(newest[key])
    S = {k: float(r[4]) for k, r in newest.items()}
    recipes = sorted({k[0] for k in S})
    lengths = sorted({k[2] for k in S})

    def ids(recipe: str, task: str, length: int) -> set[str]:
        return {k[3] for k in S if k[:3] == (recipe, task, length)}

    cells, avgs, diffs = {}, {}, []
    for r in recipes:
        for n in lengths:
            if not any(ids(r, t, n) for t in TASKS):
                continue
            strata = []
            for t in TASKS:
                vals = [S[(r, t, n, i)] for i in sorted(ids(r, t, n))]
                if vals:
                    e = score_estimate(vals)
                    cells[f"{r}|{t}|{n}"] = [100 * e.mean, 100 * e.low, 100 * e.high, e.n, e.method]
                    strata.append(vals)
            if len(strata) == len(TASKS):
                e = stratified_estimate(strata)
                avgs[f"{r}|{n}"] = [100 * e.mean, 100 * e.low, 100 * e.high, e.n]
    pairs = []
    for r in recipes:
        if r.startswith("indexmem@"):
            ratio = r.split("@", 1)[1].split(":", 1)[0]
            pairs.append((f"snapkv@{ratio}", r))
            if r.endswith(":memory=false"):
                pairs.append((r, f"indexmem@{ratio}"))
    for b, m in pairs:
        if b not in recipes or m not in recipes:
            continue
        for n in lengths:
            common = {t: sorted(ids(b, t, n) & ids(m, t, n)) for t in TASKS}
            if not all(common.values()):
                continue
            d = stratified_difference(
                [([S[(m, t, n, i)] for i in common[t]], [S[(b, t, n, i)] for i in common[t]]) for t in TASKS]
            )
            delta = [S[(m, t, n, i)] - S[(b, t, n, i)] for t in TASKS for i in common[t]]
            up, down = sum(x > 0 for x in delta), sum(x < 0 for x in delta)
            diffs.append({"length": n, "baseline": b, "method": m, "n": d.n, "significant": d.significant,
                          "better": up, "worse": down, "sign_test_p": sign_test(up, down),
                          "diff": [100 * d.mean, 100 * d.low, 100 * d.high]})
    json.dump({"source": db, "tasks": TASKS, "cells": cells, "averages": avgs, "differences": diffs},
              open(out / "pairs.json", "w"), indent=1)

    def fmt(v: list) -> str:
        return f"{v[0]:.1f} [{v[1]:.1f}, {v[2]:.1f}]"

    for n in lengths:
        print(f"\n### {n} tokens\n")
        print("| recipe | " + " | ".join(TASKS) + " | avg over tasks |")
        print("|---|" + "---:|" * (len(TASKS) + 1))
        for r in recipes:
            if f"{r}|{n}" in avgs:
                cs = [fmt(cells[f"{r}|{t}|{n}"]) + f" (n={cells[f'{r}|{t}|{n}'][3]})" for t in TASKS]
                avg = avgs[f"{r}|{n}"]
                print(f"| `{r}` | " + " | ".join(cs) + f" | {fmt(avg)} (n={avg[3]}) |")
        print("\n| baseline | method | method − baseline [paired 95% CI] | better / worse | sign test p |")
        print("|---|---|---:|---:|---:|")
        for d in diffs:
            if d["length"] == n:
                sig = "" if d["significant"] else " n.s."
                print(f"| `{d['baseline']}` | `{d['method']}` | {fmt(d['diff'])}{sig} (n={d['n']}) "
                      f"| {d['better']} / {d['worse']} | {d['sign_test_p']:.3g} |")


def _run_indexmem_pairs() -> object:
    ap = argparse.ArgumentParser(description=DOC_INDEXMEM_PAIRS.split("\n\n")[0])
    ap.add_argument("db", metavar="STORE", help="a longlab eval store (directory, results.sqlite or .gz)")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="where rows.csv and pairs.json go")
    args = ap.parse_args()
    indexmem_pairs_main(args.db, args.out_dir)


# ---- eviction-pairs (the kv-eviction page's 2k paired differences) ----------------------------------

DOC_EVICTION_PAIRS = """
OBCache / ReST-KV against their baselines at 2k, from a ``longlab eval`` store (the kv-eviction page).

    .venv/bin/python bench/kv.py eviction-pairs bench/results/kv_eviction_2k \\
        bench/results/kv_eviction_2k/pairs.json

Per recipe, the average over the three tasks with a stratified bootstrap interval; every method against
its baseline at the same ratio (``snapkv@r`` vs ``snapkv-obcvk@r`` and ``restkv@r``; ``tova@0.9`` and
``h2o@0.9`` vs their ``-obcvk`` variants) and every recipe against ``full``, as a stratified paired bootstrap
on the same samples (:func:`stratified_difference`, seed 0) with the better / worse counts and an exact
two-sided sign test. The newest row per (recipe, task, sample) counts.
""".lstrip("\n")


def eviction_pairs_main(db: str, out: str) -> dict[str, Any]:
    rows, _ = read_store(db)  # insertion order: the newest row per (recipe, task, sample) counts
    S = {(r["recipe"], r["task"], r["sample_id"]): float(r["score"]) for r in rows if r["score"] is not None}

    def ids(recipe: str, task: str) -> set[str]:
        return {i for r, t, i in S if (r, t) == (recipe, task)}

    recipes = sorted({r for r, _, _ in S})
    res = {r: stratified_estimate([[S[(r, t, i)] for i in sorted(ids(r, t))] for t in TASKS])
           for r in recipes}
    pairs = [(f"snapkv@{x}", f"{m}@{x}") for x in (0.5, 0.75, 0.9) for m in ("snapkv-obcvk", "restkv")]
    pairs += [("tova@0.9", "tova-obcvk@0.9"), ("h2o@0.9", "h2o-obcvk@0.9")]
    pairs += [("full", r) for r in recipes if r != "full"]
    diffs = []
    for b, m in pairs:
        if b not in res or m not in res:
            continue
        common = {t: sorted(ids(b, t) & ids(m, t)) for t in TASKS}
        d = stratified_difference([([S[(m, t, i)] for i in common[t]], [S[(b, t, i)] for i in common[t]])
                                   for t in TASKS])
        delta = [S[(m, t, i)] - S[(b, t, i)] for t in TASKS for i in common[t]]
        up, down = sum(x > 0 for x in delta), sum(x < 0 for x in delta)
        diffs.append({"baseline": b, "method": m, "n": d.n, "significant": d.significant, "better": up,
                      "worse": down, "sign_test_p": sign_test(up, down),
                      "diff": [100 * d.mean, 100 * d.low, 100 * d.high]})
    result = {"recipes": {r: [100 * e.mean, 100 * e.low, 100 * e.high, e.n] for r, e in res.items()},
              "differences": diffs}
    write_json(out, result)
    return result


def _run_eviction_pairs() -> object:
    ap = argparse.ArgumentParser(description=DOC_EVICTION_PAIRS.split("\n\n")[0])
    ap.add_argument("db", metavar="STORE", help="a longlab eval store (directory, results.sqlite or .gz)")
    ap.add_argument("out", metavar="OUT.json", help="where pairs.json goes")
    args = ap.parse_args()
    eviction_pairs_main(args.db, args.out)


SUBCOMMANDS = {
    "memory": _run_memory,
    "overhead": _run_overhead,
    "quant-speed": _run_quant_speed,
    "quant-steps": _run_quant_steps,
    "pyramidkv-fidelity": _run_pyramidkv_fidelity,
    "indexmem-pairs": _run_indexmem_pairs,
    "eviction-pairs": _run_eviction_pairs,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/kv.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
