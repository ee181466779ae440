"""FlexPrefill: context-aware sparse prefill with a per-head pattern choice.

Lai et al., "FlexPrefill: A Context-Aware Sparse Attention Mechanism for Efficient Long-Sequence
Inference", ICLR 2025 (arXiv 2502.20766).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longlab.recipe import register
from longlab.registry import MAX_BLOCK, MAX_TOKENS, param
from longlab.sparse.base import (
    BlockSelector,
    keep_by_cumulative_mass,
    last_rows_attention,
    mean_pool,
    repeat_kv,
    slash_sums,
)
from longlab.sparse.blockmask import block_geometry, causal_allowed
from longlab.sparse.prefill import BACKENDS

__all__ = ["FlexPrefill", "js_distance"]


def js_distance(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """sqrt of the Jensen-Shannon divergence (natural log) along the last dim. [..., N] -> [...]"""
    p = p / p.sum(-1, keepdim=True).clamp_min(eps)
    q = q / q.sum(-1, keepdim=True).clamp_min(eps)
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * (a.clamp_min(eps).log() - b.clamp_min(eps).log())).sum(-1)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp_min(0).sqrt()


def _sum_pool(x: torch.Tensor, b: int) -> torch.Tensor:
    # x: [B, H, T] -> [B, H, ceil(T / b)]
    T = x.shape[-1]
    n = -(-T // b)
    return F.pad(x, (0, n * b - T)).view(*x.shape[:-1], n, b).sum(-1)


def _top_n_per_head(scores: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    # scores: [B, H, N], n: [B, H] -> [B, H, N] bool, the n highest entries of each row
    order = scores.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                                            .expand_as(order))
    return rank < n[..., None]


@register("flexprefill")
@dataclass
class FlexPrefill(BlockSelector):
    """FlexPrefill (Lai et al., ICLR'25, arXiv 2502.20766): JS-divergence pattern choice, cumulative budgets.

    With the last block of queries ``q̂`` (``bq`` rows): ``A = softmax(q̂ K^T s)`` (causal),
    ``a_v = mean_rows(A)``, ``a_s = diagonal sums / bq``. Budgets ``n_v = floor(cover_γ(a_v) / bk) + 1`` and
    ``n_s`` likewise (cover_γ = fewest top entries with mass >= γ), clamped to
    ``[min_budget, max_budget] / bk``. Pattern: ``â = softmax(mean(q̂) pool(K)^T s)``,
    ``D = sqrt(JS(â, sumpool(a_v)))``. If ``D < tau`` the head is query-aware: ``n_v = n_s = min`` and add the
    blocks of ``Ā = rowsoftmax(pool(Q) pool(K)^T s)`` (block-causal) in descending order until their mass
    reaches ``γ · n_qb``. Otherwise keep the top-``n_v`` vertical blocks (whole columns) and top-``n_s``
    block diagonals of the sum-pooled scores. Block 0 and the diagonal are always kept.
    """

    paper = "arXiv:2502.20766"
    bq: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    gamma: float = param(0.9, low=0, high=1, low_open=True)  # cumulative attention mass to cover
    # threshold on a Jensen-Shannon distance, which lies in [0, sqrt(ln 2)] ~ [0, 0.833]: beyond 1 every head
    # is query-aware
    tau: float = param(0.1, low=0, high=1)
    min_budget: int = param(1024, low=0, high=MAX_TOKENS, integer=True)  # tokens
    max_budget: int | None = param(None, low=1, high=MAX_TOKENS, integer=True)  # >= min_budget (below)
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def validate(self) -> None:
        super().validate()
        if self.max_budget is not None:
            self.check("max_budget", max(1, self.min_budget), integer=True)

    def pattern_distance(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        """JS distance between pooled-estimate and true vertical block distribution per head. -> [B, H]"""
        return self._estimate(q, k, scaling)[2]

    def _estimate(
        self, q: torch.Tensor, k: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T_k = k.shape[2]
        L = min(self.bq, q.shape[2])
        q_hat = q[:, :, -L:]  # [B, H, L, D]
        a = last_rows_attention(q_hat, k, scaling, T_k)  # [B, H, L, T_k]
        a_v = a.mean(2)  # [B, H, T_k]
        a_s = slash_sums(a, T_k) / L  # [B, H, T_k] by offset
        k_pool = repeat_kv(mean_pool(k, self.bk), q.shape[1])  # [B, H, n_kb, D]
        a_hat = torch.softmax((q_hat.float().mean(2, keepdim=True) @ k_pool.transpose(-1, -2)).squeeze(2)
                              * scaling, dim=-1)  # [B, H, n_kb]
        dist = js_distance(a_hat, _sum_pool(a_v, self.bk))  # [B, H]
        return a_v, a_s, dist

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, T_q = q.shape[:3]
        T_k = k.shape[2]
        n_kb = -(-T_k // self.bk)
        a_v, a_s, dist = self._estimate(q, k, scaling)
        min_blocks = max(1, self.min_budget // self.bk)
        max_blocks = n_kb if self.max_budget is None else max(min_blocks, self.max_budget // self.bk)

        def budget(a: torch.Tensor) -> torch.Tensor:  # [B, H, T_k] -> [B, H] blocks
            cover = keep_by_cumulative_mass(a, self.gamma * a.sum(-1, keepdim=True)).sum(-1)
            return (cover // self.bk + 1).clamp(min_blocks, max_blocks)

        query_aware = dist < self.tau  # [B, H]
        n_min = torch.full_like(dist, min_blocks, dtype=torch.long)
        n_v = torch.where(query_aware, n_min, budget(a_v))
        n_s = torch.where(query_aware, n_min, budget(a_s))
        v_blocks = _top_n_per_head(_sum_pool(a_v, self.bk), n_v)  # [B, H, n_kb]
        s_blocks = _top_n_per_head(_sum_pool(a_s, self.bk), n_s)  # [B, H, n_kb] by block offset d
        v_blocks[..., 0] = True
        s_blocks[..., 0] = True
        g = block_geometry(T_q, T_k, self.bq, self.bk, q.device)
        d = (g.q_last // self.bk)[:, None] - torch.arange(n_kb, device=q.device)[None, :]  # [n_qb, n_kb]
        n_qb = d.shape[0]
        slash = s_blocks.gather(-1, d.clamp(min=0).reshape(1, 1, -1).expand(B, H, -1)).view(B, H, n_qb, n_kb)
        out = (slash & (d >= 0)) | v_blocks[:, :, None, :]
        if bool(query_aware.any()):
            allowed = causal_allowed(T_q, T_k, self.bq, self.bk, q.device)
            q_pool = mean_pool(q, self.bq)  # [B, H, n_qb, D]
            k_pool = repeat_kv(mean_pool(k, self.bk), H)  # [B, H, n_kb, D]
            logits = (q_pool @ k_pool.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
            a_bar = torch.softmax(logits, dim=-1).flatten(2)  # [B, H, n_qb * n_kb]
            qa_blocks = keep_by_cumulative_mass(a_bar, self.gamma * n_qb).view(B, H, n_qb, n_kb)
            out = out | (qa_blocks & query_aware[:, :, None, None])
        return out
