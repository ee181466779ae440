"""MInference 1.0 patterns: A-shape, vertical-slash and block-sparse top-k.

Jiang et al., "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse
Attention", NeurIPS 2024 (arXiv 2407.02490). The A-shape pattern is StreamingLLM's sink + window
(Xiao et al., ICLR 2024). MInference executes verticals as gathered columns; here every pattern is
converted to the blocks that contain it, so the executor stays one block-sparse kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longlab.recipe import register
from longlab.registry import MAX_BLOCK, MAX_TOKENS, param
from longlab.sparse.base import (
    BlockSelector,
    last_rows_attention,
    mean_pool,
    repeat_kv,
    slash_sums,
)
from longlab.sparse.blockmask import block_geometry, causal_allowed
from longlab.sparse.prefill import BACKENDS

__all__ = ["AShape", "VerticalSlash", "BlockTopK", "columns_to_blocks", "slashes_to_blocks"]


def columns_to_blocks(cols: torch.Tensor, q_len: int, bq: int, bk: int) -> torch.Tensor:
    """k-blocks holding a selected key column, for every q-block (causality is applied later).

    cols: [B, H, T_k] bool -> [B, H, n_qb, n_kb] bool
    """
    B, H, T_k = cols.shape
    n_kb = -(-T_k // bk)
    per_kb = torch.nn.functional.pad(cols, (0, n_kb * bk - T_k)).view(B, H, n_kb, bk).any(-1)  # [B, H, n_kb]
    n_qb = -(-q_len // bq)
    return per_kb[:, :, None, :].expand(B, H, n_qb, n_kb)


def slashes_to_blocks(offsets: torch.Tensor, q_len: int, bq: int, bk: int) -> torch.Tensor:
    """Blocks that contain a causal (query, key) pair on a selected diagonal ``o = pos_q - pos_k``.

    Block (i, j) holds the offsets ``[max(0, q_first_i - k_last_j), q_last_i - k_first_j]``; a prefix sum over
    the selected offsets answers each block with two lookups. offsets: [B, H, T_k] bool (index = offset)
    -> [B, H, n_qb, n_kb] bool
    """
    B, H, T_k = offsets.shape
    g = block_geometry(q_len, T_k, bq, bk, offsets.device)
    csum = torch.nn.functional.pad(offsets.to(torch.int32).cumsum(-1), (1, 0))  # [B, H, T_k + 1]
    hi = g.q_last[:, None] - g.k_first[None, :]  # [n_qb, n_kb]
    lo = torch.clamp(g.q_first[:, None] - g.k_last[None, :], min=0)
    valid = hi >= 0
    hi_c = hi.clamp(0, T_k - 1)
    lo_c = torch.minimum(lo, hi_c)
    n_qb, n_kb = hi.shape
    flat_hi = (hi_c + 1).reshape(1, 1, -1).expand(B, H, -1)
    flat_lo = lo_c.reshape(1, 1, -1).expand(B, H, -1)
    count = csum.gather(-1, flat_hi) - csum.gather(-1, flat_lo)  # [B, H, n_qb * n_kb]
    return (count > 0).view(B, H, n_qb, n_kb) & valid


@register("ashape")
@dataclass
class AShape(BlockSelector):
    """A-shape (sink + local window), MInference 1.0 (Jiang et al., NeurIPS'24, arXiv 2407.02490).

    StreamingLLM's pattern (Xiao et al., arXiv 2309.17453).

    Static pattern: query at position p sees keys ``j < n_sink`` and ``p - n_local < j <= p``. In blocks,
    q-block i keeps k-block j iff ``k_first_j < n_sink`` or the key range of j intersects
    ``[q_first_i - n_local + 1, q_last_i]``.
    """

    paper = "arXiv:2407.02490"
    bq: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    n_sink: int = param(128, low=0, high=MAX_TOKENS, integer=True)
    n_local: int = param(2048, low=1, high=MAX_TOKENS, integer=True)
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, T_q = q.shape[:3]
        g = block_geometry(T_q, k.shape[2], self.bq, self.bk, q.device)
        sink = g.k_first[None, :] < self.n_sink  # [1, n_kb]
        local = g.k_last[None, :] >= g.q_first[:, None] - self.n_local + 1  # [n_qb, n_kb]
        return (sink | local).expand(B, H, -1, -1)


@register("vslash")
@dataclass
class VerticalSlash(BlockSelector):
    """Vertical-slash pattern, MInference 1.0 (Jiang et al., NeurIPS'24, arXiv 2407.02490).

    With the last ``L = last_q`` queries: ``A = softmax(Q[-L:] K^T s)`` (causal); vertical score
    ``v_j = sum_i A_ij``; slash score ``s_o = sum_{i} A_{i, pos_i - o}`` (diagonal at offset o). The first
    ``n_forced_vertical`` columns and the last ``n_forced_slash`` diagonals (offsets nearest the main
    diagonal) are forced (+inf). Keep the top ``vertical_size`` columns and top ``slash_size`` diagonals;
    a block is selected iff it contains a selected column or a causal pair on a selected diagonal.
    Defaults (100, 750) are one of MInference's search candidates; (1000, 6096) is its fallback config.
    """

    paper = "arXiv:2407.02490"
    bq: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    vertical_size: int = param(100, low=1, high=MAX_TOKENS, integer=True)
    slash_size: int = param(750, low=1, high=MAX_TOKENS, integer=True)
    last_q: int = param(64, low=1, high=MAX_TOKENS, integer=True)
    n_forced_vertical: int = param(30, low=0, high=MAX_TOKENS, integer=True)
    n_forced_slash: int = param(100, low=0, high=MAX_TOKENS, integer=True)
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def scores(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Vertical and slash scores (without forcing). -> ([B, H, T_k], [B, H, T_k] indexed by offset)"""
        T_k = k.shape[2]
        L = min(self.last_q, q.shape[2])
        a = last_rows_attention(q[:, :, -L:], k, scaling, T_k)  # [B, H, L, T_k]
        return a.sum(2), slash_sums(a, T_k)

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        T_q, T_k = q.shape[2], k.shape[2]
        vertical, slash = self.scores(q, k, scaling)
        vertical[..., : self.n_forced_vertical] = float("inf")
        slash[..., : self.n_forced_slash] = float("inf")
        v_top = vertical.topk(min(self.vertical_size, T_k), dim=-1).indices
        s_top = slash.topk(min(self.slash_size, T_k), dim=-1).indices
        cols = torch.zeros_like(vertical, dtype=torch.bool).scatter_(-1, v_top, True)  # [B, H, T_k]
        offs = torch.zeros_like(slash, dtype=torch.bool).scatter_(-1, s_top, True)  # [B, H, T_k]
        return columns_to_blocks(cols, T_q, self.bq, self.bk) | slashes_to_blocks(offs, T_q, self.bq, self.bk)


@register("blocktopk")
@dataclass
class BlockTopK(BlockSelector):
    """Block-sparse pattern, MInference 1.0 (Jiang et al., NeurIPS'24, arXiv 2407.02490).

    Mean-pool Q and K into blocks, score ``S = pool(Q) pool(K)^T s`` (block-causal), keep the ``top_k``
    highest-scoring k-blocks per q-block (MInference: 64-token blocks, top-100).
    """

    paper = "arXiv:2407.02490"
    bq: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    top_k: int = param(100, low=1, high=MAX_TOKENS, integer=True)  # k-blocks kept per q-block
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        T_q, T_k = q.shape[2], k.shape[2]
        qp = mean_pool(q, self.bq)  # [B, H, n_qb, D]
        kp = repeat_kv(mean_pool(k, self.bk), q.shape[1])  # [B, H, n_kb, D]
        s = (qp @ kp.transpose(-1, -2)) * scaling  # [B, H, n_qb, n_kb]
        allowed = causal_allowed(T_q, T_k, self.bq, self.bk, q.device)
        s = s.masked_fill(~allowed, float("-inf"))
        top = s.topk(min(self.top_k, s.shape[-1]), dim=-1).indices
        return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True) & allowed
