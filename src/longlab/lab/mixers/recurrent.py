"""Two recurrent baselines in pure PyTorch.

- ``linear``: causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs",
  arXiv 2006.16236): ``φ(x) = elu(x) + 1``, ``S_t = Σ_{j≤t} φ(k_j) v_jᵀ``, ``z_t = Σ_{j≤t} φ(k_j)``,
  ``out_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε)``. Chunked form: inside a chunk the masked ``C × C`` product,
  across chunks the carried state ``(S, z)``; decode keeps ``(S, z)``.
- ``mamba``: a small selective state-space layer (Gu & Dao 2023, Mamba, arXiv 2312.00752), the
  Mamba-1 block: ``in_proj`` to (u, gate) with expansion E; causal depthwise conv (width 4) + SiLU;
  input-dependent ``Δ = softplus(W_Δ u + b)``, ``B = W_B u``, ``C = W_C u``; ``A = −exp(A_log)``;
  ``h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t``, ``y_t = C_t h_t + D u_t``; ``y ⊙ silu(gate)``; ``out_proj``.
  ``forward`` scans the state over time (vectorised over batch and channels), ``forward_chunked`` is
  the parallel chunked form in log space, and ``step`` the decode form with (conv window, h) as state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import MixerConfig, MixerModule, _check_int, register_mixer

__all__ = ["LinearAttention", "LinearConfig", "Mamba", "MambaConfig", "linear_quadratic"]

EPS = 1e-6


def _phi(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


class LinearAttention(MixerModule):
    def __init__(self, dim: int, n_heads: int, positions: Positions, chunk: int):
        super().__init__()
        positions.require(("rope", "nope"), "linear")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.positions, self.chunk = positions, chunk
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def features(self, x, pos):
        """-> φ(q), φ(k), v ``[B, H, T, d]`` (RoPE, when chosen, acts on φ's inputs)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return _phi(self.positions.rotate(q, pos)), _phi(self.positions.rotate(k, pos)), v

    def scan(self, fq, fk, v, s0, z0):
        outs = []
        for s in range(0, v.shape[2], self.chunk):
            e = min(s + self.chunk, v.shape[2])
            q, k, vv = fq[:, :, s:e], fk[:, :, s:e], v[:, :, s:e]
            att = (q @ k.transpose(-1, -2)).tril()  # [B, H, C, C]
            num = q @ s0 + att @ vv  # [B, H, C, d]
            den = (q * z0[:, :, None]).sum(-1, keepdim=True) + att.sum(-1, keepdim=True)
            outs.append(num / (den + EPS))
            s0 = s0 + k.transpose(-1, -2) @ vv
            z0 = z0 + k.sum(dim=2)
        return torch.cat(outs, dim=2), s0, z0

    def _zeros(self, b, like):
        d = self.head_dim
        return like.new_zeros(b, self.n_heads, d, d), like.new_zeros(b, self.n_heads, d)

    def forward(self, x):
        b, t, _ = x.shape
        fq, fk, v = self.features(x, torch.arange(t, device=x.device))
        out, _, _ = self.scan(fq, fk, v, *self._zeros(b, x))
        return self.o(out.transpose(1, 2).reshape(b, t, self.dim))

    def init_state(self, batch):
        return {"s": None, "z": None, "t": 0}

    def step(self, x, state):
        t = state["t"]
        fq, fk, v = self.features(x, torch.tensor([t], device=x.device))
        s0, z0 = (state["s"], state["z"]) if state["s"] is not None else self._zeros(x.shape[0], x)
        out, s1, z1 = self.scan(fq, fk, v, s0, z0)
        return self.o(out.transpose(1, 2).reshape(x.shape[0], 1, self.dim)), {"s": s1, "z": z1, "t": t + 1}


def linear_quadratic(mod: LinearAttention, x: torch.Tensor) -> torch.Tensor:
    """Quadratic oracle of :class:`LinearAttention`: masked ``φ(q)φ(k)ᵀ`` normalised per row."""
    b, t, _ = x.shape
    fq, fk, v = mod.features(x, torch.arange(t, device=x.device))
    w = (fq @ fk.transpose(-1, -2)).tril()
    out = (w @ v) / (w.sum(-1, keepdim=True) + EPS)
    return mod.o(out.transpose(1, 2).reshape(b, t, mod.dim))


@register_mixer("linear")
@dataclass
class LinearConfig(MixerConfig):
    """Causal linear attention (elu + 1 features); ``chunk``: scan chunk."""

    paper = "Katharopoulos et al. 2020, Transformers are RNNs (arXiv 2006.16236)"
    positions_allowed = ("rope", "nope")
    default_positions = "nope"
    chunk: int = param(64, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "chunk", self.chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> LinearAttention:
        return LinearAttention(dim, n_heads, positions, self.chunk)


class Mamba(MixerModule):
    def __init__(self, dim: int, positions: Positions, expand: int, d_state: int, d_conv: int, chunk: int):
        super().__init__()
        positions.require(("nope",), "mamba")
        e = expand * dim
        self.dim, self.inner, self.d_state, self.d_conv, self.chunk = dim, e, d_state, d_conv, chunk
        self.in_proj = nn.Linear(dim, 2 * e, bias=False)
        self.conv = nn.Conv1d(e, e, d_conv, groups=e, padding=0)
        self.dt_rank = max(1, math.ceil(dim / 16))
        self.x_proj = nn.Linear(e, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, e)
        with torch.no_grad():  # Δ initialised in [1e-3, 1e-1] (softplus⁻¹), as in Mamba
            dt = torch.exp(torch.rand(e) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(e, 1))
        self.D = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, dim, bias=False)

    def _ssm_inputs(self, u):
        """u: [B, T, E] (after conv) -> Δ [B, T, E], B [B, T, N], C [B, T, N]."""
        dbc = self.x_proj(u)
        dt, bm, cm = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        return F.softplus(self.dt_proj(dt)), bm, cm

    def _conv(self, u: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU: ``u: [B, T, E]`` -> ``[B, T, E]``."""
        return F.silu(self.conv(F.pad(u.transpose(1, 2), (self.d_conv - 1, 0))).transpose(1, 2))

    def forward(self, x):
        """Full sequence, as a scan over time of the ``[B, E, N]`` state (vectorised over B, E, N)."""
        u, gate = self.in_proj(x).chunk(2, dim=-1)  # [B, T, E]
        u = self._conv(u)
        delta, bm, cm = self._ssm_inputs(u)
        decay = torch.exp(delta[..., None] * -torch.exp(self.A_log))  # [B, T, E, N]
        inp = (delta * u)[..., None] * bm[:, :, None, :]  # Δ B u: [B, T, E, N]
        h = x.new_zeros(x.shape[0], self.inner, self.d_state)
        ys = []
        for t in range(x.shape[1]):
            h = decay[:, t] * h + inp[:, t]
            ys.append((h * cm[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + u * self.D
        return self.out_proj(y * F.silu(gate))

    def forward_chunked(self, x: torch.Tensor) -> torch.Tensor:
        """The same map as a chunked scan in log space, the parallel form (kept as a test oracle):
        ``h_t = e^{c_t} h_0 + Σ_{j≤t} e^{c_t − c_j} Δ_j B_j u_j``, ``c`` the cumulative ``Δ A`` in a chunk."""
        b, t, _ = x.shape
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        u = self._conv(u)
        delta, bm, cm = self._ssm_inputs(u)
        a = -torch.exp(self.A_log)  # [E, N]
        h = x.new_zeros(b, self.inner, self.d_state)
        ys = []
        for s in range(0, t, self.chunk):
            e = min(s + self.chunk, t)
            cum = (delta[:, s:e, :, None] * a).cumsum(dim=1)  # [B, C, E, N]
            inp = (delta[:, s:e] * u[:, s:e])[..., None] * bm[:, s:e, None, :]
            diff = cum[:, :, None] - cum[:, None, :]  # [B, t, j, E, N]
            mask = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).tril()[None, :, :, None, None]
            w = torch.exp(diff.masked_fill(~mask, -math.inf))
            hs = torch.exp(cum) * h[:, None] + (w * inp[:, None]).sum(dim=2)  # [B, C, E, N]
            ys.append((hs * cm[:, s:e, None, :]).sum(-1))
            h = hs[:, -1]
        y = torch.cat(ys, dim=1) + u * self.D
        return self.out_proj(y * F.silu(gate))

    def init_state(self, batch):
        return {"h": None, "conv": None}

    def step(self, x, state):
        b = x.shape[0]
        u, gate = self.in_proj(x).chunk(2, dim=-1)  # [B, 1, E]
        hist = state["conv"] if state["conv"] is not None else x.new_zeros(b, self.inner, self.d_conv - 1)
        window = torch.cat([hist, u.transpose(1, 2)], dim=2)  # [B, E, d_conv]
        uc = F.silu(self.conv(window).transpose(1, 2))  # [B, 1, E]
        delta, bm, cm = self._ssm_inputs(uc)
        a = -torch.exp(self.A_log)
        h = state["h"] if state["h"] is not None else x.new_zeros(b, self.inner, self.d_state)
        h = torch.exp(delta[:, 0, :, None] * a) * h + (delta[:, 0] * uc[:, 0])[..., None] * bm[:, 0, None, :]
        y = (h * cm[:, 0, None, :]).sum(-1)[:, None] + uc * self.D
        return self.out_proj(y * F.silu(gate)), {"h": h, "conv": window[:, :, 1:]}


@register_mixer("mamba")
@dataclass
class MambaConfig(MixerConfig):
    """Selective SSM (Mamba-1 block): ``expand``, ``d_state`` N, ``d_conv``, scan ``chunk``."""

    paper = "Gu & Dao 2023, Mamba (arXiv 2312.00752)"
    positions_allowed = ("nope",)
    default_positions = "nope"
    expand: int = param(2, low=1, high=64, integer=True)
    d_state: int = param(16, low=1, high=1024, integer=True)
    d_conv: int = param(4, low=1, high=64, integer=True)
    chunk: int = param(16, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        for f in ("expand", "d_state", "d_conv", "chunk"):
            _check_int(self.name, f, getattr(self, f), 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> Mamba:
        return Mamba(dim, positions, self.expand, self.d_state, self.d_conv, self.chunk)
