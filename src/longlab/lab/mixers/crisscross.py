"""MEG-XL's criss-cross attention (Jayalath & Parker Jones, "MEG-XL", arXiv 2602.02494, ICML 2026; code
neural-processing-lab/MEG-XL), the encoder mixer of the layers lab's masked-pretraining task ``meg``.

The input is a channels × time grid of tokens, flattened time-major: token ``t·C + c`` is channel ``c`` at
time step ``t`` (``x: [B, T·C, D]``). Each block splits the features in half [code]:

- **time attention** on features ``[0, D/2)``: within each channel, over all time steps (bidirectional),
  ``H/2`` heads of size ``D/H``, RoPE over the time index (the lab's positions; ``nope`` turns it off);
- **channel attention** on features ``[D/2, D)``: within each time step, over the ``C`` channels
  (bidirectional), ``H/2`` heads, no positions (channel identity comes from the tokens: the ``meg`` task
  gives every channel its own code ids, the lab's stand-in for the sensor embedding);

``out = concat(time_attn(x[..., :D/2]), chan_attn(x[..., D/2:]))``; each attention has its own q/k/v and
output projections, and the lab's pre-RMSNorm SwiGLU FFN follows (as MEG-XL's block). The mixer is not
causal (``causal = False``): it is trained by masked prediction, not next-token prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...recipe import LonglabError
from ...registry import param
from ..positions import Positions
from .base import MixerConfig, MixerModule, _check_int, register_mixer

__all__ = ["CrissCross", "CrissCrossConfig"]


class _HalfAttention(nn.Module):
    """Bidirectional multi-head attention over the middle axis of ``x: [N, S, Dh]`` (``heads`` heads)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: Positions | None = None) -> torch.Tensor:
        n, s, d = x.shape
        q, k, v = self.qkv(x).view(n, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [N, h, S, d]
        if positions is not None:
            pos = torch.arange(s, device=x.device)
            q, k = positions.rotate(q, pos), positions.rotate(k, pos)
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: every position sees every other
        return self.o(out.transpose(1, 2).reshape(n, s, d))


class CrissCross(MixerModule):
    """Criss-cross attention on ``x: [B, T·C, D]`` (time-major grid) -> ``[B, T·C, D]``."""

    def __init__(self, dim: int, n_heads: int, positions: Positions, channels: int) -> None:
        super().__init__()
        if dim % 2 or n_heads % 2 or (dim // 2) % (n_heads // 2):
            raise LonglabError(
                f"mixer crisscross: needs an even dim and an even n_heads whose half divides dim/2, got dim "
                f"{dim}, n_heads {n_heads}"
            )
        self.dim, self.half, self.channels = dim, dim // 2, channels
        self.positions = positions  # head size (D/2)/(H/2) = D/H: the lab's Positions fit the time heads
        self.time = _HalfAttention(self.half, n_heads // 2)
        self.chan = _HalfAttention(self.half, n_heads // 2)

    def grid(self, x: torch.Tensor) -> tuple[int, int]:
        """``(T, C)`` of the flattened grid ``x: [B, T·C, D]``."""
        n = x.shape[1]
        if n % self.channels:
            raise LonglabError(f"mixer crisscross: sequence length {n} is not a multiple of {self.channels} "
                               "channels")
        return n // self.channels, self.channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        t, c = self.grid(x)
        g = x.view(b, t, c, d)
        xt = g[..., : self.half].permute(0, 2, 1, 3).reshape(b * c, t, self.half)  # per channel, over time
        yt = self.time(xt, self.positions).view(b, c, t, self.half).permute(0, 2, 1, 3)  # [B, T, C, D/2]
        xc = g[..., self.half :].reshape(b * t, c, self.half)  # per time step, over channels
        yc = self.chan(xc).view(b, t, c, self.half)
        return torch.cat([yt, yc], dim=-1).reshape(b, n, d)


@register_mixer("crisscross")
@dataclass
class CrissCrossConfig(MixerConfig):
    """MEG-XL's criss-cross block: time attention (RoPE) on one half of the features, channel attention on
    the other, concatenated (an encoder mixer: bidirectional)."""

    paper = "Jayalath & Parker Jones, MEG-XL (arXiv 2602.02494, ICML 2026)"
    positions_allowed = ("rope", "nope")
    causal = False
    channels: int = param(16, low=1, high=1024, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "channels", self.channels, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> CrissCross:
        return CrissCross(dim, n_heads, positions, self.channels)
