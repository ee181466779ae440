"""XAttention: block importance from strided antidiagonal sums.

Xu et al., "XAttention: Block Sparse Attention with Antidiagonal Scoring", ICML 2025 (arXiv 2503.16428).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longlab.recipe import LonglabError, register
from longlab.registry import MAX_BLOCK, MAX_TOKENS, param
from longlab.sparse.base import BlockSelector, keep_by_cumulative_mass, repeat_kv
from longlab.sparse.blockmask import causal_allowed, required_blocks
from longlab.sparse.prefill import BACKENDS

__all__ = ["XAttention", "antidiagonal_block_scores"]


def antidiagonal_block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    stride: int,
    bq: int,
    bk: int,
    chunk_q: int = 4096,
) -> torch.Tensor:
    """XAttention block scores from antidiagonal sums of ``stride x stride`` tiles.

    ``Kr_n = concat_{i<S} K[S n + i]`` and ``Qr_m = concat_{i<S} Q[S m + S - 1 - i]``, so ``Qr_m · Kr_n`` is
    the antidiagonal sum of tile (m, n). ``P = softmax(Qr Kr^T s / S)`` per row m over the causal tiles
    (``S n <= last query position of tile m``), then ``P`` is summed into (bq/S x bk/S) cells.
    Inputs are zero-padded to a multiple of S. Rows are processed ``chunk_q`` queries at a time, so
    memory is ``O(chunk_q / S * T_k / S)`` per head.

    q: [B, H, T_q, D], k: [B, H_kv, T_k, D] -> [B, H, n_qb, n_kb] float (row i sums to the number of tile
    rows in q-block i)
    """
    B, H, T_q, D = q.shape
    T_k = k.shape[2]
    S = stride
    if bq % S or bk % S:
        raise ValueError(f"bq={bq} and bk={bk} must be multiples of stride={S}")
    n_qb, n_kb = -(-T_q // bq), -(-T_k // bk)
    mq, mk = -(-T_q // S), -(-T_k // S)  # tile rows / columns
    qr = F.pad(q.float(), (0, 0, 0, mq * S - T_q)).view(B, H, mq, S, D).flip(3).reshape(B, H, mq, S * D)
    kr = F.pad(repeat_kv(k, H).float(), (0, 0, 0, mk * S - T_k)).view(B, H, mk, S * D)
    offset = T_k - T_q
    col_first = torch.arange(mk, device=q.device) * S  # first key position of each tile column
    rows_per_qb, cols_per_kb = bq // S, bk // S
    out = q.new_zeros(B, H, n_qb, n_kb, dtype=torch.float32)
    chunk_rows = max(rows_per_qb, (chunk_q // bq) * rows_per_qb)
    for m0 in range(0, mq, chunk_rows):
        m1 = min(m0 + chunk_rows, mq)
        m = torch.arange(m0, m1, device=q.device)
        last_pos = torch.clamp(m * S + S - 1, max=T_q - 1) + offset  # [rows]
        causal = col_first[None, :] <= last_pos[:, None]  # [rows, mk]
        logits = (qr[:, :, m0:m1] @ kr.transpose(-1, -2)) * (scaling / S)  # [B, H, rows, mk]
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        p = F.pad(p, (0, n_kb * cols_per_kb - mk))  # [B, H, rows, n_kb * cols_per_kb]
        p = p.view(B, H, m1 - m0, n_kb, cols_per_kb).sum(-1)  # [B, H, rows, n_kb]
        qb = m // rows_per_qb  # q-block of each tile row
        out.index_add_(2, qb, p)
    return out


@register("xattention")
@dataclass
class XAttention(BlockSelector):
    """XAttention (Xu et al., ICML'25, arXiv 2503.16428): antidiagonal block scores + cumulative threshold.

    Block scores ``A`` from :func:`antidiagonal_block_scores` (stride S). Per q-block: always keep
    k-block 0 and the diagonal; sort the other causal blocks descending and keep each while
    ``forced mass + mass of the blocks before it < tau · row total``.
    """

    paper = "arXiv:2503.16428"
    bq: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    stride: int = param(8, low=1, high=MAX_BLOCK, integer=True)  # divides bq and bk (checked below)
    tau: float = param(0.9, low=0, high=1)  # cumulative mass kept per q-block
    chunk_q: int = param(4096, low=1, high=MAX_TOKENS, integer=True)
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def validate(self) -> None:
        super().validate()
        if self.bq % self.stride or self.bk % self.stride:
            raise LonglabError(f"{self.field_label('bq')}={self.bq} and bk={self.bk} must be multiples of "
                               f"stride={self.stride}")

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        T_q, T_k = q.shape[2], k.shape[2]
        scores = antidiagonal_block_scores(q, k, scaling, self.stride, self.bq, self.bk, self.chunk_q)
        allowed = causal_allowed(T_q, T_k, self.bq, self.bk, q.device)
        forced = required_blocks(T_q, T_k, self.bq, self.bk, q.device) & allowed
        scores = scores.masked_fill(~allowed, 0.0)
        total = scores.sum(-1, keepdim=True)
        forced_mass = (scores * forced).sum(-1, keepdim=True)
        rest = scores.masked_fill(forced, 0.0)
        keep = keep_by_cumulative_mass(rest, self.tau * total, start=forced_mass)
        return (keep & allowed) | forced
