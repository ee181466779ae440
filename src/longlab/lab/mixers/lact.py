"""LaCT: large-chunk test-time training (Zhang et al., "Test-Time Training Done Right",
arXiv 2505.23884; code a1600012888/LaCT ``ttt_operation.py``).

Fast weight per fast-weight head: ``f_W(x) = W1 (silu(W0 x) ⊙ (W2 x))`` (a SwiGLU, hidden
``d_h = inter_multi·d_k``). Inputs from the q, k, v shared with a parallel sliding-window attention:
``k̃, q̃ = l2norm(silu(k·s_k)), l2norm(silu(q·s_q))`` (after RoPE), ``ṽ = silu(v)``. Per-token learning
rates ``η^{(0,1,2)}_i = softplus(W_lr h_i + softplus⁻¹(lr_init))``. Per chunk of ``chunk`` tokens the loss
``ℒ = −Σ_i η_i ⟨f_W(k̃_i), ṽ_i⟩`` gives the analytic update (gradient ascent on the inner product):

    ΔW1 = Σ_i η¹_i ṽ_i hid_iᵀ,  hid = silu(W0 k̃) ⊙ (W2 k̃)
    ΔW0 = Σ_i η⁰_i [(W1ᵀ ṽ_i) ⊙ (W2 k̃_i) ⊙ silu'(W0 k̃_i)] k̃_iᵀ
    ΔW2 = Σ_i η²_i [(W1ᵀ ṽ_i) ⊙ silu(W0 k̃_i)] k̃_iᵀ

optional momentum ``ΔW ← ΔW + m̄·ΔW_prev`` (``m̄ = mean_chunk σ(W_m h)``) and the Muon option
``ΔW ← NS5(ΔW)`` (5 Newton–Schulz steps with the paper's coefficients after normalising to spectral
norm ≤ 1); then ``W ← W + ΔW`` and each row is rescaled to its initial norm. Order is
**apply-then-update**: chunk c is read with the weights after chunk c−1 (the last chunk never updates).
Output: ``RMSNorm_head(f_W(q̃))·silu(W_s h)`` added to the sliding-window attention, then ``o_proj``.

The decode form keeps (W0, W1, W2, ΔW_prev), the current chunk's (k̃, ṽ, η) and the window's KV cache,
and updates the fast weights whenever a chunk fills, so it matches the chunked forward exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import MixerConfig, _check_float, _check_int, register_mixer
from .softmax import Softmax

__all__ = ["LaCT", "LaCTConfig", "newton_schulz5"]

NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def newton_schulz5(g: torch.Tensor) -> torch.Tensor:
    """Approximate orthogonalisation of ``g: [..., m, n]`` (Muon's NS5 with LaCT's coefficients)."""
    transpose = g.shape[-2] > g.shape[-1]
    x = g.transpose(-1, -2) if transpose else g
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius ≥ spectral: spectral norm ≤ 1
    for a, b, c in NS_COEFFS:
        m = x @ x.transpose(-1, -2)
        x = a * x + (b * m + c * m @ m) @ x
    return x.transpose(-1, -2) if transpose else x


def _dsilu(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


class LaCT(Softmax):
    def __init__(
        self, dim, n_heads, positions, chunk, window, fast_heads, inter_multi, lr_init, muon, momentum
    ):
        super().__init__(dim, n_heads, positions, 256)
        positions.require(("rope", "nope"), "lact")
        if dim % fast_heads:
            from ...recipe import LonglabError

            raise LonglabError(f"mixer lact: dim {dim} is not a multiple of fast_heads {fast_heads}")
        self.chunk, self.window, self.fh = chunk, window, fast_heads
        self.dk = dim // fast_heads
        self.dh = inter_multi * self.dk
        self.muon, self.momentum = muon, momentum
        std = 1.0 / math.sqrt(self.dk)
        self.w0 = nn.Parameter(torch.randn(fast_heads, self.dh, self.dk) * std)
        self.w2 = nn.Parameter(torch.randn(fast_heads, self.dh, self.dk) * std)
        self.w1 = nn.Parameter(torch.randn(fast_heads, self.dk, self.dh) / math.sqrt(self.dh))
        self.s_q = nn.Parameter(torch.ones(dim))
        self.s_k = nn.Parameter(torch.ones(dim))
        self.lr = nn.Linear(dim, 3 * fast_heads)
        nn.init.zeros_(self.lr.weight)
        nn.init.constant_(self.lr.bias, math.log(math.expm1(lr_init)))  # softplus⁻¹(lr_init)
        self.m_proj = nn.Linear(dim, fast_heads) if momentum else None
        self.gate_proj = nn.Linear(dim, dim, bias=False)
        self.head_norm = nn.RMSNorm(self.dk)

    # -- fast-weight pieces --------------------------------------------------------------------
    def fast_inputs(self, q, k, v, x):
        """q/k/v ``[B, H, T, d]`` (positions applied), x ``[B, T, D]`` -> q̃, k̃, ṽ ``[B, Hf, T, dk]``,
        η ``[B, Hf, T, 3]``, m ``[B, Hf, T]`` or None."""
        b, _, t, _ = q.shape

        def heads(z, scale=None):  # [B, H, T, d] -> [B, Hf, T, dk]
            flat = z.transpose(1, 2).reshape(b, t, self.dim)
            flat = flat if scale is None else flat * scale
            return flat.view(b, t, self.fh, self.dk).transpose(1, 2)

        qt = F.normalize(F.silu(heads(q, self.s_q)), dim=-1)
        kt = F.normalize(F.silu(heads(k, self.s_k)), dim=-1)
        vt = F.silu(heads(v))
        eta = F.softplus(self.lr(x)).view(b, t, self.fh, 3).transpose(1, 2)
        m = torch.sigmoid(self.m_proj(x)).transpose(1, 2) if self.m_proj is not None else None
        return qt, kt, vt, eta, m

    def apply_fast(self, w, x):  # w = (W0, W1, W2) each [B, Hf, ., .]; x [B, Hf, C, dk]
        w0, w1, w2 = w
        hid = F.silu(x @ w0.transpose(-1, -2)) * (x @ w2.transpose(-1, -2))  # [B, Hf, C, dh]
        return hid @ w1.transpose(-1, -2)  # [B, Hf, C, dk]

    def update(self, w, prev, kt, vt, eta, m):
        """One chunk's update of the fast weights ``w`` (and momentum ``prev``)."""
        w0, w1, w2 = w
        h0 = kt @ w0.transpose(-1, -2)
        h2 = kt @ w2.transpose(-1, -2)
        a = F.silu(h0)
        hid = a * h2  # [B, Hf, C, dh]
        dhid = vt @ w1  # (W1ᵀ ṽ)ᵀ: [B, Hf, C, dh]
        e0, e1, e2 = eta[..., 0:1], eta[..., 1:2], eta[..., 2:3]
        d1 = (e1 * vt).transpose(-1, -2) @ hid  # [B, Hf, dk, dh]
        d0 = (e0 * dhid * h2 * _dsilu(h0)).transpose(-1, -2) @ kt  # [B, Hf, dh, dk]
        d2 = (e2 * dhid * a).transpose(-1, -2) @ kt
        deltas = [d0, d1, d2]
        if m is not None and prev is not None:
            mbar = m.mean(dim=-1)[..., None, None]  # [B, Hf, 1, 1]
            deltas = [d + mbar * p for d, p in zip(deltas, prev)]
        new_prev = deltas if m is not None else None
        if self.muon:
            deltas = [newton_schulz5(d) for d in deltas]
        out = []
        for wi, di, w_init in zip(w, deltas, (self.w0, self.w1, self.w2)):
            nw = wi + di
            target = w_init.norm(dim=-1, keepdim=True)[None]  # initial row norms [1, Hf, rows, 1]
            out.append(nw / (nw.norm(dim=-1, keepdim=True) + 1e-6) * target)
        return tuple(out), new_prev

    def _init_weights(self, b):
        return tuple(p[None].expand(b, *p.shape) for p in (self.w0, self.w1, self.w2))

    def combine(self, swa, fast, x):
        """swa ``[B, H, T, d]``, fast ``[B, Hf, T, dk]``, x ``[B, T, D]`` -> ``[B, T, D]``."""
        b, _, t, _ = swa.shape
        fast = self.head_norm(fast).transpose(1, 2).reshape(b, t, self.dim) * F.silu(self.gate_proj(x))
        return self.o(swa.transpose(1, 2).reshape(b, t, self.dim) + fast)

    # -- forms ---------------------------------------------------------------------------------
    def forward(self, x):
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        q, k, v = self.project(x, pos)
        swa = Softmax.attend(self, q, k, v, pos, pos, None, self.window)
        qt, kt, vt, eta, m = self.fast_inputs(q, k, v, x)
        w, prev = self._init_weights(b), None
        outs = []
        for s in range(0, t, self.chunk):
            e = min(s + self.chunk, t)
            outs.append(self.apply_fast(w, qt[:, :, s:e]))  # apply first ...
            if e < t:  # ... then update (the last chunk never updates)
                mm = m[:, :, s:e] if m is not None else None
                w, prev = self.update(w, prev, kt[:, :, s:e], vt[:, :, s:e], eta[:, :, s:e], mm)
        return self.combine(swa, torch.cat(outs, dim=2), x)

    def init_state(self, batch: int) -> dict[str, Any]:
        return {"t": 0, "k": None, "v": None, "w": None, "prev": None, "buf": []}

    def step(self, x, state):
        t = state["t"]
        pos = torch.tensor([t], device=x.device)
        q, k, v = self.project(x, pos)
        kc = k if state["k"] is None else torch.cat([state["k"], k], dim=2)[:, :, -self.window:]
        vc = v if state["v"] is None else torch.cat([state["v"], v], dim=2)[:, :, -self.window:]
        k_pos = torch.arange(t + 1 - kc.shape[2], t + 1, device=x.device)
        swa = Softmax.attend(self, q, kc, vc, pos, k_pos, None, self.window)
        qt, kt, vt, eta, m = self.fast_inputs(q, k, v, x)
        w = state["w"] if state["w"] is not None else self._init_weights(x.shape[0])
        y = self.combine(swa, self.apply_fast(w, qt), x)
        buf = state["buf"] + [(kt, vt, eta, m)]
        prev = state["prev"]
        if len(buf) == self.chunk:
            cat = [
                torch.cat([b_[i] for b_ in buf], dim=2) if buf[0][i] is not None else None for i in range(4)
            ]
            w, prev = self.update(w, prev, *cat)
            buf = []
        return y, {"t": t + 1, "k": kc, "v": vc, "w": w, "prev": prev, "buf": buf}


@register_mixer("lact")
@dataclass
class LaCTConfig(MixerConfig):
    """LaCT: fast-weight ``chunk``, SWA ``window``, ``fast_heads``, ``inter_multi``, ``lr_init`` > 0
    (the paper's 1e-3; 1e-2 here, for training runs of minutes), ``muon`` (NS5 on the update),
    ``momentum``."""

    paper = "Zhang et al., Test-Time Training Done Right (arXiv 2505.23884)"
    positions_allowed = ("rope", "nope")
    chunk: int = param(16, low=1, high=1 << 16, integer=True)
    window: int = param(16, low=1, high=1 << 16, integer=True)
    fast_heads: int = param(2, low=1, high=64, integer=True)
    inter_multi: int = param(2, low=1, high=64, integer=True)
    lr_init: float = param(1e-2, low=0, high=1, low_open=True)
    muon: bool = param(False, choices=(True, False))
    momentum: bool = param(False, choices=(True, False))

    def validate(self) -> None:
        for f in ("chunk", "window", "fast_heads", "inter_multi"):
            _check_int(self.name, f, getattr(self, f), 1)
        _check_float(self.name, "lr_init", self.lr_init, 0.0, strict=True)

    def build(self, dim: int, n_heads: int, positions: Positions) -> LaCT:
        return LaCT(
            dim, n_heads, positions, self.chunk, self.window, self.fast_heads, self.inter_multi, self.lr_init,
            self.muon, self.momentum,
        )
