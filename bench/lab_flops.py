"""Forward FLOPs per token of the trained layers-lab models (matmul FLOPs, 2 per multiply-add), counted by
``torch.utils.flop_counter.FlopCounterMode`` on the real forward, next to the analytic per-layer counts of
softmax attention, LaCT and UltraMemV2, so "recall per FLOP" can be judged.

    python bench/lab_flops.py --root runs/lab --task passkey --lengths 64 256 1024 \\
        --out bench/results/lab_results/flops.json

Counted: matmuls, einsums and SDPA (FlopCounterMode has no formula for the CPU flash kernel
``_scaled_dot_product_flash_attention_for_cpu``; it is given torch's own SDPA formula, ``4·B·H·Tq·Tk·d``),
as implemented: attention in row chunks of 256 computes the whole masked chunk, so at T ≤ 256 it counts
T² score entries, twice the causal T(T+1)/2; sliding windows count their key slice.
Not counted: elementwise work (exponentials, gathers, the entmax sort, LSSA's elementwise passes).
"mixer" FLOPs include UltraMemV2's memory (called beside the MLP).
L2A's count is the trained router's actual routing at each length (eval path: a real gather).

Analytic per-layer counts per token at context position t (D = model dim, w = window, d_h = fast-weight
hidden, f = fast heads, C = chunk, h = key sets, r = Tucker rank, k = key dim, n = grid, d_v = value dim):

- softmax layer: ``8D² + 4D(t+1)`` (q, k, v, o projections; causal QKᵀ and AV);
- LaCT layer: ``8D² + 2D² + 6fD + 4D·min(t+1, w) + 6 d_h D + 12 d_h D`` (projections, output gate,
  learning rates, sliding window, the fast-weight apply and its chunk update, amortised per token);
- UltraMemV2 memory (beside the MLP): ``4D·hrk + 4hrnk + 4h²rn + 2h²(pre·r² + pre²·r) + 2h²d_vD``
  (row/column queries, key scores, rank-1 pre-selection, candidate grid scores, output projection).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from longlab.lab.evaluate import eval_generator
from longlab.lab.tasks import task_config
from longlab.lab.train import load_checkpoint


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def analytic_layer(spec: str, dim: int, t: int) -> float | None:
    """Analytic matmul FLOPs of one mixer layer for the token at position t (None: not modelled)."""
    from longlab.lab.mixers import mixer_config

    cfg = mixer_config(spec)
    proj = 8 * dim * dim
    if cfg.name == "softmax":
        return proj + 4 * dim * (t + 1)
    if cfg.name == "lact":
        dh = cfg.inter_multi * dim // cfg.fast_heads
        return (proj + 2 * dim * dim + 6 * cfg.fast_heads * dim + 4 * dim * min(t + 1, cfg.window)
                + 18 * dh * dim)
    if cfg.name == "ultramem":
        h, r, k, n, pre = cfg.sets, cfg.rank, cfg.key_dim, cfg.grid, cfg.pre
        mem = (4 * dim * h * r * k + 4 * h * r * n * k + 4 * h * h * r * n
               + 2 * h * h * (pre * r * r + pre * pre * r) + 2 * h * h * cfg.d_v * dim)
        return proj + 4 * dim * (t + 1) + mem
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/lab")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--mixers", nargs="+", default=["softmax", "lact", "ultramem", "l2a", "race", "linear",
                                                     "ssmax", "asentmax", "lssa", "lssar", "mamba"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--out", default="bench/results/lab_results/flops.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for name in args.mixers:
        ck = Path(args.root) / "ckpt" / args.task / name / "seed0"
        model, cfg, man = load_checkpoint(ck)
        task = task_config(cfg.task, cfg.seed)
        for length in args.lengths:
            b = task.sample(1, length, eval_generator(0, length, 0))
            with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as fc, torch.no_grad():
                model(b.tokens)
            total = fc.get_total_flops()
            by_mod = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
            mixer = sum(v for k, v in by_mod.items()
                        if re.fullmatch(r"LabLM\.blocks\.\d+\.mixer(\.parallel_ffn)?", k))
            ana = [analytic_layer(cfg.mixer, model.cfg.dim, t) for t in range(length)]
            row = {"mixer": name, "spec": cfg.mixer, "length": length, "params": man["params"],
                   "flops_per_token": total / length, "mixer_flops_per_token": mixer / length,
                   "analytic_mixer_per_token": (model.cfg.n_layers * sum(ana) / length) if ana[0] else None,
                   "mlp_hidden": model.cfg.hidden}
            rate = [getattr(blk.mixer, "last_rate", None) for blk in model.blocks]
            if rate[0] is not None:
                row["global_rate"] = sum(rate) / len(rate)
            rows.append(row)
            an = row["analytic_mixer_per_token"]
            an_k = an / 1e3 if an else float("nan")
            print(f"{name:>9} T={length:>5}: {total / length / 1e3:8.1f} kFLOP/token (mixers "
                  f"{mixer / length / 1e3:7.1f}k, analytic {an_k:7.1f}k)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
