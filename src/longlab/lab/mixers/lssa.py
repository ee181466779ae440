"""LSSA and LSSAR: softplus attention with re-weighting (Gao & Spratling, arXiv 2501.13428, ICML 2026;
code iminfine/freeattn).

LSSA (normalisation stage), per head, after positions:
``q̂ = q/‖q‖, k̂ = k/‖k‖``; ``S_ij = (log d · log N_i)·q̂_i·k̂_j``; ``A = Softplus(S) ⊙ M'`` (multiplicative
causal 0/1 mask); ``A_i ← A_i/(‖A_i‖₁ + ε)``, ε = 1e-8. ``N_i = i`` keys visible to query i (from 1).

LSSAR (re-weighting stage): ``A ← ReLU(A·N_i − O_i)^p`` with ``O_i = 1`` except the first 3 rows
(``O = 0``), then L1-normalise again and ``out = A V``. Default ``p = 15``. A uniform row ``1/N_i`` maps to
0, so only above-uniform weights survive; ``p → ∞`` tends to argmax. ``shift=false`` sets ``O = 0``
everywhere: with ``p = 1`` LSSAR is then exactly LSSA.

Row-chunked: each chunk of query rows holds its full key range, so the row's L1 sum is known before
the power (the "two passes" the paper notes), and memory is ``row_chunk × T`` per head, never ``T × T``.
The power is taken of ``x / max_row(x)`` (the renormalisation cancels the factor), so ``N_i^15`` never
overflows (ε then acts on the max-normalised row, a difference of order ε). An ALiBi/NAPE bias is
added to ``S`` before the softplus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...registry import param
from ..positions import Positions
from .base import AttnMixer, MixerConfig, _check_float, _check_int, register_mixer

__all__ = ["LSSA", "LSSAConfig", "LSSARConfig"]

EPS = 1e-8


class LSSA(AttnMixer):
    def __init__(self, dim, n_heads, positions, row_chunk, p: float | None, shift: bool, free_rows: int):
        super().__init__(dim, n_heads, positions, row_chunk)
        self.p = p  # None: LSSA (no re-weighting)
        self.shift = bool(shift)
        self.free_rows = int(free_rows)

    def prepare(self, q, k, q_pos, xq):
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1)

    def score_scale(self) -> float:
        return 1.0  # the row scale log d · log N_i is applied in weights()

    def weights(self, scores, valid, q_pos, xq):  # scores: [B, H, Tq, Tk] = q̂·k̂ (+ bias)
        n = (q_pos + 1).to(scores.dtype)  # N_i, from 1
        scale = (math.log(self.head_dim) * torch.log(n))[None, None, :, None]
        a = F.softplus(scores * scale) * valid.to(scores.dtype)  # multiplicative causal mask
        a = a / (a.sum(dim=-1, keepdim=True) + EPS)
        if self.p is None:
            return a
        offset = torch.ones_like(n) if self.shift else torch.zeros_like(n)
        if self.shift:
            offset = torch.where(q_pos < self.free_rows, torch.zeros_like(n), offset)
        a = F.relu(a * n[None, None, :, None] - offset[None, None, :, None])
        a = a / a.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
        a = a.pow(self.p)
        return a / (a.sum(dim=-1, keepdim=True) + EPS)


@register_mixer("lssa")
@dataclass
class LSSAConfig(MixerConfig):
    """LSSA: softplus + L1 with the ``log d · log N_i`` scale."""

    paper = "Gao & Spratling, arXiv 2501.13428 (ICML 2026)"
    row_chunk: int = param(128, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> LSSA:
        return LSSA(dim, n_heads, positions, self.row_chunk, None, False, 0)


@register_mixer("lssar")
@dataclass
class LSSARConfig(MixerConfig):
    """LSSAR: LSSA then ``ReLU(A·N − O)^p`` re-weighting; ``p`` > 0 (default 15)."""

    paper = "Gao & Spratling, arXiv 2501.13428 (ICML 2026)"
    p: float = param(15.0, low=0, high=1000, low_open=True)
    shift: bool = param(True, choices=(True, False))
    free_rows: int = param(3, low=0, high=1 << 16, integer=True)
    row_chunk: int = param(128, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_float(self.name, "p", self.p, 0.0, strict=True)
        _check_int(self.name, "free_rows", self.free_rows, 0)
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> LSSA:
        return LSSA(dim, n_heads, positions, self.row_chunk, float(self.p), self.shift, self.free_rows)
