"""Selectors: registry, validation, mask invariants, monotone budgets, planted patterns, identities."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from longlab.sparse import SELECTORS, density, make_selector
from longlab.sparse.blockmask import causal_allowed, diagonal_blocks
from longlab.sparse.executor import block_sparse_attention, dense_causal_attention
from longlab.sparse.prism import Prism, band_dims
from longlab.sparse.sale import SALE, quantize_symmetric
from longlab.sparse.synthetic import apply_rope, synthetic_qkv
from longlab.sparse.xattention import antidiagonal_block_scores

SMALL = {"ashape": {"n_sink": 64, "n_local": 256}, "sale": {"min_q_len": 0}}


def _sel(name: str, **kw):
    return make_selector(name, **{**SMALL.get(name, {}), **kw})


@pytest.fixture(scope="module")
def qkv():
    return synthetic_qkv(B=1, H=4, H_kv=2, T=1024, D=64, seed=0)


def test_registry_lists_valid_names():
    assert set(SELECTORS) == {"ashape", "vslash", "blocktopk", "flexprefill", "xattention", "prism", "sale"}
    with pytest.raises(ValueError, match="valid names: ashape, blocktopk"):
        make_selector("nope")
    for name, cls in SELECTORS.items():
        assert cls.name == name and "arXiv" in cls.__doc__  # every method cites its paper


BAD = [
    ("ashape", "n_local", 0), ("vslash", "vertical_size", 0), ("vslash", "last_q", -1),
    ("blocktopk", "top_k", 0), ("flexprefill", "gamma", 1.5), ("flexprefill", "tau", -0.1),
    ("xattention", "tau", 1.1), ("xattention", "stride", 0), ("prism", "thr_high", 2.0),
    ("prism", "high_frac", 0.0), ("sale", "tau", -1.0), ("sale", "bits", 1), ("ashape", "bq", 0),
]


@pytest.mark.parametrize("name,field,value", BAD, ids=[f"{n}-{f}" for n, f, _ in BAD])
def test_invalid_field_raises_naming_field(name, field, value):
    with pytest.raises(ValueError, match=rf"\.{field} must be"):
        make_selector(name, **{field: value})


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("T_q", [1024, 320], ids=["prefill", "chunk"])
def test_masks_hold_sink_and_diagonal_and_nothing_above(qkv, name, T_q):
    q, k, _ = qkv
    sel = _sel(name)
    m = sel.select(q[:, :, -T_q:], k, 0.125)
    assert m.mask.shape == (1, 4, -(-T_q // sel.bq), -(-1024 // sel.bk))
    allowed = causal_allowed(T_q, 1024, sel.bq, sel.bk)
    diag = diagonal_blocks(T_q, 1024, sel.bq, sel.bk)
    assert m.mask[..., 0].all()
    assert (m.mask | ~diag).all()
    assert not (m.mask & ~allowed).any()


# loose -> tight budgets (density must not increase)
SWEEPS = [
    ("ashape", [{"n_local": n} for n in (1024, 512, 256, 64)]),
    ("vslash", [{"vertical_size": v, "slash_size": s}
                for v, s in ((400, 800), (200, 400), (60, 200), (31, 101))]),
    ("blocktopk", [{"top_k": t} for t in (16, 8, 4, 1)]),
    ("flexprefill", [{"gamma": g, "min_budget": 64, "bq": 64, "bk": 64}
                     for g in (0.999, 0.95, 0.8, 0.5, 0.1)]),
    ("xattention", [{"tau": t, "bq": 64, "bk": 64} for t in (1.0, 0.95, 0.9, 0.7, 0.3)]),
    ("prism", [{"thr_high": t, "thr_low": t, "bq": 64, "bk": 64} for t in (1.0, 0.95, 0.8, 0.5, 0.1)]),
    ("sale", [{"tau": t} for t in (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)]),
]


@pytest.mark.parametrize("name,sweep", SWEEPS, ids=[n for n, _ in SWEEPS])
def test_density_falls_monotonically_as_budget_tightens(qkv, name, sweep):
    q, k, _ = qkv
    dens = [density(_sel(name, **kw).select(q, k, 0.125)) for kw in sweep]
    assert all(a >= b for a, b in zip(dens, dens[1:])), dens
    assert dens[0] > dens[-1], dens


def test_full_budget_reproduces_dense(qkv):
    q, k, v = qkv
    ref = dense_causal_attention(q, k, v, 0.125)
    for name, kw in [("xattention", {"tau": 1.0}), ("sale", {"tau": 0.0}), ("blocktopk", {"top_k": 10**6})]:
        m = _sel(name, **kw).select(q, k, 0.125)
        if name != "xattention":  # xattention at tau=1 may drop blocks of zero estimated mass
            assert density(m) == 1.0
        out = block_sparse_attention(q, k, v, m, 0.125, backend="gather")
        assert (out - ref).abs().max() <= 1e-4


def test_xattention_scores_match_brute_force():
    g = torch.Generator().manual_seed(3)
    T_q, T_k, D, S, bq, bk = 96, 256, 16, 8, 32, 16
    q, k = torch.randn(1, 2, T_q, D, generator=g), torch.randn(1, 1, T_k, D, generator=g)
    s = 0.25
    got = antidiagonal_block_scores(q, k, s, S, bq, bk, chunk_q=32)
    a = q @ k.repeat_interleave(2, 1).transpose(-1, -2)  # [1, 2, T_q, T_k]
    mq, mk = T_q // S, T_k // S
    tiles = torch.zeros(1, 2, mq, mk)
    for m in range(mq):
        for n in range(mk):
            tiles[..., m, n] = sum(a[..., S * m + S - 1 - i, S * n + i] for i in range(S))
    off = T_k - T_q
    causal = torch.tensor([[n * S <= off + S * m + S - 1 for n in range(mk)] for m in range(mq)])
    p = torch.softmax((tiles * s / S).masked_fill(~causal, float("-inf")), -1)
    want = p.view(1, 2, T_q // bq, bq // S, T_k // bk, bk // S).sum(dim=(3, 5))
    assert torch.allclose(got, want, atol=1e-5)


def test_vslash_finds_planted_vertical_and_slash():
    g = torch.Generator().manual_seed(0)
    T, D, o_star, j_star, bq = 2048, 64, 300, 517, 64
    z = torch.randn(T + o_star, D, generator=g)
    z = z / z.norm(dim=-1, keepdim=True)
    alpha = math.sqrt(14 / 0.125)
    q = (alpha * z[:T])[None, None]  # q_p = z_p
    k = (alpha * z[o_star : o_star + T])[None, None].clone()  # k_j = z_{j + o*}: q_p·k_{p-o*} large
    w = torch.zeros(D)
    w[0] = 1.0
    q = q + 4.0 * w
    k[0, 0, j_star] += 30.0 * w
    sel = make_selector("vslash", vertical_size=31, slash_size=101, bq=bq, bk=bq)
    vertical, slash = sel.scores(q, k, 0.125)
    assert int(vertical[0, 0, 30:].argmax()) + 30 == j_star
    assert int(slash[0, 0, 100:].argmax()) + 100 == o_star
    m = sel.select(q, k, 0.125).mask[0, 0]
    for i in range(T // bq):
        if (i + 1) * bq - 1 >= j_star:
            assert m[i, j_star // bq]
        for p in range(i * bq, (i + 1) * bq):
            if p >= o_star:
                assert m[i, (p - o_star) // bq]
    assert density(sel.select(q, k, 0.125)) < 0.6


def test_prism_band_split_rotate_half():
    D, T, b = 64, 1024, 64
    high, low = band_dims(D)
    assert high.tolist() == list(range(0, 16)) + list(range(32, 48))
    assert low.tolist() == list(range(8, 32)) + list(range(40, 64))
    h128, l128 = band_dims(128)
    assert h128.tolist() == list(range(32)) + list(range(64, 96))
    assert l128.tolist() == list(range(16, 64)) + list(range(80, 128))
    # signal only on rotary pairs [0, 8): inside the high band, outside the low band
    g = torch.Generator().manual_seed(0)
    pairs = torch.zeros(D, dtype=torch.bool)
    pairs[:8] = pairs[32:40] = True
    c = 3 * torch.randn(D, generator=g) * pairs
    pos = torch.arange(T)
    # pre-RoPE vectors counter-rotated so that after RoPE, keys of block 5 and the last queries equal c
    q_pre = 0.1 * torch.randn(1, 1, T, D, generator=g) * pairs
    k_pre = 0.1 * torch.randn(1, 1, T, D, generator=g) * pairs
    q_pre[..., -b:, :] += apply_rope(c.expand(1, 1, b, D), -pos[-b:])
    k_pre[..., 5 * b : 6 * b, :] += apply_rope(c.expand(1, 1, b, D), -pos[5 * b : 6 * b])
    q, k = apply_rope(q_pre), apply_rope(k_pre)
    assert q[..., ~pairs].abs().max() == 0  # the RoPE'd input lives in the high band only
    sel = Prism(bq=b, bk=b, thr_high=0.5, thr_low=0.5)
    p_high, p_low = sel.band_probs(q, k)
    last = p_high[0, 0, -1]
    assert int(last.argmax()) == 5 and last[5] > 0.5  # the high band sees the planted block
    allowed = causal_allowed(T, T, b, b)
    lows = p_low[0, 0, -1][allowed[-1]]
    assert torch.allclose(lows, torch.full_like(lows, 1 / lows.numel()))  # low band: uniform, sees nothing
    assert sel.select(q, k).mask[0, 0, -1, 5]


def test_sale_matches_brute_force_relative_attention_score():
    q, k, _ = synthetic_qkv(B=1, H=2, H_kv=1, T=256, D=32, seed=1)
    s = 1 / math.sqrt(32)
    sel = SALE(bq=64, bk=32, local_window=64, tau=0.01, min_q_len=0, chunk_q=64)
    got = sel.select(q, k, s).mask
    # brute force
    T, bq, bk = 256, 64, 32
    ks = k - k.mean(2, keepdim=True)
    qm = q.mean(2, keepdim=True)
    qi, qs = quantize_symmetric(q - qm, 2)
    ki, kscale = quantize_symmetric(ks, 8)
    ks, ki, kscale = ks.repeat(1, 2, 1, 1), ki.repeat(1, 2, 1, 1), kscale.repeat(1, 2, 1)
    est = (qi @ ki.transpose(-1, -2)) * qs[..., None] * kscale[..., None, :] + (qm @ ks.transpose(-1, -2))
    exact = (q @ ks.transpose(-1, -2)) * s
    want = torch.zeros_like(got)
    j = torch.arange(T)
    for i in range(T):
        blk = i // bq
        lo = max(0, blk * bq - 64) // bk
        band = (j <= i) & ((j < bk) | (j // bk >= lo))  # sink block + local blocks, causal
        x = exact[..., i, band]
        m = x.amax(-1, keepdim=True)
        ell = torch.exp(x - m).sum(-1, keepdim=True)
        ras = torch.exp(est[..., i, :] * s - m) / ell  # [1, 2, T]
        hit = (ras > 0.01) & (j <= i)
        want[..., blk, :] |= hit.view(1, 2, T // bk, bk).any(-1)
        want[..., blk, 0] = True
        want[..., blk, lo : i // bk + 1] = True
    assert torch.equal(got, want)


def test_sale_quantization_error_bounded():
    x = torch.randn(1, 2, 100, 16)
    xq, scale = quantize_symmetric(x, 8)
    assert xq.abs().max() <= 7 and torch.equal(xq, xq.round())
    assert ((xq * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-6).all()


def test_sale_calibrate_halves_tau_until_error_bound():
    q, k, v = synthetic_qkv(B=1, H=4, H_kv=2, T=512, D=64, seed=2)
    sel = SALE(min_q_len=0)
    loose = sel.calibrate(q, k, v, theta=1e6)
    assert loose.tau == (0.008,) * 4
    tight = sel.calibrate(q, k, v, theta=1e-9)
    assert tight.tau == (0.0,) * 4
    assert density(tight.select(q, k)) == 1.0
    mid = sel.calibrate(q, k, v, theta=0.05)
    assert all(t == 0.0 or any(math.isclose(t, 0.008 / 2**n) for n in range(8)) for t in mid.tau)
    assert dataclasses.replace(mid, tau=0.004).tau == 0.004


def test_slash_sums_match_loop():
    from longlab.sparse.base import last_rows_attention, slash_sums

    q, k, _ = synthetic_qkv(B=2, H=2, H_kv=1, T=300, D=16, seed=4)
    a = last_rows_attention(q[:, :, -37:], k, 0.25, 300)
    want = torch.zeros(2, 2, 300)
    for i in range(37):
        pos = 300 - 37 + i
        for j in range(pos + 1):
            want[..., pos - j] += a[..., i, j]
    assert torch.allclose(slash_sums(a, 300), want, atol=1e-6)
