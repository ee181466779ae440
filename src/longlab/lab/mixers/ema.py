"""An exponential-moving-average memory, the TAPTRv2-like baseline of TAPTRv3's VLTA (Qu et al., arXiv
2411.18671, ICLR 2026: TAPTRv2 keeps its point query's content feature by an RNN-like update, whose
features drift over long videos) [recon]::

    m_t = a ⊙ m_{t−1} + (1 − a) ⊙ (W_in x_t),    y_t = W_out m_t,    a = σ(λ) per channel (learned)

``m_0 = 0``. The decay does not depend on the input: every frame, occluded or not, enters the memory
(no positions: the recurrence orders the frames). Per-channel decays start spread from 0.5 to 0.999
(time constants 2 to 1000 frames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..positions import Positions
from .base import MixerConfig, MixerModule, register_mixer

__all__ = ["EMAMemory", "EMAConfig"]


class EMAMemory(MixerModule):
    """``x: [B, T, D]`` -> ``y: [B, T, D]`` by the per-channel EMA recurrence (a sequential scan)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        decay = torch.linspace(math.log(0.5), math.log(0.999), dim).exp()  # [D] a at init
        self.logit = nn.Parameter(torch.log(decay / (1 - decay)))  # λ = logit(a)

    def decay(self) -> torch.Tensor:
        return torch.sigmoid(self.logit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.decay()
        u = (1 - a) * self.inp(x)  # [B, T, D]
        m = x.new_zeros(x.shape[0], x.shape[2])
        out = []
        for t in range(x.shape[1]):
            m = a * m + u[:, t]
            out.append(m)
        return self.out(torch.stack(out, dim=1))

    def init_state(self, batch: int) -> dict[str, Any]:
        return {"m": None}

    def step(self, x: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        a = self.decay()
        u = (1 - a) * self.inp(x[:, 0])
        m = u if state["m"] is None else a * state["m"] + u
        return self.out(m)[:, None], {"m": m}


@register_mixer("ema")
@dataclass
class EMAConfig(MixerConfig):
    """Per-channel EMA memory with learned input-independent decays (TAPTRv2-like RNN baseline of VLTA)."""

    paper = "Qu et al., TAPTRv3 (arXiv 2411.18671): the TAPTRv2-like RNN baseline [recon]"
    positions_allowed = ("nope",)
    default_positions = "nope"

    def build(self, dim: int, n_heads: int, positions: Positions) -> EMAMemory:
        return EMAMemory(dim)
