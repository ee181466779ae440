"""PyramidKV fidelity: longlab's kept sets against the official selection, layer by layer.

The reference below is written here from the behaviour of the official code (KVCache-Factory,
``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster.update_kv``, with K/V repeated to the query heads
before it as its ``llama_model.py`` does, run with ``window_size=8, kernel_size=7, pooling=maxpool,
beta=20`` as its ``run_longbench.py``): per-layer capacity from ``max_capacity_prompt``, the last W queries'
attention (additive causal mask, fp32 softmax cast back to the query dtype) summed over the window rows,
max-pooled over the prefix, ``topk`` of the prefix plus the window. Both run on the same random tensors
(fresh ones per layer); for each layer and head we report |A ∩ B| / |A ∪ B| (Jaccard) of the kept
positions and both kept counts. Two layouts: MHA (``pyramidkv:budget=C``, the default ``gqa=mean``) and
GQA (``pyramidkv:budget=C,gqa=query``, one set per query head, as the official code keeps).

    PYTHONPATH=src python bench/pyramidkv_fidelity.py            # 32 layers, T=1024, budgets 64 and 128
    PYTHONPATH=src python bench/pyramidkv_fidelity.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import ROOT, hardware, write_json

from longlab.kv import kept_indices


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    main()
