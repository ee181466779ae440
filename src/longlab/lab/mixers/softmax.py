"""Softmax attention and its length-scaled variants.

- ``softmax``: scaled dot-product attention (Vaswani et al. 2017), computed with
  ``torch.nn.functional.scaled_dot_product_attention`` per row chunk: the reference.
- ``ssmax``: Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399),
  ``SSMax(z)_i = n^{s z_i} / Σ_j n^{s z_j} = softmax((s·log n)·z)``, with a learnable scalar ``s`` per
  head and ``log n = log(pos + 2)`` (pos from 0, the official code's form), applied by multiplying q.
- ``asentmax``: Adaptive-Scalable Entmax (Vasylenko et al., arXiv 2506.16640, ICLR 2026; code
  deep-spin/asentmax), ``α-entmax((δ + β·(log n)^γ)·z)`` with the query-dependent
  ``β_{h,i} = softplus(W_β h_i)``, ``γ_{h,i} = 2·tanh(W_γ h_i)``, ``δ = 1`` (``adapt-softplus-tanh``),
  ``α-entmax(z)_i = [(α−1)z_i − τ]_+^{1/(α−1)}`` from the ``entmax`` package; α = 1 is softmax.

With ``nape`` positions the length scale multiplies only the NoPE heads (as in the paper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...registry import param
from ..positions import Positions, log_length
from .base import NEG, AttnMixer, MixerConfig, _check_float, _check_int, register_mixer

__all__ = ["ASEntmax", "ASEntmaxConfig", "SSMax", "SSMaxConfig", "Softmax", "SoftmaxConfig"]


class Softmax(AttnMixer):
    """``out_i = Σ_j softmax_j(q_i·k_j/√d + bias_ij) v_j`` over ``j ≤ i`` (SDPA per row chunk)."""

    use_sdpa = True

    def weights(self, scores, valid, q_pos, xq):  # scores: [B, H, Tq, Tk]
        return torch.softmax(scores, dim=-1)

    def attend(self, q, k, v, q_pos, k_pos, xq, window=None):
        if not self.use_sdpa:
            return super().attend(q, k, v, q_pos, k_pos, xq, window)
        q, k = self.prepare(q, k, q_pos, xq)
        outs = []
        for s in range(0, q.shape[2], self.row_chunk):
            e = min(s + self.row_chunk, q.shape[2])
            qp = q_pos[s:e]
            lo, hi = self.key_range(qp, k_pos, window)
            kp = k_pos[lo:hi]
            mask = self.visible(qp, kp, window)  # [Tq, Tk] bool
            bias = self.positions.bias(qp, kp)
            # a float mask must have q's dtype: SDPA (torch 2.13, CPU) misreads a float32 mask with float64 q
            attn_mask = mask if bias is None else bias.to(q.dtype).masked_fill(~mask, NEG)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=attn_mask,
                    scale=self.score_scale(),
                )
            )
        return torch.cat(outs, dim=2)


@register_mixer("softmax")
@dataclass
class SoftmaxConfig(MixerConfig):
    """Softmax attention, the reference (SDPA)."""

    paper = "Vaswani et al. 2017, Attention Is All You Need (arXiv 1706.03762)"
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> Softmax:
        return Softmax(dim, n_heads, positions, self.row_chunk)


class _LengthScaled(Softmax):
    """Softmax/entmax attention whose queries are multiplied by a per-row length scale."""

    def length_scale(self, q_pos: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, q, k, q_pos, xq):
        scale = self.length_scale(q_pos, xq)  # [B or 1, H, Tq, 1]
        nope = self.positions.nope_heads.to(q.device)[None, :, None, None]
        return q * torch.where(nope, scale, torch.ones_like(scale)), k


class SSMax(_LengthScaled):
    """``softmax((s_h·log(pos+2))·z)`` (Nakanishi 2025)."""

    def __init__(self, dim, n_heads, positions, row_chunk, s_init):
        super().__init__(dim, n_heads, positions, row_chunk)
        self.s = nn.Parameter(torch.full((n_heads,), float(s_init)))

    def length_scale(self, q_pos, xq):
        return (self.s[:, None] * log_length(q_pos)[None, :])[None, :, :, None]  # [1, H, Tq, 1]


@register_mixer("ssmax")
@dataclass
class SSMaxConfig(MixerConfig):
    """Scalable-Softmax; ``s_init`` is the initial per-head ``s``."""

    paper = "Nakanishi 2025, Scalable-Softmax Is Superior for Attention (arXiv 2501.19399)"
    s_init: float = param(1.0, low=0, high=1000, low_open=True)
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_float(self.name, "s_init", self.s_init, 0.0, strict=True)
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> SSMax:
        return SSMax(dim, n_heads, positions, self.row_chunk, self.s_init)


def entmax_weights(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """α-entmax over the last dim (α = 1: softmax; 1.5: exact ``entmax15``; 2: ``sparsemax``)."""
    if alpha == 1.0:
        return torch.softmax(scores, dim=-1)
    import entmax

    if alpha == 1.5:
        return entmax.entmax15(scores, dim=-1)
    if alpha == 2.0:
        return entmax.sparsemax(scores, dim=-1)
    return entmax.entmax_bisect(scores, alpha=alpha, dim=-1)


class ASEntmax(_LengthScaled):
    """``α-entmax((1 + β_{h,i}·log(pos+2)^{γ_{h,i}})·z)`` with β, γ from the hidden state."""

    use_sdpa = False

    def __init__(self, dim, n_heads, positions, row_chunk, alpha, adaptive):
        super().__init__(dim, n_heads, positions, row_chunk)
        self.alpha = float(alpha)
        self.adaptive = bool(adaptive)
        self.w_beta = nn.Linear(dim, n_heads, bias=False)
        self.w_gamma = nn.Linear(dim, n_heads, bias=False)

    def length_scale(self, q_pos, xq):  # xq: [B, Tq, D]
        if not self.adaptive:
            return torch.ones(1, self.n_heads, q_pos.shape[0], 1, device=xq.device)
        beta = F.softplus(self.w_beta(xq)).transpose(1, 2)  # [B, H, Tq]
        gamma = 2.0 * torch.tanh(self.w_gamma(xq)).transpose(1, 2)
        return (1.0 + beta * log_length(q_pos)[None, None, :] ** gamma)[..., None]

    def weights(self, scores, valid, q_pos, xq):
        # masked entries: far below any real score but finite, so entmax's sums stay finite
        gap = 1e3 / max(self.alpha - 1.0, 1e-3)  # (α−1)·gap ≥ 1e3 below the threshold τ
        low = scores.masked_fill(~valid, math.inf).amin(dim=-1, keepdim=True) - gap
        return entmax_weights(torch.where(valid, scores, low), self.alpha)


@register_mixer("asentmax")
@dataclass
class ASEntmaxConfig(MixerConfig):
    """ASEntmax; ``alpha`` ≥ 1 (1: softmax, 1.5: default, 2: sparsemax); ``adaptive=false``: scale 1."""

    paper = "Vasylenko et al., Long-Context Generalization to Sequences... (arXiv 2506.16640, ICLR 2026)"
    default_positions = "nape"
    alpha: float = param(1.5, low=1, high=10)
    adaptive: bool = param(True, choices=(True, False))
    row_chunk: int = param(128, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_float(self.name, "alpha", self.alpha, 1.0)
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> ASEntmax:
        return ASEntmax(dim, n_heads, positions, self.row_chunk, self.alpha, self.adaptive)
