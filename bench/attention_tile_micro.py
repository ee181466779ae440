"""Per-pair cost of aten's fused CPU flash kernel by query rows per call (issue 16, executor efficiency).

    bench/heavy.sh .venv/bin/python bench/attention_tile_micro.py [T] [--grid]

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
    if "--grid" in sys.argv:  # short key sets (what random masks at keep 0.2 give) and key-block-major units
        shapes += [(128, 128), (128, 256), (128, 512), (256, 512), (256, 1024), (384, 512), (384, 1024),
                   (768, 1024), (4096, 128), (4096, 512), (1024, 128)]
    for rows, keys in shapes:
        G = max(1, int(0.25 * causal_pairs / (rows * keys)))
        qs, ks, vs = torch.randn(G, 1, rows, D), torch.randn(G, 1, keys, D), torch.randn(G, 1, keys, D)
        res[f"units {rows} rows x {keys} keys"] = _median_s(
            lambda qs=qs, ks=ks, vs=vs: OP(qs, ks, vs, 0.0, False, scale=0.125)) / (G * rows * keys)
    if "--grid" in sys.argv:
        # the diagonal part: G square 128 x 128 causal problems in one is_causal call (per causal pair)
        n = 64 * H
        qd, kd = torch.randn(n, 1, 128, D), torch.randn(n, 1, 128, D)
        res["diag 128x128 is_causal (per causal pair)"] = _median_s(
            lambda: OP(qd, kd, kd, 0.0, True, scale=0.125)) / (n * 128 * 129 / 2)
        # K/V gather of 128-key blocks (index_select of 32 KiB rows) and one lse merge pass, per pair of a
        # 128 x 128 block pair they serve
        kb = torch.randn(H_kv * 64, 128 * D)
        idx = torch.randint(0, H_kv * 64, (2048,))
        ws = torch.empty(2048, 128 * D)
        res["gather K+V per block pair"] = 2 * _median_s(
            lambda: torch.index_select(kb, 0, idx, out=ws)) / (2048 * 128 * 128)
        o1, o2 = torch.randn(H, T, D), torch.randn(H, T, D)
        l1, l2 = torch.randn(H, T), torch.randn(H, T)

        def merge() -> None:
            new = torch.logaddexp(l1, l2)
            o1.mul_(torch.exp(l1 - new)[..., None]).addcmul_(o2, torch.exp(l2 - new)[..., None])
        res["merge pass per 128-key block row"] = _median_s(merge) / (H * T * 128)
    base = res["dense is_causal (GQA)"]
    print(f"T={T}, {torch.get_num_threads()} thread(s)")
    for name, s in res.items():
        print(f"{name:32s} {s * 1e9:7.3f} ns/pair  x{s / base:5.2f}")


if __name__ == "__main__":
    pos = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(pos[0]) if pos else 8192)
