"""Sparse prefill: one attention layer against dense (synthetic or captured q/k/v), q/k/v capture, executor
backends on a real model, per-sample ratios from a store, full-cache prefill time by chunk size.

Subcommands (``python bench/sparse_prefill.py SUB --help`` for each one's options):

- ``attention``: One attention layer, dense SDPA vs block-sparse prefill selectors: time, density, recall,
  output error.
- ``capture-qkv``: Capture real post-RoPE ``q, k, v`` of chosen attention layers on a long input, for
  ``bench/sparse_prefill.py attention --qkv``.
- ``backends``: Sparse-prefill wall time on a real model by executor backend, side by side (issue 16, item
  5).
- ``stats``: Per-sample prefill-time ratios and mask quality of sparse prefill recipes, from one
  results.sqlite.
- ``prefill-time``: Wall time of a full-cache prefill at one length, for each chunk size (best of
  ``--repeats``).
- ``ratios``: per-sample prefill-time ratios recipe / full of one results.sqlite, geometric mean with a
  bootstrap interval (the sparse-prefill page's ``prefill_ratios.json``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from common import best_of, hardware, read_store, run_subcommand, write_json
from safetensors.torch import save_file

from longlab import generate
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.eval.stats import bootstrap_ci
from longlab.kv.base import KVPolicy
from longlab.models import load_model
from longlab.prompt import encode_prompts
from longlab.recipe import Recipe
from longlab.sparse import block_sparse_attention, make_selector, quality_metrics
from longlab.sparse.synthetic import synthetic_qkv
from longlab.tasks import generate_samples as make_samples

# ---- attention (was bench/sparse_prefill.py attention) ----------------------------------------

DOC_ATTENTION = """
One attention layer, dense SDPA vs block-sparse prefill selectors: time, density, recall, output error.

    python bench/sparse_prefill.py attention --quick
    python bench/sparse_prefill.py attention --lengths 16384,32768 \
        --out bench/results/prefill_attention_32k.json
    python bench/sparse_prefill.py attention --qkv captured.safetensors --lengths 8192

Head shapes: SmolLM2-135M (H=9, H_kv=3, D=64) and Gemma3-270M (H=4, H_kv=1, D=256). Inputs are synthetic
RoPE'd q/k/v with a sink, a local band and a few vertical lines (``longlab.sparse.synthetic``), or captured
post-RoPE tensors from ``--qkv`` (safetensors with ``q``, ``k``, ``v`` or ``<layer>.q`` ... keys, shaped
``[B, H, T, D]`` or ``[H, T, D]``; each length uses the first T positions).

Per (shape, T): dense causal SDPA is timed; for every selector config the selection and the flex
block-sparse execution are timed (best of ``--repeats``, after a warm-up call that compiles), then
density, recall and relative output error (of the flex output) are measured on ``--rows`` sampled query
rows. ``speedup = dense_s / (select_s + exec_s)``. Writes JSON (``--out``), a PNG of speedup vs recall,
and prints a table.

Block size: ``--block 128`` (default) runs every selector at 128x128 blocks, because the CPU flex kernel
uses the block size as its tile size and smaller tiles ran ~2x slower per computed block here;
``--block paper`` keeps each selector's own default (64x64, 64x32, ...).
""".lstrip("\n")

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # name -> (H, H_kv, D)


CONFIGS: dict[str, list[dict[str, Any]]] = {
    "ashape": [{"n_sink": 128, "n_local": 2048}],
    "vslash": [{}],
    "blocktopk": [{"top_k": 50}],  # MInference: top-100 blocks of 64 tokens
    "flexprefill": [{}],
    "xattention": [{}],
    "prism": [{}],
    "sale": [{}],
}


SWEEP: dict[str, list[dict[str, Any]]] = {
    "ashape": [{"n_sink": 128, "n_local": 1024}, {"n_sink": 128, "n_local": 4096}],
    "vslash": [{"vertical_size": 1000, "slash_size": 6096}, {"vertical_size": 30, "slash_size": 800}],
    "blocktopk": [{"top_k": 25}, {"top_k": 100}],
    "flexprefill": [{"gamma": 0.95}, {"gamma": 0.8}],
    "xattention": [{"tau": 0.95}, {"tau": 0.8}],
    "prism": [{"thr_high": 0.98, "thr_low": 0.98}, {"thr_high": 0.9, "thr_low": 0.9}],
    "sale": [{"tau": 0.001}, {"tau": 0.016}],
}


def _load_qkv(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]]:
    from safetensors import safe_open

    groups: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():
            prefix, _, leaf = key.rpartition(".")
            if leaf in ("q", "k", "v"):
                groups.setdefault(prefix or "qkv", {})[leaf] = f.get_tensor(key)
    out = {}
    for name, g in groups.items():
        if set(g) != {"q", "k", "v"}:
            continue
        q, k, v = (x if x.dim() == 4 else x.unsqueeze(0) for x in (g["q"], g["k"], g["v"]))
        scale = meta.get(f"{name}.scaling", meta.get("scaling"))
        out[name] = (q.float(), k.float(), v.float(), float(scale) if scale is not None else None)
    if not out:
        raise SystemExit(f"{path}: no complete q/k/v group found (keys 'q','k','v' or '<prefix>.q' ...)")
    return out


def _parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, value = item.partition("=")
        name, _, field = key.partition(".")
        if not field:
            raise SystemExit(f"--set expects selector.field=value, got {item!r}")
        out.setdefault(name, {})[field] = json.loads(value)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    names = list(CONFIGS) if args.selectors == "all" else args.selectors.split(",")
    overrides = _parse_set(args.set)
    configs: list[tuple[str, dict[str, Any]]] = []
    for name in names:
        for kw in CONFIGS[name] + (SWEEP[name] if args.sweep else []):
            kw = {**kw, **overrides.get(name, {})}
            if args.block != "paper":
                kw = {"bq": int(args.block), "bk": int(args.block), **kw}
            configs.append((name, kw))
    captured = _load_qkv(args.qkv) if args.qkv else None
    shapes = list(captured) if captured else args.models.split(",")
    if captured and args.groups:
        wanted = args.groups.split(",")
        shapes = [name for name in shapes if any(w in name for w in wanted)]
        if not shapes:
            raise SystemExit(f"--groups {args.groups}: none of {', '.join(captured)} matches")
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for T in lengths:
            if captured:
                qf, kf, vf, scale = captured[shape]
                if kf.shape[2] < T:
                    print(f"skip {shape} T={T}: capture has {kf.shape[2]} positions", file=sys.stderr)
                    continue
                q, k, v = (x[:, :, :T].contiguous() for x in (qf, kf, vf))
            else:
                H, H_kv, D = SHAPES[shape]
                q, k, v = synthetic_qkv(B=1, H=H, H_kv=H_kv, T=T, D=D, seed=args.seed)
                scale = None
            H, H_kv, D = q.shape[1], k.shape[1], q.shape[3]
            scaling = scale if scale is not None else 1.0 / math.sqrt(D)
            base = {"shape": shape, "H": H, "H_kv": H_kv, "D": D, "T": T}

            dense = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=scaling,
                                      enable_gqa=H != H_kv)
            dense_s, _ = best_of(dense, args.repeats)
            rows.append({**base, "method": "dense-sdpa", "config": "sdpa(is_causal=True)", "density": 1.0,
                         "recall": 1.0, "min_head_recall": 1.0, "rel_error": 0.0, "select_s": 0.0,
                         "exec_s": dense_s, "total_s": dense_s, "dense_s": dense_s, "speedup": 1.0})
            print(f"[{shape} T={T}] dense sdpa {dense_s * 1e3:.0f} ms", file=sys.stderr, flush=True)
            for name, kw in configs:
                sel = make_selector(name, **kw)
                select_s, mask = best_of(functools.partial(sel.select, q, k, scaling), args.repeats)
                execute = functools.partial(block_sparse_attention, q, k, v, mask, scaling, backend="flex")
                t0 = time.perf_counter()
                execute()  # warm-up: compiles on the first call for this shape
                warm_s = time.perf_counter() - t0
                exec_s, out = best_of(execute, args.repeats)
                qm = quality_metrics(q, k, v, mask, scaling, n_sample_rows=args.rows, out=out)
                total = select_s + exec_s
                row = {**base, "method": name, "config": repr(sel), **qm, "select_s": select_s,
                       "exec_s": exec_s, "total_s": total, "dense_s": dense_s, "speedup": dense_s / total,
                       "exec_speedup": dense_s / exec_s, "first_call_s": warm_s}
                rows.append(row)
                print(f"[{shape} T={T}] {row['config']}: density {qm['density']:.3f} "
                      f"recall {qm['recall']:.4f} select {select_s * 1e3:.0f} ms exec {exec_s * 1e3:.0f} ms "
                      f"speedup {row['speedup']:.2f}x", file=sys.stderr, flush=True)
    source = f"captured:{args.qkv}" if args.qkv else f"synthetic(seed={args.seed})"
    return {"meta": {**hardware(), "source": source, "block": args.block, "repeats": args.repeats,
                     "rows_sampled": args.rows, "lengths": lengths},
            "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    m = result["meta"]
    print(f"# prefill attention, {m['source']}, torch {m['torch']}, {m['threads']} threads, {m['cpu']}, "
          f"block={m['block']}, best of {m['repeats']}")
    head = (f"{'shape':8s} {'T':>6s} {'method':12s} {'density':>7s} {'recall':>7s} {'min_rec':>7s} "
            f"{'rel_err':>7s} {'sel_ms':>8s} {'exec_ms':>8s} {'dense_ms':>8s} {'speedup':>7s}  config")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        cfg = "" if r["method"] == "dense-sdpa" else r["config"].split("(", 1)[1].rstrip(")")
        print(f"{r['shape']:8s} {r['T']:6d} {r['method']:12s} {r['density']:7.3f} {r['recall']:7.4f} "
              f"{r['min_head_recall']:7.4f} {r['rel_error']:7.4f} {r['select_s'] * 1e3:8.0f} "
              f"{r['exec_s'] * 1e3:8.0f} {r['dense_s'] * 1e3:8.0f} {r['speedup']:6.2f}x  {cfg}")
    winners = [r for r in result["rows"] if r["method"] != "dense-sdpa" and r["speedup"] >= 2.0
               and r["recall"] >= 0.95]
    print("\n>= 2x speedup at >= 95% recall: " + (", ".join(f"{r['method']}@{r['shape']}/T={r['T']}"
                                                           for r in winners) or "none"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "dense-sdpa"]
    shapes = sorted({r["shape"] for r in rows})
    if not shapes:
        return
    methods = sorted({r["method"] for r in rows})
    lengths = sorted({r["T"] for r in rows})
    markers = dict(zip(methods, "osD^v<>ph*"))
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for r in (r for r in rows if r["shape"] == shape):
            c = cmap(lengths.index(r["T"]) / max(1, len(lengths) - 1))
            ax.scatter(r["recall"], r["speedup"], marker=markers[r["method"]], color=c, s=45, edgecolor="k",
                       linewidths=0.4)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(2.0, color="red", lw=0.8, ls="--")
        ax.axvline(0.95, color="red", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("attention recall (sampled rows)")
        ax.set_ylabel("speedup vs dense SDPA (select + exec)")
        ax.set_title(f"{shape}")
    handles = [plt.Line2D([], [], marker=markers[m], ls="", color="grey", label=m) for m in methods]
    handles += [plt.Line2D([], [], marker="o", ls="", color=cmap(i / max(1, len(lengths) - 1)),
                           label=f"T={T}") for i, T in enumerate(lengths)]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attention_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=DOC_ATTENTION.split("\n", 1)[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--quick", action="store_true", help="lengths 2048,4096 (a few minutes on 2 cores)")
    p.add_argument("--models", default="smollm2,gemma3", help=f"head shapes: {','.join(SHAPES)}")
    p.add_argument("--selectors", default="all")
    p.add_argument("--sweep", action="store_true", help="add tighter / looser configs per selector")
    p.add_argument("--set", action="append", default=[], metavar="SEL.FIELD=VALUE",
                   help="override a selector field (JSON value), e.g. --set xattention.tau=0.95")
    p.add_argument("--block", default="128", help="block size for every selector, or 'paper'")
    p.add_argument("--qkv", default=None, help="safetensors file of captured post-RoPE q, k, v")
    p.add_argument("--groups", default=None, help="with --qkv: groups whose name contains one of these")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rows", type=int, default=64, help="sampled query rows for recall / error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/prefill_attention.json")
    p.add_argument("--png", default=None, help="default: --out with .png")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths = "2048,4096"
    result = run(args)
    out = write_json(args.out, result)
    plot(result, Path(args.png) if args.png else out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {out} and {Path(args.png) if args.png else out.with_suffix('.png')}")


def _run_attention() -> object:
    attention_main()


# ---- capture-qkv (was bench/sparse_prefill.py capture-qkv) ----------------------------------------

DOC_CAPTURE_QKV = """
Capture real post-RoPE ``q, k, v`` of chosen attention layers on a long input, for
``bench/sparse_prefill.py attention --qkv``.

    python bench/sparse_prefill.py capture-qkv --model gemma3-270m --length 32768 \
        --out runs/qkv/gemma3_32k.safetensors
    python bench/sparse_prefill.py capture-qkv --model smollm2-135m --length 8192 \
        --out runs/qkv/smollm2_8k.safetensors

The input is a RULER ``niah_single_2`` prompt (essay haystack, one needle, the question at the end) of
``--length`` tokens. It is prefilled in chunks through a :class:`longlab.LonglabCache` with the
empty recipe plus an observer that records each chunk's queries, so memory stays near the size of the
captured tensors. After the prefill, the layer's cache holds every key and value (non-sliding layers
keep everything under the empty recipe). Default layers: every global-attention layer for models with
sliding-window layers (Gemma3), else the first, middle and last layer. Keys are ``<model>.L<i>.q``
etc., shaped ``[1, H, T, D]`` / ``[1, H_kv, T, D]`` in fp32; the metadata holds each group's scaling.
""".lstrip("\n")

@dataclass
class QueryRecorder(KVPolicy):
    """Observer: appends every forward's post-RoPE queries ``[B, H, T_q, D]`` of the chosen layers."""

    needs_observe = True
    layers: tuple[int, ...] = ()
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    def observe(self, ctx) -> None:
        if ctx.layer_idx in self.layers:
            self.queries.setdefault(ctx.layer_idx, []).append(ctx.q.float().clone())
            self.scaling[ctx.layer_idx] = float(ctx.scaling)


def default_layers(config) -> list[int]:
    types = getattr(config, "layer_types", None)
    if types and any(t == "sliding_attention" for t in types):
        return [i for i, t in enumerate(types) if t != "sliding_attention"]
    n = config.num_hidden_layers
    return sorted({0, n // 2, n - 1})


def capture_qkv_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_CAPTURE_QKV.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=8192, help="prompt tokens")
    p.add_argument("--layers", default=None, help="comma-separated layer indices (default: see above)")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(model.config)
    (sample,) = make_samples("niah_single_2", tokenizer, args.length, 1, 0)
    (ctx,), (q,) = encode_prompts(tokenizer, [sample.context], [sample.question], [sample.answer_prefix])
    ids = ctx + q
    recorder = QueryRecorder(layers=tuple(layers))
    cache = LonglabCache(Recipe(kv=[recorder]))
    stream = Stream(model, cache, 1)
    start = time.perf_counter()
    with torch.inference_mode():
        stream.feed([ids], args.chunk_size, compress="none")
    prefill_s = time.perf_counter() - start
    tensors, meta = {}, {"model": args.model, "tokens": str(len(ids)), "task": "niah_single_2"}
    for i in layers:
        layer = cache.layers[i]
        if int(layer.index.min()) < 0 or layer.keys.shape[-2] != len(ids):
            raise SystemExit(f"layer {i} does not hold the whole stream (sliding window?): pick another")
        name = f"{args.model}.L{i}"
        tensors[f"{name}.q"] = torch.cat(recorder.queries[i], dim=2).contiguous()
        tensors[f"{name}.k"] = layer.keys.float().contiguous()
        tensors[f"{name}.v"] = layer.values.float().contiguous()
        meta[f"{name}.scaling"] = repr(recorder.scaling[i])
    meta["hardware"] = repr(hardware())
    save_file(tensors, args.out, metadata=meta)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    print(f"{args.model}: {len(ids)} tokens prefilled in {prefill_s:.1f}s; layers {layers}; wrote {args.out}")
    print(shapes)
    return 0


def _run_capture_qkv() -> object:
    raise SystemExit(capture_qkv_main())


# ---- backends (was bench/sparse_prefill.py backends) ----------------------------------------

DOC_BACKENDS = """
Sparse-prefill wall time on a real model by executor backend, side by side (issue 16, item 5).

    bench/heavy.sh .venv/bin/python bench/sparse_prefill.py backends --lengths 4096,8192 --repeats 3

For each length, one RULER ``niah_single_1`` sample on SmolLM2-135M: the dense prefill (``full``) and a
sparse-prefill recipe (``--selector``, default ``xattention``) run with each executor ``--backends``
(``grouped``: fused-SDPA calls merged by log-sum-exp; ``flash``: longlab's C++ block-sparse kernel),
interleaved (one of each per repeat, the order rotating), ``prefill_s`` of ``longlab.generate`` with
chunks of ``--chunk-size``. Prints medians and the ratios to ``full`` and between backends, checks that the
backends give the same answer tokens, and writes JSON with the machine header and every timing.
""".lstrip("\n")

def backends_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_BACKENDS.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--selector", default="xattention")
    p.add_argument("--backends", default="grouped,flash")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default="bench/results/sparse_prefill_backends.json")
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model)
    recipes = ["full"] + [f"{args.selector}:backend={b}" for b in args.backends.split(",")]
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        (sample,) = make_samples("niah_single_1", tokenizer, T, 1, 0)
        times: dict[str, list[float]] = {r: [] for r in recipes}
        answers: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            order = recipes[rep % len(recipes):] + recipes[:rep % len(recipes)]
            for r in order:
                res = generate(model, tokenizer, sample.context, sample.question, r,
                               max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size,
                               answer_prefix=sample.answer_prefix)
                times[r].append(res.prefill_s)
                answers.setdefault(r, list(res.token_ids[0]))
                print(f"T={T} rep {rep} {r}: prefill {res.prefill_s:.2f} s", flush=True)
        med = {r: statistics.median(t) for r, t in times.items()}
        sparse = recipes[1:]
        same = all(answers[r] == answers[sparse[0]] for r in sparse)
        row = {"length": T, "context_tokens": res.context_tokens[0], "prefill_s": times, "median_s": med,
               "speedup_vs_full": {r: med["full"] / med[r] for r in sparse},
               "answers_equal_across_backends": same, "answers": {r: str(a) for r, a in answers.items()}}
        if len(sparse) == 2:
            row["ratio"] = med[sparse[0]] / med[sparse[1]]
        rows.append(row)
        print(f"T={T} ({row['context_tokens']} tokens): " + ", ".join(
            f"{r} {med[r]:.2f} s ({med['full'] / med[r]:.2f}x full)" for r in recipes)
            + (f"; {sparse[0]} / {sparse[1]} = {row['ratio']:.2f}" if "ratio" in row else "")
            + f"; same answer tokens across backends: {same}; {torch.get_num_threads()} threads", flush=True)
    print(f"wrote {write_json(args.out, {'hardware': hardware(), 'args': vars(args), 'rows': rows})}")
    return 0


def _run_backends() -> object:
    raise SystemExit(backends_main())


# ---- stats (was bench/sparse_prefill.py stats) ----------------------------------------

DOC_STATS = """
Per-sample prefill-time ratios and mask quality of sparse prefill recipes, from one results.sqlite.

The recipes of one sample run back to back in one ``longlab eval`` process, so the per-sample ratio
``prefill_s(recipe) / prefill_s(full)`` compares like with like under a changing load. For each recipe:

* the geometric mean of those ratios, ``exp(mean(log r_i))``, with a seeded percentile bootstrap 95% CI
  over samples (``longlab.eval.stats.bootstrap_ci`` on the logs), and the median ratio;
* how many of its predictions equal `full`'s on the same sample (identical decoded text);
* the whole-model block density, attention recall and relative output error (the ``metrics`` rows with
  ``layer = head = -1`` that ``--prefill-metrics`` writes), as a mean over samples with a bootstrap 95% CI.

Overall and per task. Usage::

    python bench/sparse_prefill.py stats STORE OUT.json [--length L]   (directory, results.sqlite or .gz)
""".lstrip("\n")

def _ci(values: list[float], digits: int = 3) -> dict:
    m, lo, hi = bootstrap_ci([values])
    return {"n": len(values), "mean": round(m, digits), "ci95": [round(lo, digits), round(hi, digits)]}


def _ratio(logs: list[float]) -> dict:
    m, lo, hi = bootstrap_ci([logs])
    return {"n": len(logs), "geomean": round(math.exp(m), 3),
            "ci95": [round(math.exp(lo), 3), round(math.exp(hi), 3)],
            "median": round(float(np.exp(np.median(logs))), 3)}


def stats_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_STATS.splitlines()[0])
    ap.add_argument("db")
    ap.add_argument("out")
    ap.add_argument("--length", type=int, default=None, help="only rows of this prompt length")
    a = ap.parse_args()
    stored, metrics = read_store(a.db)
    rows = [(r["run_key"], r["recipe"], r["task"], r["sample_id"], r["prefill_s"], r["prediction"])
            for r in stored if not a.length or r["length"] == a.length]
    metric = {(m["run_key"], m["name"]): m["value"] for m in metrics}
    by = {(r, s): (key, task, p) for key, r, task, s, p, _ in rows}
    pred = {(r, s): text for _, r, _, s, _, text in rows}
    full = {s: p for (r, s), (_, _, p) in by.items() if r == "full"}
    med = round(float(np.median(list(full.values()))), 2)
    res: dict = {"full_prefill_s": {"n": len(full), "median": med},
                 "ratio_to_full": {}, "same_prediction_as_full": {}, "mask_quality": {}}
    for recipe in sorted({r for r, _ in by} - {"full"}):
        mine = [(s, key, task, p) for (r, s), (key, task, p) in by.items() if r == recipe]
        pairs = [(task, math.log(p / full[s])) for s, _, task, p in mine if s in full]
        same = [pred[recipe, s] == pred["full", s] for s, *_ in mine if s in full]
        res["same_prediction_as_full"][recipe] = {"same": sum(same), "n": len(same)}
        if pairs:
            entry = {"all": _ratio([x for _, x in pairs])}
            for task in sorted({t for t, _ in pairs}):
                entry[task] = _ratio([x for t, x in pairs if t == task])
            res["ratio_to_full"][recipe] = entry
        q = {}
        for name in ("density", "recall", "rel_error"):
            vals = [(task, metric[key, name]) for _, key, task, _ in mine if (key, name) in metric]
            if vals:
                q[name] = {"all": _ci([v for _, v in vals])}
                for task in sorted({t for t, _ in vals}):
                    q[name][task] = _ci([v for t, v in vals if t == task])
        if q:
            res["mask_quality"][recipe] = q
    write_json(a.out, res)
    print("full prefill median", res["full_prefill_s"])
    for recipe, e in res["ratio_to_full"].items():
        print(recipe, "time/full", "  ".join(
            f"{k}: {v['geomean']}x [{v['ci95'][0]}, {v['ci95'][1]}] n={v['n']}" for k, v in e.items()))
    for recipe, e in res["same_prediction_as_full"].items():
        print(recipe, f"same prediction as full: {e['same']} of {e['n']}")
    for recipe, q in res["mask_quality"].items():
        for name, e in q.items():
            print(recipe, name, "  ".join(
                f"{k}: {v['mean']} [{v['ci95'][0]}, {v['ci95'][1]}] n={v['n']}" for k, v in e.items()))


def _run_stats() -> object:
    stats_main()


# ---- prefill-time (was bench/sparse_prefill.py prefill-time) ----------------------------------------

DOC_PREFILL_TIME = """
Wall time of a full-cache prefill at one length, for each chunk size (best of ``--repeats``).

    python bench/sparse_prefill.py prefill-time --model smollm2-135m --length 4096 --chunk-sizes 1024,4096

The prompt is a RULER ``niah_single_1`` sample of ``--length`` tokens; the figure is
``GenerationResult.prefill_s`` of ``longlab.generate(..., recipe="full", max_new_tokens=1)``, i.e. the
context's chunked prefill through the longlab attention hook. Writes JSON with the machine header.
""".lstrip("\n")

def prefill_time_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DOC_PREFILL_TIME.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk-sizes", default="1024,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench/results/prefill_time.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    (sample,) = make_samples("niah_single_1", tokenizer, args.length, 1, 0)
    rows = []
    for chunk in (int(c) for c in args.chunk_sizes.split(",")):
        times = []
        for _ in range(max(1, args.repeats)):
            result = generate(
                model, tokenizer, sample.context, sample.question, "full", max_new_tokens=1,
                chunk_size=chunk, answer_prefix=sample.answer_prefix,
            )
            times.append(result.prefill_s)
        rows.append({"model": args.model, "context_tokens": result.context_tokens[0], "chunk_size": chunk,
                     "prefill_s": min(times), "all_s": times})
        print(f"{args.model}: {result.context_tokens[0]} tokens, chunk {chunk}: prefill {min(times):.1f} s "
              f"(best of {len(times)}; {torch.get_num_threads()} threads)", flush=True)
    print(f"wrote {write_json(args.out, {'hardware': hardware(), 'args': vars(args), 'rows': rows})}")
    return 0


def _run_prefill_time() -> object:
    raise SystemExit(prefill_time_main())


def prefill_ratios_main(db: str, out: str) -> dict[str, Any]:
    """Per-sample prefill-time ratio recipe / ``full`` from one ``longlab eval`` store (the recipes of one
    sample ran back to back in one process): geometric mean with a seeded bootstrap 95% interval over the
    samples (:func:`bootstrap_ci` on the log ratios) and the median, overall and per task."""
    stored, _ = read_store(db)
    t = {(r["recipe"], r["sample_id"]): (r["task"], r["prefill_s"]) for r in stored if r["prefill_s"]}
    full = {s: p for (r, s), (_, p) in t.items() if r == "full"}
    if not full:
        raise SystemExit(f"{db}: no full rows with a prefill time to compare against")

    def summary(logs: list[float]) -> dict[str, Any]:
        m, lo, hi = bootstrap_ci([logs])
        return {"n": len(logs), "geomean": round(math.exp(m), 3),
                "ci95": [round(math.exp(lo), 3), round(math.exp(hi), 3)],
                "median": round(float(np.exp(np.median(logs))), 3)}

    res: dict[str, Any] = {"full_prefill_s_median": round(float(np.median(list(full.values()))), 2),
                           "ratio_to_full": {}}
    for recipe in sorted({r for r, _ in t} - {"full"}):
        pairs = [(task, math.log(p / full[s])) for (r, s), (task, p) in t.items()
                 if r == recipe and s in full]
        if pairs:
            entry = {"all": summary([x for _, x in pairs])}
            for task in sorted({k for k, _ in pairs}):
                entry[task] = summary([x for k, x in pairs if k == task])
            res["ratio_to_full"][recipe] = entry
    write_json(out, res)
    for recipe, e in res["ratio_to_full"].items():
        print(recipe, "  ".join(f"{k}: {v['geomean']}x [{v['ci95'][0]}, {v['ci95'][1]}] n={v['n']}"
                                for k, v in e.items()))
    return res


def _run_ratios() -> object:
    ap = argparse.ArgumentParser(description="per-sample prefill-time ratios recipe / full of a longlab eval "
                                             "store (the sparse-prefill page's prefill_ratios.json)")
    ap.add_argument("db", metavar="STORE", help="a longlab eval store (directory, results.sqlite or .gz)")
    ap.add_argument("out", metavar="OUT.json", help="where the ratios go")
    args = ap.parse_args()
    prefill_ratios_main(args.db, args.out)


SUBCOMMANDS = {
    "attention": _run_attention,
    "capture-qkv": _run_capture_qkv,
    "backends": _run_backends,
    "stats": _run_stats,
    "prefill-time": _run_prefill_time,
    "ratios": _run_ratios,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/sparse_prefill.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
