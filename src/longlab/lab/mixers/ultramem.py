"""UltraMemV2 memory layer (Huang et al., ByteDance Seed, arXiv 2508.18756), in parallel with the MLP
of every block; token mixing is softmax attention.

TDQKR (Tucker-decomposed query-key retrieval) over an ``n × n`` grid of value slots, with ``sets``
row/column key sets and Tucker rank r:

- ``S_row^{i,ρ} = K_row^{i,ρ} q_row^{i,ρ}(x) ∈ R^n`` and ``S_col^{j,σ} = K_col^{j,σ} q_col^{j,σ}(x)``
  (separate queries per key set and Tucker rank);
- implicit value expansion: every pair (i, j) is a virtual head with its own core ``C^{ij} ∈ R^{r×r}``,
  ``S^{ij}_grid[a, b] = Σ_{ρσ} S_row^{i,ρ}[a] C^{ij}_{ρσ} S_col^{j,σ}[b]`` (``sets²`` virtual heads);
- Top-M: the rank-1 SVD of ``C^{ij} = s u vᵀ`` pre-selects the ``pre`` rows with the largest
  ``|uᵀ S_row|`` and the ``pre`` columns with the largest ``|vᵀ S_col|``; the exact grid scores of those
  ``pre × pre`` candidates give the top ``top_m``, weighted by a softmax over the kept scores
  (σ_TopM; the paper's exact activation is not public here [recon]);
- value side: one value table ``V ∈ R^{n²×d_v}`` shared by all virtual heads,
  ``o^{ij} = Σ_{m ∈ TopM} ŝ_m V_m``, and a **single shared** output projection ``W`` over the
  concatenated virtual heads: ``out = W [o^{11}; …; o^{hh}]``. (The PEER-style pre-value product
  ``(P x) ⊗ ŝ`` is not modelled.) Initialisation scales ``W`` so the output variance is near an MLP's.

The decode form is the attention's KV cache (the memory acts per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import MixerConfig, _check_int, register_mixer
from .softmax import Softmax

__all__ = ["UltraMem", "UltraMemConfig", "UltraMemLayer"]


class UltraMemLayer(nn.Module):
    def __init__(
        self, dim: int, grid: int, key_dim: int, rank: int, sets: int, top_m: int, pre: int, d_v: int
    ) -> None:
        super().__init__()
        self.n, self.dk, self.r, self.h = grid, key_dim, rank, sets
        self.m, self.pre, self.dv = top_m, pre, d_v
        self.q_row = nn.Linear(dim, sets * rank * key_dim, bias=False)
        self.q_col = nn.Linear(dim, sets * rank * key_dim, bias=False)
        self.k_row = nn.Parameter(torch.randn(sets, rank, grid, key_dim) / math.sqrt(key_dim))
        self.k_col = nn.Parameter(torch.randn(sets, rank, grid, key_dim) / math.sqrt(key_dim))
        core = torch.eye(rank).repeat(sets, sets, 1, 1) + 0.01 * torch.randn(sets, sets, rank, rank)
        self.core = nn.Parameter(core)  # [h, h, r, r]
        self.values = nn.Parameter(torch.randn(grid * grid, d_v) / math.sqrt(d_v))
        self.out = nn.Linear(sets * sets * d_v, dim, bias=False)
        nn.init.normal_(self.out.weight, std=1.0 / math.sqrt(sets * sets * d_v * top_m))

    def scores(self, x: torch.Tensor):
        """x ``[B, T, D]`` -> S_row, S_col ``[B, T, h, r, n]``."""
        b, t, _ = x.shape
        qr = self.q_row(x).view(b, t, self.h, self.r, self.dk)
        qc = self.q_col(x).view(b, t, self.h, self.r, self.dk)
        s_row = torch.einsum("bthrk,hrnk->bthrn", qr, self.k_row)
        return s_row, torch.einsum("bthrk,hrnk->bthrn", qc, self.k_col)

    def grid_scores(self, s_row, s_col):
        """Exact ``S_grid`` for every virtual head: ``[B, T, h, h, n, n]`` (test oracle / small grids)."""
        return torch.einsum("btira,ijrs,btjsc->btijac", s_row, self.core, s_col)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s_row, s_col = self.scores(x)  # [B, T, h, r, n]
        with torch.no_grad():
            u, _, vh = torch.linalg.svd(self.core)  # [h, h, r, r]
            u1, v1 = u[..., :, 0], vh[..., 0, :]  # [h, h, r]
            row_approx = torch.einsum("bthrn,hjr->bthjn", s_row, u1).abs()  # [B, T, h, h, n]
            col_approx = torch.einsum("btjsn,hjs->bthjn", s_col, v1).abs()
            ri = row_approx.topk(self.pre, dim=-1).indices  # [B, T, h, h, pre]
            ci = col_approx.topk(self.pre, dim=-1).indices
        # candidate row scores [B, T, h(i), h(j), r, pre] and column scores
        sr = s_row[:, :, :, None].expand(-1, -1, -1, self.h, -1, -1)  # [B, T, i, j, r, n]
        sc = s_col[:, :, None].expand(-1, -1, self.h, -1, -1, -1)  # [B, T, i, j, r, n]
        sr = sr.gather(-1, ri[..., None, :].expand(-1, -1, -1, -1, self.r, -1))
        sc = sc.gather(-1, ci[..., None, :].expand(-1, -1, -1, -1, self.r, -1))
        cand = torch.einsum("btijra,ijrs,btijsc->btijac", sr, self.core, sc)  # [B, T, h, h, pre, pre]
        flat = cand.flatten(-2)
        top, arg = flat.topk(self.m, dim=-1)  # [B, T, h, h, M]
        rows = ri.gather(-1, arg // self.pre)
        cols = ci.gather(-1, arg % self.pre)
        slot = rows * self.n + cols  # value index in the n×n grid
        w = torch.softmax(top, dim=-1)
        vals = self.values[slot]  # [B, T, h, h, M, d_v]
        o = (w[..., None] * vals).sum(-2)  # [B, T, h, h, d_v]
        return self.out(o.reshape(b, t, -1))


class UltraMem(Softmax):
    def __init__(self, dim, n_heads, positions, row_chunk, mem: UltraMemLayer):
        super().__init__(dim, n_heads, positions, row_chunk)
        self.parallel_ffn = mem


@register_mixer("ultramem")
@dataclass
class UltraMemConfig(MixerConfig):
    """Softmax attention + an UltraMemV2 memory in parallel with each MLP (grid ``grid``², Tucker
    ``rank``, ``sets``² virtual heads, ``top_m`` slots from ``pre``×``pre`` candidates, value dim ``d_v``)."""

    paper = "Huang et al., UltraMemV2 (arXiv 2508.18756)"
    grid: int = param(16, low=1, high=4096, integer=True)
    key_dim: int = param(16, low=1, high=4096, integer=True)
    rank: int = param(2, low=1, high=64, integer=True)
    sets: int = param(2, low=1, high=64, integer=True)
    top_m: int = param(16, low=1, high=4096, integer=True)
    pre: int = param(8, low=1, high=4096, integer=True)
    d_v: int = param(16, low=1, high=4096, integer=True)
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        for f in ("grid", "key_dim", "rank", "sets", "top_m", "pre", "d_v", "row_chunk"):
            _check_int(self.name, f, getattr(self, f), 1)
        if self.pre > self.grid or self.top_m > self.pre * self.pre:
            from ...recipe import LonglabError

            raise LonglabError(
                f"mixer ultramem: need pre <= grid and top_m <= pre², got pre={self.pre}, grid={self.grid}, "
                f"top_m={self.top_m}"
            )

    def build(self, dim: int, n_heads: int, positions: Positions) -> UltraMem:
        mem = UltraMemLayer(
            dim, self.grid, self.key_dim, self.rank, self.sets, self.top_m, self.pre, self.d_v
        )
        return UltraMem(dim, n_heads, positions, self.row_chunk, mem)
