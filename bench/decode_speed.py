"""Decode-step time vs context length: the longlab hook (several recipes) against transformers' own SDPA path
and transformers' ``QuantizedCache`` (quanto backend); and a kernel-only micro-benchmark (``--micro``).

    python bench/decode_speed.py                                  # 1k, 8k, 32k tokens; batch 1 and 4
    python bench/decode_speed.py --lengths 1024,8192 --batches 1 --rounds 3 --steps 16
    python bench/decode_speed.py --micro --lengths 8192,32768     # fused kernels vs a STREAM-like copy

Variant names: ``sdpa`` (below), ``hf-quanto4`` / ``hf-quanto2`` (transformers' ``QuantizedCache`` with the
optimum-quanto backend at 4 / 2 bits, its defaults otherwise: groups of 64, a 128-token full-precision
residual; it dequantises the whole cache on every step), and any longlab recipe. In recipes, ``{T8}`` is
replaced by an eighth of the context length (``quest:budget={T8}``: 1/8 of the pages) and ``{PMKVQ4}`` by
the ``budget_mb`` that holds PM-KVQ's code words at 4 bits. ``--batch-recipes`` sets the variants of
batches above 1 (all variants' caches are alive at once: at 32k x 4 rows the full ones do not all fit).

For each context length a random-token context is prefilled **once** through the longlab hook, in
``--chunk-size`` chunks, with every entry kept and the last chunk recorded
(:class:`longlab.hook.ChunkRecorder`). Each variant then gets its own copy of that cache:

- ``sdpa`` — the reference: a ``transformers.DynamicCache`` holding the same keys/values, decoded with
  ``attn_implementation="sdpa"`` (the model's own path, its cache concatenating on every step);
- every recipe of ``--recipes`` (default ``full``, two eviction recipes, one quantized recipe) — a fork of
  the longlab cache whose compression is replayed on the recorded chunk, as if prefilled with that
  recipe and ``compress="end"``; quantized recipes convert the layers there too.

For batch ``B > 1`` every cache's row is repeated ``B`` times (decode cost does not depend on what the
rows hold). Decoding is greedy, one token per forward, ``attention_mask`` of ones (as ``generate``
passes it). Rounds are interleaved: in each round every variant decodes ``--steps`` tokens (the order
rotates from round to round); the figure is the median over rounds of each round's median step time,
so a burst of load on the shared machine hits every variant alike. The process CPU time of each step
is recorded beside the wall time (``cpu_ms_per_token``): on a machine shared with other jobs it is
the steadier of the two (with one thread it excludes time spent waiting for a core). The cache keeps
growing across rounds (``rounds * steps`` tokens, small next to the context).

``--synthetic`` skips the prefill: every layer holds random keys/values (positions 0 .. T-1) and quant
recipes convert the layers on their warm-up steps. Decode time does not depend on the values (the same
kernels read the same number of bytes; Quest reads the same number of pages), so this measures the same
step in minutes instead of a 32k prefill's half hour; eviction recipes are refused (their choice needs
the prefill's attention).

Memory: every variant's cache is alive at once (the reference's ``torch.cat`` briefly doubles its
own); at 32k tokens SmolLM2's full cache is ~1.4 GiB per batch row in fp32.

Writes ``bench/results/decode_speed.json`` (hardware header with the load average before and after, and
``uptime`` before and after) and ``bench/results/decode_speed.png``, and prints the table with the ratio of
each variant to ``sdpa`` and to ``full``.

``--micro`` (kernel only, SmolLM2's shapes: 9 query heads, 3 KV heads, D = 64, batch 1, one thread by
default): per round, a STREAM-like copy of 256 MiB (``b.copy_(a)``; bandwidth = 2 x bytes / time, as
STREAM counts) and, per length, the fused quantized decode kernel over 30 packed KIVI layers in turn (more
bytes than the caches hold), the PyTorch fallback (dequantise in chunks) on the same layers, SDPA over
30 fp32 layers, and the paged kernel vs the PyTorch gather over 1/8 of the pages. Achieved bytes/s = bytes
the kernel must read (codes, scales, offsets, index, full-precision residual) / time; the bytes bound is
bytes / copy bandwidth; efficiency = bound / time. Medians over rounds. Writes
``bench/results/decode_speed_micro.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import time
from typing import Any

import torch
from common import ROOT, hardware, write_json

from longlab import load_model
from longlab.cache import LonglabCache, LonglabLayer
from longlab.engine.stream import Stream
from longlab.hook import ATTN_NAME, ChunkRecorder, replay_compression
from longlab.recipe import LonglabError, Recipe, parse_recipe

REFERENCE = "sdpa"
FULL = "full"
DEFAULT_RECIPES = ("sdpa;full;kivi4;kivi4:fused=false;hf-quanto4;kivi2;hf-quanto2;pmkvq:budget_mb={PMKVQ4};"
                   "quest:budget={T8};quest:budget={T8},fused=false")
BATCH_RECIPES = "full;kivi4;kivi4:fused=false;hf-quanto4"
QUANTO = "hf-quanto"


def _context(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (length,), generator=g).tolist()


def _prefill(model: Any, ids: list[int], chunk_size: int) -> tuple[Stream, dict]:
    """The whole context in the cache, every entry kept; the last chunk's per-layer records."""
    recorder = ChunkRecorder()
    stream = Stream(model, LonglabCache(Recipe(kv=[recorder])), 1)
    stream.feed([ids], chunk_size, compress="end")
    stream.cache.recipe = parse_recipe(None)
    return stream, recorder.records


def _synthetic(model: Any, length: int, seed: int) -> tuple[Stream, dict]:
    """A stream whose cache holds ``length`` entries of random keys/values per layer (N(0, 1), positions
    0 .. length-1) without running the prefill: decode time does not depend on the values
    (``--synthetic``)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = LonglabCache(parse_recipe(None))
    g = torch.Generator().manual_seed(seed)
    for _ in range(cfg.num_hidden_layers):
        layer = LonglabLayer()
        layer.update(torch.randn(1, heads, length, head_dim, generator=g),
                     torch.randn(1, heads, length, head_dim, generator=g))
        cache.layers.append(layer)
    stream = Stream(model, cache, 1)
    stream.seen_mask = torch.ones(1, length, dtype=torch.bool)
    stream.next_pos = torch.tensor([length])
    return stream, {}


def _variant_cache(name: str, base: Stream, records: dict, batch: int) -> Any:
    """A fresh cache for one variant: a ``DynamicCache`` copy for the reference, a ``QuantizedCache`` filled
    with the same keys/values for ``hf-quanto*``, else a replayed fork."""
    if name == REFERENCE:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, layer in enumerate(base.cache.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)
    elif name.startswith(QUANTO):
        from transformers import QuantizedCache

        cache = QuantizedCache("quanto", base.model.config, nbits=int(name[len(QUANTO):]))
        for i, layer in enumerate(base.cache.layers):  # quantized on this first update (all of the context)
            k, v = layer.keys, layer.values
            if batch > 1:
                k, v = k.repeat_interleave(batch, 0), v.repeat_interleave(batch, 0)
            cache.update(k.contiguous(), v.contiguous(), i)
        return cache
    else:
        cache = base.fork(name).cache
        replay_compression(cache, records)
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    return cache


class _Runner:
    """One variant's decoding state: its cache, the next input token per row and the mask of ones."""

    def __init__(self, name: str, cache: Any, first: torch.Tensor, seen: int) -> None:
        self.name, self.cache = name, cache
        self.token = first  # [B, 1]
        self.seen = seen  # tokens in the stream so far (the attention mask's length)

    @torch.inference_mode()
    def steps(self, model: Any, n: int) -> list[tuple[float, float]]:
        """Decode ``n`` tokens; per step (wall seconds, process CPU seconds)."""
        plain = self.name == REFERENCE or self.name.startswith(QUANTO)  # transformers' own attention
        model.set_attn_implementation(REFERENCE if plain else ATTN_NAME)
        B = self.token.shape[0]
        times = []
        for _ in range(n):
            mask = torch.ones(B, self.seen + 1, dtype=torch.long)
            start, cpu = time.perf_counter(), time.process_time()
            out = model(input_ids=self.token, attention_mask=mask, cache=self.cache, use_cache=True,
                        logits_to_keep=1)
            self.token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append((time.perf_counter() - start, time.process_time() - cpu))
            self.seen += 1
        return times


def _kv_bytes(cache: Any) -> int:
    if isinstance(cache, LonglabCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "_quantized_keys", None),
                  getattr(layer, "_quantized_values", None)):
            if isinstance(t, torch.Tensor) and not hasattr(t, "_data"):
                total += t.numel() * t.element_size()
            elif t is not None:  # a quanto QTensor: its packed data, scales and shifts
                total += sum(x.numel() * x.element_size() for x in _qtensor_parts(t))
    return total


def _qtensor_parts(t: Any) -> list[torch.Tensor]:
    parts = []
    for name in ("_data", "_scale", "_shift"):
        x = getattr(t, name, None)
        if isinstance(x, torch.Tensor) and hasattr(x, "_data"):  # packed data is itself a wrapper
            parts.extend(_qtensor_parts(x))
        elif isinstance(x, torch.Tensor):
            parts.append(x)
    return parts


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def expand_recipe(recipe: str, length: int, model: Any) -> str:
    """``{T8}`` -> length // 8; ``{PMKVQ4}`` -> the budget_mb that holds PM-KVQ's code words at 4 bits."""
    if "{PMKVQ4}" in recipe:
        from longlab.quant.pmkvq import MIB, code_bytes

        cfg = model.config
        heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_layer = code_bytes(length + 256, 4, heads, head_dim)  # room for the decoded tokens
        recipe = recipe.replace("{PMKVQ4}", f"{per_layer * cfg.num_hidden_layers * 1.02 / MIB:.2f}")
    return recipe.replace("{T8}", str(max(1, length // 8)))


def measure(model: Any, vocab: int, length: int, batches: list[int], variants: list[str], args,
            batch_variants: list[str] | None = None) -> list[dict]:
    start = time.perf_counter()
    if args.synthetic:
        base, records = _synthetic(model, length, args.seed)
    else:
        base, records = _prefill(model, _context(vocab, length, args.seed), args.chunk_size)
    prefill_s = time.perf_counter() - start
    print(f"T={length}: prefill {prefill_s:.0f} s", flush=True)
    first = torch.tensor([[int(_context(vocab, 1, args.seed + 1)[0])]])
    rows = []
    for B in batches:
        runners = []
        names = variants if B == 1 or batch_variants is None else batch_variants
        for spec in names:
            name = expand_recipe(spec, length, model)
            runners.append(_Runner(name, _variant_cache(name, base, records, B), first.expand(B, 1), length))
            runners[-1].steps(model, 2)  # warm-up (a quantized layer converts its residual, PM-KVQ shrinks)
        uptime_before = _uptime()
        per_round: dict[str, list[float]] = {r.name: [] for r in runners}  # median wall time per round
        cpu_round: dict[str, list[float]] = {r.name: [] for r in runners}  # median CPU time per round
        all_steps: dict[str, list[float]] = {r.name: [] for r in runners}
        load_before = os.getloadavg()[0]
        for rnd in range(args.rounds):
            order = runners[rnd % len(runners):] + runners[: rnd % len(runners)]
            for runner in order:
                t = runner.steps(model, args.steps)
                per_round[runner.name].append(statistics.median(w for w, _ in t))
                cpu_round[runner.name].append(statistics.median(c for _, c in t))
                all_steps[runner.name].extend(w for w, _ in t)
        load_after = os.getloadavg()[0]
        uptime_after = _uptime()
        ref = statistics.median(per_round[REFERENCE]) if REFERENCE in per_round else None
        ref_cpu = statistics.median(cpu_round[REFERENCE]) if REFERENCE in cpu_round else None
        full = statistics.median(per_round[FULL]) if FULL in per_round else None
        full_cpu = statistics.median(cpu_round[FULL]) if FULL in cpu_round else None
        for runner in runners:
            ms = 1e3 * statistics.median(per_round[runner.name])
            cpu_ms = 1e3 * statistics.median(cpu_round[runner.name])
            row = {
                "length": length, "batch": B, "variant": runner.name, "ms_per_token": round(ms, 2),
                "rounds_ms": [round(1e3 * x, 2) for x in per_round[runner.name]],
                "steps_ms": [round(1e3 * x, 2) for x in all_steps[runner.name]],
                "ratio_to_sdpa": round(ms / (1e3 * ref), 3) if ref else None,
                "cpu_ms_per_token": round(cpu_ms, 2),
                "cpu_ratio_to_sdpa": round(cpu_ms / (1e3 * ref_cpu), 3) if ref_cpu else None,
                "ratio_to_full": round(ms / (1e3 * full), 3) if full else None,
                "cpu_ratio_to_full": round(cpu_ms / (1e3 * full_cpu), 3) if full_cpu else None,
                "ratios_to_full_by_round": ([round(a / b, 3) for a, b in zip(per_round[runner.name],
                                                                              per_round[FULL])]
                                            if full else None),
                "uptime": [uptime_before, uptime_after],
                "kv_bytes": _kv_bytes(runner.cache),
                "prefill_s": round(prefill_s, 1), "load_avg_1m": [load_before, load_after],
            }
            rows.append(row)
            ratio, rf = row["ratio_to_sdpa"] or 0.0, row["ratio_to_full"] or 0.0
            print(f"T={length:6d} B={B} {runner.name:40s} {ms:8.1f} ms/token  x{ratio:.3f} sdpa"
                  f"  x{rf:.3f} full"
                  f"  (CPU {cpu_ms:7.1f} ms)"
                  f"  rounds {row['rounds_ms']}  KV {row['kv_bytes'] / 2**20:7.1f} MiB"
                  f"  (load {load_before:.2f} -> {load_after:.2f})", flush=True)
        del runners
        gc.collect()
    return rows


def plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 7), squeeze=False, sharex=True)
    for col, B in enumerate(batches):
        top, bottom = axes[0][col], axes[1][col]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if r["batch"] == B and r["variant"] == variant]
            mine.sort(key=lambda r: r["length"])
            style = dict(color="black", linestyle="--") if variant == REFERENCE else {}
            x = [r["length"] for r in mine]
            top.plot(x, [r["ms_per_token"] for r in mine], marker="o", label=variant, **style)
            if variant != REFERENCE and all(r["ratio_to_sdpa"] for r in mine):
                bottom.plot(x, [r["ratio_to_sdpa"] for r in mine], marker="o", label=variant)
        bottom.axhline(1.0, color="black", linestyle="--", linewidth=1)
        bottom.axhspan(0.0, 1.05, color="green", alpha=0.06)
        top.set_title(f"decode step, batch {B}")
        top.set_ylabel("ms / token (median)")
        bottom.set_ylabel("time / sdpa time")
        bottom.set_xlabel("context tokens")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def replot(path: str) -> str | None:
    """Redraw the PNG next to a JSON result (``--replot``), e.g. after editing the plot."""
    import json

    return plot(json.loads(open(path).read())["rows"], os.path.splitext(path)[0] + ".png")


def _split_variants(text: str) -> list[str]:
    """Variants separated by ``;`` (recipes hold commas); a list without ``;`` is split on commas."""
    return [r.strip() for r in (text.split(";") if ";" in text else text.split(",")) if r.strip()]


def _check_variant(name: str) -> None:
    if name == REFERENCE:
        return
    if name.startswith(QUANTO):
        if name[len(QUANTO):] not in ("2", "4"):
            raise LonglabError(f"{name}: hf-quanto takes 2 or 4 bits (hf-quanto2, hf-quanto4)")
        return
    parse_recipe(name.replace("{T8}", "8").replace("{PMKVQ4}", "1"))  # fail before the prefill


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,8192,32768", help="context lengths, comma-separated")
    p.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help="variants separated by ';' (sdpa, hf-quanto4, hf-quanto2, longlab recipes)")
    p.add_argument("--batch-recipes", default=BATCH_RECIPES,
                   help="the variants of batches above 1 ('-': the same as --recipes)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro", action="store_true", help="the kernel-only micro-benchmark instead")
    p.add_argument("--synthetic", action="store_true",
                   help="random K/V instead of a prefill (decode time does not depend on the values); "
                        "quant and decode recipes only")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/decode_speed[_micro].json)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG of an existing --out JSON")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / ("bench/results/decode_speed_micro.json" if args.micro
                               else "bench/results/decode_speed.json"))
    if args.replot:
        print(f"wrote {replot(args.out)}")
        return 0
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        raise LonglabError(f"--lengths/--batches must be comma-separated integers, got {args.lengths!r}, "
                           f"{args.batches!r}") from None
    if min(lengths) < 2 or min(batches) < 1 or args.steps < 1 or args.rounds < 1:
        raise LonglabError("--lengths must be >= 2, --batches, --steps and --rounds >= 1")
    torch.set_num_threads(args.threads)
    if args.micro:
        from decode_speed_micro import micro

        result = micro(lengths, args.rounds)
        result["args"] = vars(args)
        write_json(args.out, result)
        print(f"wrote {args.out}")
        return 0
    variants = _split_variants(args.recipes)
    batch_variants = None if args.batch_recipes == "-" else _split_variants(args.batch_recipes)
    for name in variants + (batch_variants or []):
        _check_variant(name)
        if args.synthetic and not name.startswith(QUANTO) and name != REFERENCE:
            recipe = parse_recipe(name.replace("{T8}", "8").replace("{PMKVQ4}", "1"))
            if any(p.kind != "quant" and p.name != "full" for p in recipe.kv) or recipe.prefill is not None:
                raise LonglabError(f"--synthetic: {name} selects entries from the prefill's attention; "
                                   "measure it without --synthetic")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model(args.model)
    model.eval()
    header = hardware()
    header["uptime"] = _uptime()
    rows = []
    for length in lengths:
        rows.extend(measure(model, len(tokenizer), length, batches, variants, args, batch_variants))
        result = {"hardware": header, "load_avg_1m_end": os.getloadavg()[0], "args": vars(args), "rows": rows}
        write_json(args.out, result)  # after every length, so a long run keeps what it measured
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
