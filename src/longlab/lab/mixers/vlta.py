"""TAPTRv3's Visibility-aware Long-Temporal Attention, VLTA (Qu, Li, Liu, Ren, Zeng, Zhang, "TAPTRv3",
arXiv 2411.18671, ICLR 2026) [abs + recon]: the point query attends to its features in **all** past
frames with RoPE over time, each frame weighted by its visibility::

    a_ij = softmax_j( q_iᵀ R_{i−j} k_j / √d + log(v_j + ε) ),  j ≤ i,     out_i = Σ_j a_ij · val_j

``v_j = σ(wᵀ x_j + b)``: a visibility per frame (shared by the heads), predicted from the frame's own
input by a learned linear head (the lab's tasks put the observed visibility among the inputs, so the
head can read it), ``ε = 1e-6``. Since ``exp(z + log v) = v·e^z``, the weights are the causal softmax
weights multiplied by ``v_j`` and renormalised: an invisible frame (``v_j = 0``) gets weight ``~ε``, and
``v ≡ 1`` is plain causal attention. Frame ``i`` itself is among the keys (the query predicts the next
frame). It replaces TAPTRv2's RNN-like update, whose features drift (the ``ema`` mixer is that baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import AttnMixer, MixerConfig, _check_float, _check_int, register_mixer

__all__ = ["VLTA", "VLTAConfig"]


class VLTA(AttnMixer):
    """Causal attention with the additive visibility bias ``log(v_j + ε)`` on key ``j``."""

    def __init__(self, dim: int, n_heads: int, positions: Positions, row_chunk: int = 256,
                 eps: float = 1e-6) -> None:
        super().__init__(dim, n_heads, positions, row_chunk)
        self.eps = float(eps)
        self.vis = nn.Linear(dim, 1)  # visibility logit of each frame
        self._logv: torch.Tensor | None = None  # [B, Tk] log(v + ε) of the keys of the current call
        self.last_visibility: torch.Tensor | None = None  # [B, T] v of the last forward (inspection)

    def visibility(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, D]`` -> ``v: [B, T]`` in (0, 1)."""
        return torch.sigmoid(self.vis(x)[..., 0])

    def weights(self, scores, valid, q_pos, xq):  # scores: [B, H, Tq, Tk] (masked: NEG)
        assert self._logv is not None
        bias = self._logv[:, None, None, : scores.shape[-1]]  # keys 0 .. Tk−1 (no window: lo = 0)
        return torch.softmax(scores + bias.to(scores.dtype), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.visibility(x)
        self.last_visibility = v.detach()
        self._logv = torch.log(v + self.eps)
        try:
            return super().forward(x)
        finally:
            self._logv = None

    def init_state(self, batch: int) -> dict[str, Any]:
        return {"k": None, "v": None, "t": 0, "logv": None}

    def step(self, x: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        logv = torch.log(self.visibility(x) + self.eps)  # [B, 1]
        cache = logv if state["logv"] is None else torch.cat([state["logv"], logv], dim=1)
        self._logv = cache
        try:
            y, new = super().step(x, {k: state[k] for k in ("k", "v", "t")})
        finally:
            self._logv = None
        new["logv"] = cache
        return y, new


@register_mixer("vlta")
@dataclass
class VLTAConfig(MixerConfig):
    """TAPTRv3's visibility-aware long-temporal attention: causal softmax + ``log(v_j + ε)`` per key."""

    paper = "Qu et al., TAPTRv3 (arXiv 2411.18671, ICLR 2026)"
    eps: float = param(1e-6, low=0, high=1, low_open=True)
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_float(self.name, "eps", self.eps, 0.0, strict=True)
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> VLTA:
        return VLTA(dim, n_heads, positions, self.row_chunk, self.eps)
