"""L2A: Learning When to Attend (Choudhary, Chattopadhyay, Zancato et al., arXiv 2603.17484, ICML
2026). Only the abstract is public; the formulas are a reconstruction [recon]:

- every token runs causal sliding-window softmax attention (window ``window``): ``o^loc_t``;
- a router ``g_t = σ(w_rᵀ h_t + b_r)`` (per layer) picks the tokens with ``g_t > τ`` (τ = 0.5); those
  also run global causal attention over their whole prefix: ``o^glob_t``;
- ``o_t = o^loc_t + 1[g_t > τ]·g_t·(o^glob_t − o^loc_t)``;
- training: straight-through estimator for the hard gate (forward ``1[g > τ]``, backward the gradient
  of ``g``), plus ``λ·(mean_t g_t − ρ)²`` with target rate ρ = 0.2 (exposed as ``aux_loss``).
  ``hard_rate=true`` puts the STE gate in the rate term, ``λ·(mean_t ste_t − ρ)²``: its forward value is the
  routed fraction itself. With the soft term (the default, as first measured) the loss is met by gates
  that sit near ρ < τ and route nothing (measured: layer 0 of the passkey model, soft mean 0.20, routed
  1.6 %).

A *real gather*: the routed queries are gathered (``index_select``) and attend to the full prefix,
so global cost scales with the gate rate. Under the STE the backward pass needs ``o^glob − o^loc``
for every token, so training (``self.training`` and ``dense_train``) computes ``o^glob`` densely;
evaluation and decode always use the gather. The two give the same forward output (a test checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import MixerConfig, _check_float, _check_int, register_mixer
from .softmax import Softmax

__all__ = ["L2A", "L2AConfig"]


class L2A(Softmax):
    def __init__(self, dim, n_heads, positions, row_chunk, window, tau, rate, lam, dense_train, bias_init,
                 hard_rate=False):
        super().__init__(dim, n_heads, positions, row_chunk)
        self.hard_rate = bool(hard_rate)
        self.window, self.tau, self.rate, self.lam = window, tau, rate, lam
        self.dense_train = dense_train
        self.router = nn.Linear(dim, 1)
        nn.init.zeros_(self.router.weight)
        nn.init.constant_(self.router.bias, bias_init)
        self.last_rate: float | None = None  # fraction of tokens routed to global attention

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, D]`` -> ``g: [B, T]`` in (0, 1)."""
        return torch.sigmoid(self.router(x))[..., 0]

    def _local(self, q, k, v, q_pos, k_pos):
        return Softmax.attend(self, q, k, v, q_pos, k_pos, None, self.window)

    def _global(self, q, k, v, q_pos, k_pos):
        return Softmax.attend(self, q, k, v, q_pos, k_pos, None)

    def mix(self, q, k, v, q_pos, k_pos, x):
        """q ``[B, H, Tq, d]``, k/v ``[B, H, Tk, d]``, x ``[B, Tq, D]`` -> ``[B, H, Tq, d]``."""
        g = self.gate(x)  # [B, Tq]
        hard = (g > self.tau).to(g.dtype)
        self.last_rate = float(hard.detach().mean().item()) if hard.numel() else 0.0
        ste = hard + g - g.detach()  # forward 1[g > τ], backward dg
        if self.training:
            routed = ste.mean() if self.hard_rate else g.mean()
            self.aux_loss = self.lam * (routed - self.rate) ** 2
        loc = self._local(q, k, v, q_pos, k_pos)
        if self.training and self.dense_train:
            glob = self._global(q, k, v, q_pos, k_pos)
            coef = (ste * g)[:, None, :, None]
            return loc + coef * (glob - loc)
        out = loc.clone()
        for bi in range(x.shape[0]):  # gather the routed queries of each sequence
            idx = torch.nonzero(hard[bi] > 0, as_tuple=False)[:, 0]
            if idx.numel() == 0:
                continue
            glob = self._global(q[bi : bi + 1, :, idx], k[bi : bi + 1], v[bi : bi + 1], q_pos[idx], k_pos)
            coef = g[bi, idx][None, None, :, None]
            out[bi : bi + 1, :, idx] = loc[bi : bi + 1, :, idx] + coef * (glob - loc[bi : bi + 1, :, idx])
        return out

    def attend(self, q, k, v, q_pos, k_pos, xq, window=None):
        return self.mix(q, k, v, q_pos, k_pos, xq)


@register_mixer("l2a")
@dataclass
class L2AConfig(MixerConfig):
    """L2A: ``window`` local attention + routed global attention; ``rate`` ρ in (0, 1]; ``lam`` λ ≥ 0."""

    paper = "Choudhary et al., Learning When to Attend (arXiv 2603.17484, ICML 2026) [recon]"
    window: int = param(16, low=1, high=1 << 16, integer=True)
    tau: float = param(0.5, low=0, high=1, high_open=True)
    rate: float = param(0.2, low=0, high=1, low_open=True)
    lam: float = param(1.0, low=0, high=1000)
    dense_train: bool = param(True, choices=(True, False))
    bias_init: float = param(0.0, low=-100, high=100)
    hard_rate: bool = param(False, choices=(True, False))
    row_chunk: int = param(256, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "window", self.window, 1)
        _check_float(self.name, "tau", self.tau, 0.0)
        _check_float(self.name, "rate", self.rate, 0.0, strict=True)
        if self.rate > 1 or self.tau >= 1:
            from ...recipe import LonglabError

            raise LonglabError(
                f"mixer l2a: rate must be in (0, 1] and tau in [0, 1), got rate={self.rate}, tau={self.tau}"
            )
        _check_float(self.name, "lam", self.lam, 0.0)
        _check_int(self.name, "row_chunk", self.row_chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> L2A:
        return L2A(
            dim, n_heads, positions, self.row_chunk, self.window, self.tau, self.rate, self.lam,
            self.dense_train, self.bias_init, self.hard_rate,
        )
