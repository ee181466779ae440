"""Spiking layers: LIF and the Timestep-Scalable (TS) neuron ("Resolving the Timestep Scaling Paradox in
Spiking Neural Networks with a Timestep-Scalable Neuron Model", ICML 2026; arXiv id and code not found)
[abs + recon: the neuron below is the spec's reconstruction, remaining-seeds §38].

A layer maps ``x: [B, T, D]`` (T timesteps) to spikes ``s: [B, T, D]`` in {0, 1}: input current
``I_t = W x_t + b``, then per timestep (t = 1 … T, ``u_0 = s_0 = m_0 = 0``)::

    LIF:  u_t = τ·u_{t−1}·(1 − s_{t−1}) + I_t,                   s_t = H(u_t − V_th)
    TS:   u_t = τ·u_{t−1}·(1 − s_{t−1}) + I_t + γ ⊙ m_{t−1},      s_t = H(u_t − V_th)
          m_t = β·m_{t−1} + (1 − β)·u_t,   and m_t ← 0 whenever t mod P = 0   (temporal forgetting)

(τ = 0.5, V_th = 1; β = 0.9, P = 8, γ learnable per channel, init 0.1; ``W`` LeCun-normal, ``b = 0``).
The trace ``m`` is long-term
memory reconsolidation: it skips the hard reset, a cross-timestep path for information and gradients;
forgetting truncates it every ``P`` steps. Backward uses the rectangular surrogate
``∂s/∂u = 1[|u − V_th| < a/2] / a`` (a = 1); the reset term ``s_{t−1}`` is not detached.

Both register with ``block = "plain"``: a lab model of spiking layers is ``input map → layer → … →
layer → linear readout`` (no norms, MLPs or residuals), the 2-layer spiking MLP of the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...recipe import LonglabError
from ...registry import param
from ..positions import Positions
from .base import MixerConfig, MixerModule, _check_float, _check_int, register_mixer

__all__ = ["LIFConfig", "SpikeFn", "SpikingLayer", "TSConfig", "spike"]


class SpikeFn(torch.autograd.Function):
    """Heaviside forward, rectangular surrogate backward: ``∂s/∂u = 1[|u − V_th| < a/2] / a``."""

    @staticmethod
    def forward(ctx, u: torch.Tensor, v_th: float, width: float) -> torch.Tensor:
        ctx.save_for_backward(u)
        ctx.v_th, ctx.width = v_th, width
        return (u >= v_th).to(u.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (u,) = ctx.saved_tensors
        window = ((u - ctx.v_th).abs() < ctx.width / 2).to(grad.dtype) / ctx.width
        return grad * window, None, None


def spike(u: torch.Tensor, v_th: float = 1.0, width: float = 1.0) -> torch.Tensor:
    """``H(u − V_th)`` with the rectangular surrogate gradient of width ``width``."""
    return SpikeFn.apply(u, v_th, width)


class SpikingLayer(MixerModule):
    """LIF (``trace = False``) or TS (``trace = True``) neurons over the time axis of ``x: [B, T, D]``.

    ``record = True`` keeps the membrane potentials of the last forward in ``self.potentials`` (a list of
    ``T`` tensors ``[B, D]`` with ``retain_grad``), for the gradient ratio ``‖∂L/∂u_1‖ / ‖∂L/∂u_T‖``."""

    def __init__(self, dim: int, tau: float, v_th: float, width: float, trace: bool = False,
                 beta: float = 0.9, period: int = 8, gamma: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        # LeCun normal, zero bias: currents of the input's scale reach the surrogate's window at the start
        # (PyTorch's default, variance 1/(3·fan_in) plus a bias, left every neuron silent and every gradient
        # 0 on the xor task: a rectangular surrogate has no gradient outside |u − V_th| < a/2)
        nn.init.normal_(self.fc.weight, std=dim**-0.5)
        nn.init.zeros_(self.fc.bias)
        self.tau, self.v_th, self.width = float(tau), float(v_th), float(width)
        self.trace, self.beta, self.period = bool(trace), float(beta), int(period)
        if self.trace:
            self.gamma = nn.Parameter(torch.full((dim,), float(gamma)))  # [D] reconsolidation gain
        self.record = False
        self.potentials: list[torch.Tensor] = []
        self.traces: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        current = self.fc(x)  # [B, T, D]
        b, t, d = current.shape
        u = current.new_zeros(b, d)
        s = current.new_zeros(b, d)
        m = current.new_zeros(b, d)
        out, self.potentials, self.traces = [], [], []
        for i in range(t):  # timestep i + 1 of the formulas
            u = self.tau * u * (1 - s) + current[:, i]
            if self.trace:
                u = u + self.gamma * m
            if self.record and torch.is_grad_enabled():
                u.retain_grad()
                self.potentials.append(u)
            s = spike(u, self.v_th, self.width)
            if self.trace:
                m = self.beta * m + (1 - self.beta) * u
                if (i + 1) % self.period == 0:
                    m = torch.zeros_like(m)  # temporal forgetting
                if self.record:
                    self.traces.append(m.detach())
            out.append(s)
        return torch.stack(out, dim=1)

    def init_state(self, batch: int) -> dict[str, Any]:
        return {"u": None, "s": None, "m": None, "t": 0}

    def step(self, x: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        current = self.fc(x[:, 0])
        zero = torch.zeros_like(current)
        u, s, m = (zero if state[k] is None else state[k] for k in ("u", "s", "m"))
        u = self.tau * u * (1 - s) + current
        if self.trace:
            u = u + self.gamma * m
        s = spike(u, self.v_th, self.width)
        if self.trace:
            m = self.beta * m + (1 - self.beta) * u
            if (state["t"] + 1) % self.period == 0:
                m = torch.zeros_like(m)
        return s[:, None], {"u": u, "s": s, "m": m, "t": state["t"] + 1}


def _check_neuron(cfg: Any) -> None:
    _check_float(cfg.name, "tau", cfg.tau, 0.0)
    if cfg.tau > 1:
        raise LonglabError(f"mixer {cfg.name}: tau must be a finite number in [0, 1], got {cfg.tau!r}")
    _check_float(cfg.name, "v_th", cfg.v_th, 0.0, strict=True)
    _check_float(cfg.name, "width", cfg.width, 0.0, strict=True)


@register_mixer("lif")
@dataclass
class LIFConfig(MixerConfig):
    """Leaky integrate-and-fire layer with hard reset and a rectangular surrogate gradient."""

    paper = "LIF with surrogate gradients: the baseline of the TS neuron (ICML 2026, timestep scaling)"
    positions_allowed = ("nope",)
    default_positions = "nope"
    block = "plain"
    tau: float = param(0.5, low=0, high=1)
    v_th: float = param(1.0, low=0, high=1000, low_open=True)
    width: float = param(1.0, low=0, high=1000, low_open=True)

    def validate(self) -> None:
        _check_neuron(self)

    def build(self, dim: int, n_heads: int, positions: Positions) -> SpikingLayer:
        return SpikingLayer(dim, self.tau, self.v_th, self.width)


@register_mixer("ts")
@dataclass
class TSConfig(MixerConfig):
    """Timestep-Scalable neuron: LIF + the reconsolidation trace ``γ·m`` with forgetting every ``period``."""

    paper = ("Timestep-Scalable neuron, 'Resolving the Timestep Scaling Paradox in Spiking Neural Networks' "
             "(ICML 2026) [abs + recon]")
    positions_allowed = ("nope",)
    default_positions = "nope"
    block = "plain"
    tau: float = param(0.5, low=0, high=1)
    v_th: float = param(1.0, low=0, high=1000, low_open=True)
    width: float = param(1.0, low=0, high=1000, low_open=True)
    beta: float = param(0.9, low=0, high=1, high_open=True)
    period: int = param(8, low=1, high=1 << 16, integer=True)
    gamma: float = param(0.1, low=-1000, high=1000)

    def validate(self) -> None:
        _check_neuron(self)
        _check_float(self.name, "beta", self.beta, 0.0)
        if self.beta >= 1:
            raise LonglabError(f"mixer ts: beta must be a finite number in [0, 1), got {self.beta!r}")
        _check_int(self.name, "period", self.period, 1)
        _check_float(self.name, "gamma", self.gamma, float("-inf"))

    def build(self, dim: int, n_heads: int, positions: Positions) -> SpikingLayer:
        return SpikingLayer(dim, self.tau, self.v_th, self.width, trace=True, beta=self.beta,
                            period=self.period, gamma=self.gamma)
