"""Decode-step time vs context length: the longlab hook (several recipes) against transformers' own SDPA path.

    python bench/decode_speed.py                                  # 1k, 8k, 32k tokens; batch 1 and 4
    python bench/decode_speed.py --lengths 1024,8192 --batches 1 --rounds 3 --steps 16

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

Memory: every variant's cache is alive at once (the reference's ``torch.cat`` briefly doubles its
own); at 32k tokens SmolLM2's full cache is ~1.4 GiB per batch row in fp32.

Writes ``bench/results/decode_speed.json`` (hardware header with the load average before and after) and
``bench/results/decode_speed.png``, and prints the table with the ratio of each variant to ``sdpa``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
from common import ROOT, hardware, write_json

from longlab import load_model
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.hook import ATTN_NAME, ChunkRecorder, replay_compression
from longlab.recipe import LonglabError, Recipe, parse_recipe

REFERENCE = "sdpa"
DEFAULT_RECIPES = "full,snapkv@0.75,streaming:budget=1024,kivi4"


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


def _variant_cache(name: str, base: Stream, records: dict, batch: int) -> Any:
    """A fresh cache for one variant: a ``DynamicCache`` copy for the reference, else a replayed fork."""
    if name == REFERENCE:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, layer in enumerate(base.cache.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)
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
        model.set_attn_implementation(REFERENCE if self.name == REFERENCE else ATTN_NAME)
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
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def measure(model: Any, vocab: int, length: int, batches: list[int], variants: list[str], args) -> list[dict]:
    start = time.perf_counter()
    base, records = _prefill(model, _context(vocab, length, args.seed), args.chunk_size)
    prefill_s = time.perf_counter() - start
    first = torch.tensor([[int(_context(vocab, 1, args.seed + 1)[0])]])
    rows = []
    for B in batches:
        runners = []
        for name in variants:
            runners.append(_Runner(name, _variant_cache(name, base, records, B), first.expand(B, 1), length))
            runners[-1].steps(model, 1)  # warm-up (a quantized layer converts its residual here)
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
        ref = statistics.median(per_round[REFERENCE]) if REFERENCE in per_round else None
        ref_cpu = statistics.median(cpu_round[REFERENCE]) if REFERENCE in cpu_round else None
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
                "kv_bytes": _kv_bytes(runner.cache),
                "prefill_s": round(prefill_s, 1), "load_avg_1m": [load_before, load_after],
            }
            rows.append(row)
            ratio, cpu_ratio = row["ratio_to_sdpa"] or 0.0, row["cpu_ratio_to_sdpa"] or 0.0
            print(f"T={length:6d} B={B} {runner.name:24s} {ms:8.1f} ms/token  x{ratio:.3f}"
                  f"  (CPU {cpu_ms:7.1f} ms x{cpu_ratio:.3f})"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,8192,32768", help="context lengths, comma-separated")
    p.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help=f"longlab recipes, comma-separated; '{REFERENCE}' is always added")
    p.add_argument("--steps", type=int, default=16, help="decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench/results/decode_speed.json"))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG of an existing --out JSON")
    args = p.parse_args(argv)
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
    recipes = [r for r in args.recipes.split(",") if r and r != REFERENCE]
    for r in recipes:
        parse_recipe(r)  # fail before the prefill
    variants = [REFERENCE, *recipes]
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model(args.model)
    model.eval()
    header = hardware()
    rows = []
    for length in lengths:
        rows.extend(measure(model, len(tokenizer), length, batches, variants, args))
        result = {"hardware": header, "load_avg_1m_end": os.getloadavg()[0], "args": vars(args), "rows": rows}
        write_json(args.out, result)  # after every length, so a long run keeps what it measured
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
