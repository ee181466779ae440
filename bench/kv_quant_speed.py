"""KV-cache quantization speed: quantize cost per token and decode-step time vs context length.

    python bench/kv_quant_speed.py                       # layer level + SmolLM2 end to end
    python bench/kv_quant_speed.py --quick               # layer level only, short lengths
    python bench/kv_quant_speed.py --lengths 1024,4096,16384 --e2e-lengths 1024,2048

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
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from common import ROOT, best_of, hardware, write_json

from longlab.attention import LayerContext, dense_attention
from longlab.cache import LonglabCache, LonglabLayer


def best_time(fn, repeats: int) -> float:
    """Best of ``repeats`` timed calls after one warm-up call."""
    return best_of(fn, repeats, warmup=True)[0]


H, H_KV, D = 9, 3, 64  # SmolLM2-135M heads
# PM-KVQ's budget never binds here: the layer is shifted 16 -> 8 -> 4 -> 2 by hand (its widest cost).
RECIPES = ("kivi2", "kivi4", "pmkvq:budget_mb=1000000")


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
        for recipe in RECIPES:
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
        for recipe in RECIPES:
            _, qctx = _quantize(recipe, T)
            qctx.q, qctx.query_index = q, qidx
            name = recipe.split(":")[0]
            row[f"{name}_ms"] = 1e3 * best_time(lambda qctx=qctx: qctx.layer.attend(qctx), repeats)
            row[f"{name}_bytes_per_token"] = qctx.layer.nbytes() / T
        rows.append(row)
        names = ["full"] + [r.split(":")[0] for r in RECIPES]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    raise SystemExit(main())
