"""EMFormer's multi-scale single-convolution attention (Chen, Han, Zhang, Guo, Ling, Bai, "EMFormer",
arXiv 2602.01194, ICML 2026; code chenhao-zju/emformer), in 1-D and causal for the layers lab.

The released ``MultiConvAttention`` [code] passes ``qkv = W x`` through a *TripleConv*, the sum of three
depthwise convolutions of kernel 1, 3 and 5 (no bias), then splits q, k, v for attention; the fused layer
computes the sum as **one** convolution whose kernel is the zero-padded sum of the three. Here the
convolutions run along time and are causal (kernel ``k`` reads lags ``0 .. k−1``)::

    y[c, t] = Σ_{k ∈ (1, 3, 5)} Σ_{i<k} w_k[c, i] · x[c, t − i]  =  Σ_{i<5} w[c, i] · x[c, t − i],
    w[c, i] = Σ_{k > i} w_k[c, i]                                  (the merged causal kernel)

so the merged layer is one depthwise conv of kernel 5 with 4 steps of left padding: it never reads
ahead. The three kernels stay the parameters: tap ``i`` of every kernel gets the merged tap ``i``'s
gradient. ``merged = false`` computes the three convolutions separately (the reference,
and the baseline of the timing in ``bench/lab_modalities.py``). Attention is softmax over ``j ≤ i`` with
the lab's positions (RoPE by default). Deviations: the 2-D token grid, window attention and the
hourglass stack are not reproduced, and the MLP keeps the lab's SwiGLU (the paper's MLP also starts with
the conv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...recipe import LonglabError
from ...registry import param
from ..positions import Positions
from .base import MixerConfig, _check_int, register_mixer
from .softmax import Softmax

__all__ = ["EMFormerAttention", "EMFormerConfig", "MultiScaleConv"]

KERNELS = (1, 3, 5)


class MultiScaleConv(nn.Module):
    """Causal depthwise multi-scale convolution over time on ``x: [B, T, C]`` -> ``[B, T, C]``.

    ``weights[n]: [C, k_n]`` holds kernel ``k_n``'s taps in lag order (tap ``i`` multiplies ``x[t − i]``)."""

    def __init__(self, channels: int, kernels: tuple[int, ...] = KERNELS) -> None:
        super().__init__()
        self.kernels = tuple(kernels)
        self.size = max(self.kernels)
        # PyTorch's depthwise Conv1d default: U(−1/√k, 1/√k) per kernel (fan-in k)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(channels, k).uniform_(-1 / math.sqrt(k), 1 / math.sqrt(k)))
            for k in self.kernels
        )

    def merged_kernel(self) -> torch.Tensor:
        """``[C, K]`` (``K = max k``): the zero-padded sum of the kernels, in lag order."""
        w = self.weights[0].new_zeros(self.weights[0].shape[0], self.size)
        for wk in self.weights:
            w = w + F.pad(wk, (0, self.size - wk.shape[1]))
        return w

    @staticmethod
    def _causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, C]``, lag-ordered ``w: [C, k]`` -> ``y[t] = Σ_i w[:, i] x[t − i]`` (0 before t = 0)."""
        k = w.shape[1]
        xt = F.pad(x.transpose(1, 2), (k - 1, 0))  # [B, C, T + k − 1]
        # conv1d is a cross-correlation (out[t] = Σ_j w'[j] in[t + j]): lag i = k − 1 − j, so flip
        return F.conv1d(xt, w.flip(-1)[:, None, :], groups=w.shape[0]).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One convolution with the merged kernel."""
        return self._causal_conv(x, self.merged_kernel())

    def forward_separate(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: the three convolutions computed separately and summed."""
        return sum(self._causal_conv(x, wk) for wk in self.weights)


class EMFormerAttention(Softmax):
    """Causal softmax attention whose ``qkv = W x`` first goes through :class:`MultiScaleConv`."""

    def __init__(self, dim: int, n_heads: int, positions: Positions, row_chunk: int = 256,
                 merged: bool = True) -> None:
        super().__init__(dim, n_heads, positions, row_chunk)
        self.conv = MultiScaleConv(3 * dim)
        self.merged = bool(merged)

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """``x: [B, T, D]`` -> q, k, v ``[B, H, T, d]``: ``conv(W x)`` split, positions on q and k."""
        b, t, _ = x.shape
        qkv = self.qkv(x)  # [B, T, 3D]
        qkv = self.conv(qkv) if self.merged else self.conv.forward_separate(qkv)
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.positions.rotate(q, pos), self.positions.rotate(k, pos), v

    def init_state(self, batch: int) -> None:
        return None  # no decode form here (it would keep the last 4 inputs of the conv)


@register_mixer("emformer")
@dataclass
class EMFormerConfig(MixerConfig):
    """EMFormer attention: multi-scale causal depthwise conv (k = 1, 3, 5 merged into one k = 5) on qkv."""

    paper = "Chen et al., EMFormer (arXiv 2602.01194, ICML 2026)"
    merged: bool = param(True, choices=(True, False))  # false: three separate convs (the timing baseline)
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "row_chunk", self.row_chunk, 1)
        if not isinstance(self.merged, bool):
            raise LonglabError(f"mixer {self.name}: merged must be true or false, got {self.merged!r}")

    def build(self, dim: int, n_heads: int, positions: Positions) -> EMFormerAttention:
        return EMFormerAttention(dim, n_heads, positions, self.row_chunk, self.merged)
