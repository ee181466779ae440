"""Two decode-step micro-benchmarks behind docs/results/vs-kvpress.md (issue 10, item 9), one thread.

1. The LM head (SmolLM2: 49,152 x 576) at 9 / 5 / 1 rows: ``F.linear`` against the same product in
   row blocks of the weight (bitwise equal logits).
2. Decode attention for a stacked batch of 9 rows of unequal length (1,700, 4 x 880, 4 x 460 keys;
   3 KV heads x 3 query heads, D = 64): one SDPA call per row over its own keys (what
   ``longlab.attention._ragged_rows`` does) against one padded call with a mask.

Rounds interleave the variants; medians of the per-call times are printed (microseconds).

    bench/heavy.sh .venv/bin/python bench/decode_step_kernels.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


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


def lm_head() -> None:
    W = torch.randn(49152, 576)  # [V, D]
    for rows in (9, 5, 1):
        x = torch.randn(rows, 576)
        ref = F.linear(x, W)

        def blocks(c: int, x: torch.Tensor = x):
            return lambda: torch.cat([F.linear(x, W[i : i + c]) for i in range(0, W.shape[0], c)], -1)

        variants = {"linear": lambda x=x: F.linear(x, W), "blocks2048": blocks(2048),
                    "blocks8192": blocks(8192)}
        same = {name: torch.equal(fn(), ref) for name, fn in variants.items()}
        print(f"LM head, {rows} rows, us: {interleaved(variants, 30)}; bitwise equal: {same}", flush=True)


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


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm_head()
    decode_attention()
