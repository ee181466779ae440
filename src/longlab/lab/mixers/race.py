"""RACE attention: soft-LSH estimate of a sharpened angular kernel (Joshi et al., arXiv 2510.04008;
code sahiljoshi515/RACE_Attention).

Target kernel ``w_ij ∝ (1 − arccos(cos(q_i, k_j))/π)^γ``; with K random hyperplanes the LSH collision
probability is ``(1 − θ/π)^K``, so K plays γ. Per table l (of ``tables``), with fixed Gaussian planes
``P_l ∈ R^{d×K}`` and the ``R = 2^K`` corner prototypes ``c_r ∈ {−1, +1}^K``:

    p_l(r | x) = softmax_r(⟨tanh(P_l x), c_r⟩ / τ),   τ = √d · exp(log_temp)   (log_temp learnable, 0 at init)
    A_{l,r}(t) = Σ_{j≤t} p_l(r | k_j),   B_{l,r}(t) = Σ_{j≤t} p_l(r | k_j) v_j
    out_t = mean_l Σ_r p_l(r | q_t) · B_{l,r}(t) / (A_{l,r}(t) + ε),   ε = 1e-6

(a mean over tables, not the reference code's sum: W_o absorbs the scale). The causal prefix sums run
as a chunked scan (chunk ``chunk``: ``C × C`` weights inside a chunk, the state across chunks; memory
``O(C² + tables·R·d)``, never ``T × T``); decode keeps the
state ``(A, B) ∈ R^{tables·R} × R^{tables·R×d}``. The equivalent quadratic form
``out_t = Σ_{j≤t} [mean_l Σ_r p_l(r|q_t) p_l(r|k_j) / (A_{l,r}(t)+ε)] v_j`` is :func:`race_quadratic`
(the test oracle). M independent ensembles averaged are the same estimator with ``M·tables`` tables.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...registry import param
from ..positions import Positions
from .base import MixerConfig, MixerModule, _check_int, register_mixer

__all__ = ["RACE", "RACEConfig", "race_quadratic"]

EPS = 1e-6


class RACE(MixerModule):
    def __init__(self, dim: int, n_heads: int, positions: Positions, tables: int, bits: int, chunk: int):
        super().__init__()
        positions.require(("rope", "nope"), "race")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.positions = positions
        self.tables, self.bits, self.chunk = tables, bits, chunk
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        gen = torch.Generator().manual_seed(1234)
        self.register_buffer("planes", torch.randn(tables, self.head_dim, bits, generator=gen))  # fixed
        corners = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=bits)))  # [R, K]
        self.register_buffer("corners", corners)
        self.log_temp = nn.Parameter(torch.zeros(n_heads))

    def buckets(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, H, T, d]`` -> soft bucket probabilities ``[B, H, T, tables, R]``."""
        proj = torch.tanh(torch.einsum("bhtd,ldk->bhtlk", x, self.planes))
        tau = math.sqrt(self.head_dim) * self.log_temp.exp()[None, :, None, None, None]
        return torch.softmax(torch.einsum("bhtlk,rk->bhtlr", proj, self.corners) / tau, dim=-1)

    def project(self, x, pos):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.positions.rotate(q, pos), self.positions.rotate(k, pos), v

    def scan(self, pq, pk, v, a0, b0):
        """Chunked causal prefix: ``pq, pk: [B, H, T, L, R]``, ``v: [B, H, T, d]``; state a ``[B, H, L, R]``,
        b ``[B, H, L, R, d]`` -> (out ``[B, H, T, d]``, a, b). Inside a chunk the ``C × C`` weights
        ``Σ_{l,r} p(r|q_t) p(r|k_j) / A_{l,r}(t)`` (never a ``[C, L, R, d]`` prefix); across chunks the
        state."""
        outs = []
        for s in range(0, v.shape[2], self.chunk):
            e = min(s + self.chunk, v.shape[2])
            ka, vv = pk[:, :, s:e].flatten(-2), v[:, :, s:e]  # [B, H, C, L·R]
            a = a0.flatten(-2)[:, :, None] + ka.cumsum(dim=2)  # A(t): [B, H, C, L·R]
            qa = pq[:, :, s:e].flatten(-2) / (a + EPS)
            w = (qa @ ka.transpose(-1, -2)).tril()  # [B, H, C, C]
            out = qa @ b0.flatten(2, 3) + w @ vv  # state part + in-chunk part
            outs.append(out / self.tables)
            a0 = a[:, :, -1].view_as(a0)
            b0 = b0 + torch.einsum("bhtr,bhtd->bhrd", ka, vv).view_as(b0)
        return torch.cat(outs, dim=2), a0, b0

    def _zeros(self, b, like):
        h, lt, r, d = self.n_heads, self.tables, 2**self.bits, self.head_dim
        return like.new_zeros(b, h, lt, r), like.new_zeros(b, h, lt, r, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        q, k, v = self.project(x, pos)
        a0, b0 = self._zeros(b, x)
        out, _, _ = self.scan(self.buckets(q), self.buckets(k), v, a0, b0)
        return self.o(out.transpose(1, 2).reshape(b, t, self.dim))

    def init_state(self, batch: int):
        return {"a": None, "b": None, "t": 0}

    def step(self, x, state):
        t = state["t"]
        q, k, v = self.project(x, torch.tensor([t], device=x.device))
        a0, b0 = (state["a"], state["b"]) if state["a"] is not None else self._zeros(x.shape[0], x)
        out, a, bb = self.scan(self.buckets(q), self.buckets(k), v, a0, b0)
        y = self.o(out.transpose(1, 2).reshape(x.shape[0], 1, self.dim))
        return y, {"a": a, "b": bb, "t": t + 1}


def race_quadratic(mod: RACE, x: torch.Tensor) -> torch.Tensor:
    """The ``T × T`` weight form of :class:`RACE` (oracle for tests): ``x: [B, T, D] -> [B, T, D]``."""
    b, t, _ = x.shape
    pos = torch.arange(t, device=x.device)
    q, k, v = mod.project(x, pos)
    pq, pk = mod.buckets(q), mod.buckets(k)  # [B, H, T, L, R]
    a = pk.cumsum(dim=2)  # A_{l,r}(t)
    w = torch.einsum("bhilr,bhjlr->bhij", pq / (a + EPS), pk) / mod.tables  # [B, H, T, T]
    w = w * torch.ones(t, t, device=x.device).tril()
    out = w @ v
    return mod.o(out.transpose(1, 2).reshape(b, t, mod.dim))


@register_mixer("race")
@dataclass
class RACEConfig(MixerConfig):
    """RACE: ``tables`` LSH tables of ``bits`` hyperplanes (R = 2^bits buckets), scan chunk ``chunk``."""

    paper = "Joshi et al., RACE Attention (arXiv 2510.04008)"
    positions_allowed = ("rope", "nope")
    tables: int = param(4, low=1, high=1024, integer=True)
    bits: int = param(4, low=1, high=10, integer=True)
    chunk: int = param(64, low=1, high=1 << 16, integer=True)

    def validate(self) -> None:
        _check_int(self.name, "tables", self.tables, 1)
        _check_int(self.name, "bits", self.bits, 1)
        if self.bits > 10:
            from ...recipe import LonglabError

            raise LonglabError(f"mixer race: bits must be in 1..10 (2^bits buckets), got {self.bits}")
        _check_int(self.name, "chunk", self.chunk, 1)

    def build(self, dim: int, n_heads: int, positions: Positions) -> RACE:
        return RACE(dim, n_heads, positions, self.tables, self.bits, self.chunk)
