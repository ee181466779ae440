"""Per-pair cost of aten's fused CPU flash kernel by query rows per call (issue 16, executor efficiency).

    bench/heavy.sh .venv/bin/python bench/attention_tile_micro.py [T]

Times, at SmolLM2's GQA heads (9 q / 3 KV, D = 64) and T = 8192 by default: dense ``is_causal`` SDPA
(GQA native, and with K/V repeated), then batches of mask-free units of R query rows x L keys holding a
quarter of the causal work, for R in 128..1024. The kernel tiles queries by 32 rows below 192 queries,
64 below 768 and 256 above, so a 128-row unit (one q-block of a per-head block mask) pays more per pair
than dense causal prefill. Prints ns per computed pair (dense: per causal pair) and the ratio to dense;
median of 3 calls after one warm-up.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _median_s(fn, n: int = 3) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(T: int = 8192) -> None:
    torch.manual_seed(0)
    H, H_kv, D = 9, 3, 64
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, H_kv, T, D), torch.randn(1, H_kv, T, D)
    causal_pairs = H * T * (T + 1) / 2
    res = {"dense is_causal (GQA)": _median_s(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)) / causal_pairs}
    kr, vr = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
    rep = _median_s(lambda: OP(q, kr, vr, 0.0, True, scale=0.125))
    res["dense is_causal (K/V repeated)"] = rep / causal_pairs
    shapes = [(128, 4096), (256, 4096), (384, 4096), (768, 4096), (1024, 4096), (128, 1024), (128, 2048)]
    for rows, keys in shapes:
        G = max(1, int(0.25 * causal_pairs / (rows * keys)))
        qs, ks, vs = torch.randn(G, 1, rows, D), torch.randn(G, 1, keys, D), torch.randn(G, 1, keys, D)
        res[f"units {rows} rows x {keys} keys"] = _median_s(
            lambda qs=qs, ks=ks, vs=vs: OP(qs, ks, vs, 0.0, False, scale=0.125)) / (G * rows * keys)
    base = res["dense is_causal (GQA)"]
    print(f"T={T}, {torch.get_num_threads()} thread(s)")
    for name, s in res.items():
        print(f"{name:32s} {s * 1e9:7.3f} ns/pair  x{s / base:5.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
