"""Layers lab: which memory rows UltraMemV2 pre-selects, and that the MTD generator follows each sequence's
lag weights λ (issue 28: inverting a selection rule, or ignoring a generator parameter, must fail a test).

L2A's routing (tokens with gate > τ get global attention) is pinned elsewhere
(``test_lab_mixers.py::test_l2a_gate_one_everywhere_is_global_attention``)."""

from __future__ import annotations

import torch

from longlab.lab.mixers.ultramem import UltraMemLayer
from longlab.lab.tasks import MTDTask


def _ultramem_reference(mem: UltraMemLayer, x: torch.Tensor) -> torch.Tensor:
    """UltraMemV2's TDQKR with Top-M pre-selection, by loops: for every token and virtual head (i, j), the
    rank-1 SVD ``C^{ij} ~ s u v^T`` scores rows by ``|u . S_row^i[:, a]|`` and columns by
    ``|v . S_col^j[:, c]|``; the ``pre`` best rows x ``pre`` best columns are scored exactly, the ``top_m``
    best kept, softmax-weighted."""
    s_row, s_col = mem.scores(x)  # [B, T, h, r, n] each
    B, T = x.shape[:2]
    h, n, pre, m = mem.h, mem.n, mem.pre, mem.m
    out = torch.zeros(B, T, h, h, mem.dv, dtype=x.dtype)
    for b in range(B):
        for t in range(T):
            for i in range(h):
                for j in range(h):
                    core = mem.core[i, j].detach()
                    u, _, vh = torch.linalg.svd(core)
                    rows_score = (u[:, 0] @ s_row[b, t, i]).abs()  # [n]
                    cols_score = (vh[0] @ s_col[b, t, j]).abs()
                    rows = rows_score.argsort(descending=True)[:pre].tolist()
                    cols = cols_score.argsort(descending=True)[:pre].tolist()
                    for scores in (rows_score, cols_score):  # the pre-selection cut is not a near tie
                        ordered = scores.sort(descending=True).values
                        assert float(ordered[pre - 1] - ordered[pre]) > 1e-9
                    cand = {(a, c): float(s_row[b, t, i, :, a] @ core @ s_col[b, t, j, :, c])
                            for a in rows for c in cols}
                    best = sorted(cand, key=lambda ac: -cand[ac])[:m]
                    w = torch.softmax(torch.tensor([cand[ac] for ac in best], dtype=x.dtype), 0)
                    slots = [a * n + c for a, c in best]
                    out[b, t, i, j] = (w[:, None] * mem.values[slots].detach()).sum(0)
    return mem.out(out.reshape(B, T, -1))


@torch.no_grad()
def test_ultramem_preselects_the_rows_and_columns_with_the_largest_rank1_scores():
    """grid 8 with pre 3 < grid: the pre-selection decides which slots can win (with pre = grid, as in the
    mixer test, any row order gives the same output)."""
    torch.manual_seed(0)
    mem = UltraMemLayer(dim=16, grid=8, key_dim=4, rank=2, sets=2, top_m=4, pre=3, d_v=4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(mem(x), _ultramem_reference(mem, x))
    # the pre-selection matters here: without it (pre = grid) the output differs
    mem_full = UltraMemLayer(16, 8, 4, 2, 2, 4, 8, 4).double()
    mem_full.load_state_dict(mem.state_dict())
    assert not torch.allclose(mem(x), mem_full(x)), "pre-selection changed nothing: case too easy"


def _em_lag_weights(task: MTDTask, x: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """Per-sequence maximum-likelihood lag weights by EM: x [B, T] -> [B, K]."""
    K = task.lags
    T = x.shape[1]
    lik = torch.stack([task.Q[x[:, K - k : T - k], x[:, K:]] for k in range(1, K + 1)], dim=-1)  # [B, T-K, K]
    lam = torch.full((x.shape[0], K), 1.0 / K)
    for _ in range(iters):
        resp = lik * lam[:, None, :]
        resp = resp / resp.sum(-1, keepdim=True).clamp_min(1e-30)
        lam = resp.mean(1)
    return lam


def test_mtd_generator_draws_each_sequence_from_its_own_lag_weights():
    """``MTDTask.sample`` draws λ ~ Dir(1_K) per sequence and each next token from lag k ~ λ. With nearly
    deterministic rows of Q the lag weights are recoverable from a sequence (EM): across 60 sequences they
    spread like Dir(1, 1, 1) (mean largest weight 11/18 ≈ 0.61, sd of a component ≈ 0.24); a generator
    that ignored λ (uniform lags) would give every sequence ≈ (1/3, 1/3, 1/3)."""
    task = MTDTask(states=16, lags=3, concentration=0.05, seed=0)
    batch = task.sample(60, 400, torch.Generator().manual_seed(1), exact=False)
    lam = _em_lag_weights(task, batch.tokens)
    assert float(lam.max(-1).values.mean()) > 0.5
    assert float(lam[:, 0].std()) > 0.15
    assert float(lam.max(-1).values.max()) > 0.8  # some sequences lean heavily on one lag
