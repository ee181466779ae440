"""One attention layer, dense SDPA vs block-sparse prefill selectors: time, density, recall, output error.

    python bench/prefill_attention.py --quick
    python bench/prefill_attention.py --lengths 16384,32768 --out bench/results/prefill_attention_32k.json
    python bench/prefill_attention.py --qkv captured.safetensors --lengths 8192

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
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import best_of, hardware, write_json

from longlab.sparse import block_sparse_attention, make_selector, quality_metrics
from longlab.sparse.synthetic import synthetic_qkv

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # name -> (H, H_kv, D)

# Budgets are in tokens of the paper setting, expressed at 128-token blocks where a budget is in blocks.
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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


if __name__ == "__main__":
    main()
