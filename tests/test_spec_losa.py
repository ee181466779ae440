"""LoSA (longlab.decode.losa) and Jacobi block decoding (longlab.spec.jacobi)."""

from __future__ import annotations

import pytest
import torch

from longlab.attention import dense_attention, visibility_mask
from longlab.cache import LonglabCache
from longlab.decode.losa import LoSA, merge_parts, part_attention
from longlab.engine.stream import Stream
from longlab.spec.jacobi import jacobi_decode


def _block(B=2, H=4, H_kv=2, Tp=70, n=8, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64).float()
    k = torch.randn(B, H_kv, Tp + n, D, generator=g)
    v = torch.randn(B, H_kv, Tp + n, D, generator=g)
    kidx = torch.arange(Tp + n, dtype=torch.int32).expand(B, H_kv, -1).clone()
    if B > 1:
        kidx[1, :, :5] = -1  # row 1: five empty slots (padding) in the prefix
    qidx = kidx[:, 0, Tp:].clone()
    return q, k, v, kidx, qidx, Tp


def _dense(q, k, v, kidx, qidx):
    mask = visibility_mask(kidx, qidx)
    return dense_attention(q.double(), k.double(), v.double(), mask, 0.25).float()


def test_lse_merge_of_prefix_and_block_equals_dense():
    q, k, v, kidx, qidx, Tp = _block()
    g = q.shape[1] // k.shape[1]
    vis = ((kidx[:, :, None, :] >= 0) & (kidx[:, :, None, :] <= qidx[:, None, :, None])).repeat_interleave(
        g, 1
    )
    o_p, lse_p = part_attention(q, k[:, :, :Tp], v[:, :, :Tp], vis[..., :Tp], 0.25)
    o_b, lse_b = part_attention(q, k[:, :, Tp:], v[:, :, Tp:], vis[..., Tp:], 0.25)
    assert torch.allclose(merge_parts(o_p, lse_p, o_b, lse_b), _dense(q, k, v, kidx, qidx), atol=1e-6)


def test_rho_one_with_every_page_is_dense():
    q, k, v, kidx, qidx, Tp = _block()
    losa = LoSA(budget=10_000, page_size=16, rho=1.0)
    for _ in range(2):  # first step and a later step
        out = losa.block_attention(0, q, k, v, kidx, qidx, 0.25, Tp)
        assert torch.allclose(out, _dense(q, k, v, kidx, qidx), atol=1e-6)


def test_reuse_is_exact_when_the_input_is_unchanged():
    q, k, v, kidx, qidx, Tp = _block()
    losa = LoSA(budget=32, page_size=16, rho=0.25)
    first = losa.block_attention(0, q, k, v, kidx, qidx, 0.25, Tp)
    q2 = q.clone()
    q2[:, :, 3] += 1.0  # only query 3 changes: it is the most changed, hence active
    second = losa.block_attention(0, q2, k, v, kidx, qidx, 0.25, Tp)
    fresh = LoSA(budget=32, page_size=16, rho=0.25).block_attention(0, q2, k, v, kidx, qidx, 0.25, Tp)
    # causal block: queries before 3 see the same in-block keys, stable ones reuse the prefix part exactly
    assert torch.equal(second[:, :, :3], first[:, :, :3])
    assert torch.allclose(second[:, :, 3], fresh[:, :, 3], atol=1e-6)
    assert losa.trace[-1]["active"] == 2 * 2  # ceil(0.25 * 8) per row, 2 rows


def test_page_union_count_matches_brute_force():
    q, k, v, kidx, qidx, Tp = _block(B=1, Tp=160)
    kidx = kidx.clone()
    losa = LoSA(budget=48, page_size=16, rho=1.0)  # every query active: per-query Quest
    losa.block_attention(0, q, k, v, kidx, qidx, 0.25, Tp)
    P, n_full, H, g = 16, Tp // 16, q.shape[1], q.shape[1] // k.shape[1]
    unions = []
    for h in range(H):
        kh = k[0, h // g, : n_full * P].reshape(n_full, P, -1)
        hi, lo = kh.amax(1), kh.amin(1)
        pages = set()
        for i in range(q.shape[2]):
            qi = q[0, h, i]
            u = [float(torch.maximum(qi * hi[p], qi * lo[p]).sum()) for p in range(n_full)]
            pages |= set(sorted(range(n_full), key=lambda p: -u[p])[:3])
        unions.append(len(pages))
    assert losa.trace[-1]["pages"] == pytest.approx(sum(unions) / H)


def test_jacobi_dense_equals_greedy_and_losa_runs(llama, tokenizer, one_thread):
    ids = tokenizer(" ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(12)))["input_ids"]

    def fresh():
        stream = Stream(llama, LonglabCache("full"), 1)
        return stream, stream.feed([ids], chunk_size=256)

    stream, logits = fresh()
    reference = stream.decode(logits, 20, set())
    stream, logits = fresh()
    out, stats = jacobi_decode(llama, stream, logits, 20, block=8, max_steps=4)
    assert out == reference and stats.tokens >= 20
    stream, logits = fresh()
    out, stats = jacobi_decode(
        llama, stream, logits, 12, block=8, max_steps=3, attention="losa", budget=64, compare_dense=True
    )
    info = stats.as_dict()
    assert len(out[0]) == 12 and 0 < info["active_fraction"] < 1 and info["pages_per_layer_step"] > 0
