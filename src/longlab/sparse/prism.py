"""Prism: block selection from separate high- and low-RoPE-frequency bands.

Wang et al., "Prism" (arXiv 2602.08426; code xinghaow99/prism). Mean-pooling a block of RoPE'd
vectors multiplies rotary pair i (frequency ``theta_i = base^(-2i/D)``) by ``|sum_t e^(i theta_i t)| / b``,
which vanishes for high frequencies, so pooled scores lose the positional ("slash") signal. Prism scores
the two bands separately and re-scales each with an energy-based temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longlab.recipe import register
from longlab.registry import MAX_BLOCK, param
from longlab.sparse.base import (
    BlockSelector,
    keep_by_cumulative_mass,
    mean_pool,
    repeat_kv,
)
from longlab.sparse.blockmask import causal_allowed
from longlab.sparse.prefill import BACKENDS

__all__ = ["Prism", "band_dims"]


def band_dims(
    D: int, high_frac: float = 0.5, low_start_frac: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices of the high- and low-frequency bands in the rotate-half RoPE layout.

    Rotary pair i is channels (i, i + D/2); small i = high frequency. The high band is pairs
    ``[0, round(high_frac * D/2))``, the low band pairs ``[round(low_start_frac * D/2), D/2)``. For D=128 with
    the defaults: high = [0:32) ∪ [64:96), low = [16:64) ∪ [80:128) (Prism's HIGH_FREQ_DIM=64,
    LOW_FREQ_DIM=96); for D=64: high = [0:16) ∪ [32:48), low = [8:32) ∪ [40:64).
    -> (high [d_h] int64, low [d_l] int64)
    """
    if D % 2:
        raise ValueError(f"head_dim D={D} must be even for rotate-half RoPE")
    half = D // 2
    h_end = round(high_frac * half)
    l_start = round(low_start_frac * half)
    if not 1 <= h_end <= half or not 0 <= l_start < half:
        raise ValueError(f"empty band for D={D}: high pairs [0, {h_end}), low pairs [{l_start}, {half})")
    high = torch.cat([torch.arange(0, h_end), torch.arange(half, half + h_end)])
    low = torch.cat([torch.arange(l_start, half), torch.arange(half + l_start, D)])
    return high, low


def _rms(x: torch.Tensor) -> torch.Tensor:
    # x: [B, H, n, d] -> [B, H, 1, 1], root mean square over blocks and channels
    return x.pow(2).mean(dim=(-1, -2), keepdim=True).sqrt().clamp_min(1e-12)


@register("prism")
@dataclass
class Prism(BlockSelector):
    """Prism (Wang et al., arXiv 2602.08426): per-band pooled scores with energy temperatures, top-p.

    ``Q̄, K̄`` = mean-pooled blocks, split into high band (h) and low band (l) channels (:func:`band_dims`,
    rotate-half layout, derived from D). Temperature per (batch, head):
    ``t_x = sqrt(d_x / D) · rms(Q̄_x)/rms(Q̄) · rms(K̄_x)/rms(K̄)`` (1 when ``calibrate=False``).
    Logits ``S_x = Q̄_x K̄_x^T / (sqrt(d_x) · t_x)`` (block-causal), ``P_x = softmax(S_x)`` row-wise; keep
    block j of a row while ``(cumsum - p_j) < thr_x`` in descending order (top-p). Mask =
    ``M_h ∪ M_l ∪ sink column ∪ diagonal``. Defaults: 128-token blocks, thr = 0.95 (RULER setting).
    The model's ``scaling`` is not used: each band is scaled by ``1 / sqrt(d_x)`` as in the paper.
    """

    paper = "arXiv:2602.08426"
    bq: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(128, low=1, high=MAX_BLOCK, integer=True)
    thr_high: float = param(0.95, low=0, high=1)  # top-p mass of each band
    thr_low: float = param(0.95, low=0, high=1)
    high_frac: float = param(0.5, low=0, high=1, low_open=True)  # fractions of the rotary pairs
    low_start_frac: float = param(0.25, low=0, high=1, high_open=True)
    calibrate: bool = param(True, choices=(True, False))
    backend: str = param("auto", choices=BACKENDS)  # the executor backend (last field: see SparsePrefill)

    def band_probs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-softmaxed block scores of the two bands. q: [B, H, T_q, D], k: [B, H_kv, T_k, D]
        -> (P_high, P_low), each [B, H, n_qb, n_kb] (zero on blocks above the causal diagonal)"""
        T_q, T_k, D = q.shape[2], k.shape[2], q.shape[3]
        high, low = band_dims(D, self.high_frac, self.low_start_frac)
        q_pool = mean_pool(q, self.bq)  # [B, H, n_qb, D]
        k_pool = repeat_kv(mean_pool(k, self.bk), q.shape[1])  # [B, H, n_kb, D]
        allowed = causal_allowed(T_q, T_k, self.bq, self.bk, q.device)
        out = []
        for dims in (high, low):
            dims = dims.to(q.device)
            qb, kb = q_pool[..., dims], k_pool[..., dims]
            d_x = dims.numel()
            t = torch.ones(1, device=q.device)
            if self.calibrate:
                t = (d_x / D) ** 0.5 * (_rms(qb) / _rms(q_pool)) * (_rms(kb) / _rms(k_pool))
            logits = (qb @ kb.transpose(-1, -2)) / (d_x**0.5 * t)  # [B, H, n_qb, n_kb]
            out.append(torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1))
        return out[0], out[1]

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        p_high, p_low = self.band_probs(q, k)
        return keep_by_cumulative_mass(p_high, self.thr_high) | keep_by_cumulative_mass(p_low, self.thr_low)
