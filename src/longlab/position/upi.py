"""UPI: universal position interpolation for hybrid Mamba2-attention models ("From Collapse to Control",
ICLR 2026; no public code: the spec's closed form) and the small pure-PyTorch hybrid it is tested on.

The Mamba2 update of head ``h`` (scalar decay ``a = -A_h > 0``) at step ``t`` is
``h_t = exp(-a·Δ_t)·h_{t-1} + Δ_t·B_t x_t``, read out as ``y_t = C_t·h_t + D_h x_t``. Stretching the input by
``n = L_target/L_train`` means one original step should become ``n`` small ones. With the input held for
``n`` steps, forget gate ``f = exp(-aΔ/n)`` and input gate ``g = Δ·(1-e^{-aΔ/n})/(1-e^{-aΔ})`` give exactly
one original step after ``n`` steps (``mode="exact"``); for heads with ``aΔ -> 0`` this is ``g ≈ Δ/n``, the
practical rule ``Δ <- Δ/n`` (``mode="dt"``, default). UPI applies it to the heads with the largest
effective receptive field (ERF, the MMD below; top ``top`` fraction, 20% in the paper) and YaRN with
``s = n`` to the attention layers. ``heads="all"`` scales every Mamba head (the paper's ablation).

ERF of head ``h`` over a sequence of length ``L``: ``M_{L,j} = C_L·B_j·Δ_j·exp(-a·Σ_{k=j+1}^{L} Δ_k)`` and
``MMD = Σ_j (L-j)·|M_{L,j}| / Σ_i |M_{L,i}|`` (the mean distance the last token reads from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..recipe import LonglabError
from ..registry import MAX_FACTOR, MAX_SEED, param
from .base import LayerRope, PositionMethod, check_factor, register_position
from .rope import yarn_paper_inv_freq

__all__ = ["UPI", "HybridConfig", "HybridLM", "Mamba2Mixer", "upi_gates", "erf_mmd", "ssm_step"]


def upi_gates(a_dt: torch.Tensor, dt: torch.Tensor, n: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, g)`` of the closed form: ``f = exp(-aΔ/n)``, ``g = Δ·(1-e^{-aΔ/n})/(1-e^{-aΔ})`` (``g = Δ/n`` in
    the limit ``aΔ -> 0``). ``a_dt = a·Δ >= 0`` and ``dt`` broadcast together."""
    f = torch.exp(-a_dt / n)
    limit = torch.ones_like(a_dt) / n  # aΔ -> 0
    ratio = torch.expm1(-a_dt / n) / torch.expm1(-a_dt).clamp(max=-1e-30)
    return f, dt * torch.where(a_dt < 1e-6, limit, ratio)


def ssm_step(
    h: torch.Tensor, a: torch.Tensor, dt: torch.Tensor, bx: torch.Tensor, n: float = 1.0, mode: str = "dt"
) -> torch.Tensor:
    """One update ``h [B, H, P, N]``; ``a [H]`` (> 0), ``dt [B, H]``, ``bx = B_t x_t [B, H, P, N]``.

    ``n = 1``: ``exp(-aΔ)·h + Δ·bx``. ``mode="dt"``: ``Δ -> Δ/n``. ``mode="exact"``: the closed-form gates."""
    if mode == "exact":
        f, g = upi_gates(a * dt, dt, n)
    else:
        dt = dt / n
        f, g = torch.exp(-a * dt), dt
    return f[..., None, None] * h + g[..., None, None] * bx


class Mamba2Mixer(nn.Module):
    """A Mamba2-style mixer (scalar decay per head, input-dependent ``Δ, B, C``, gated output); the scan in
    its quadratic (SSD) form (``scan="parallel"``, default) or as the sequential loop (``scan="loop"``).

    ``x [B, T, d_model] -> [B, T, d_model]``. ``dt_scale [H]`` (buffer, 1 by default) divides ``Δ``: ``Δ/n``
    under UPI; ``mode="exact"`` uses the closed-form gates with ``n = dt_scale`` instead."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, d_state: int) -> None:
        super().__init__()
        self.h, self.p, self.n = n_heads, head_dim, d_state
        self.in_proj = nn.Linear(d_model, 2 * n_heads * head_dim + 2 * d_state + n_heads, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.a_log = nn.Parameter(torch.log(torch.linspace(0.5, 8.0, n_heads)))
        self.dt_bias = nn.Parameter(
            torch.log(torch.expm1(torch.exp(torch.linspace(math.log(1e-3), math.log(0.1), n_heads))))
        )
        self.d = nn.Parameter(torch.ones(n_heads))
        self.register_buffer("dt_scale", torch.ones(n_heads), persistent=False)
        self.mode = "dt"
        self.scan = "parallel"  # "loop": the sequential recurrence (the parallel form's tested reference)

    def _parallel(
        self, xs: torch.Tensor, bm: torch.Tensor, cm: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
        scale: torch.Tensor,
    ) -> torch.Tensor:
        """The same recurrence in its quadratic (SSD) form: with ``log f_k`` and ``g_j`` the gates of the
        loop, ``y_t = Σ_{j<=t} (C_t·B_j)·g_j·exp(Σ_{k=j+1}^{t} log f_k)·x_j + D·x_t``.

        ``xs [B, T, H, P]``, ``bm, cm [B, T, N]``, ``dt [B, T, H]`` -> ``y [B, T, H, P]``. Both modes have
        ``log f = -aΔ/n``; they differ in ``g`` (``Δ/n`` or the closed-form gate)."""
        t = xs.shape[1]
        if self.mode == "exact":
            _, g = upi_gates(a * dt, dt, scale)
        else:
            g = dt / scale
        logf = -a * dt / scale  # [B, T, H]
        cum = logf.cumsum(1).transpose(1, 2)  # S_t: [B, H, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=xs.device).tril()
        # log of g_j·exp(S_t - S_j), -inf above the diagonal: [B, H, T, T]
        seg = cum[..., :, None] - cum[..., None, :] + g.log().transpose(1, 2)[:, :, None, :]
        m = torch.einsum("btn,bjn->btj", cm, bm)[:, None] * seg.masked_fill(~causal, float("-inf")).exp()
        y = torch.einsum("bhtj,bjhp->bthp", m, xs)  # [B, T, H, P]
        return y + self.d[:, None] * xs

    def forward(self, x: torch.Tensor, *, return_dt: bool = False) -> Any:
        b, t, _ = x.shape
        hp = self.h * self.p
        xs, z, bm, cm, dt = torch.split(self.in_proj(x), [hp, hp, self.n, self.n, self.h], dim=-1)
        xs = nn.functional.silu(xs).view(b, t, self.h, self.p)  # [B, T, H, P]
        dt = nn.functional.softplus(dt + self.dt_bias)  # [B, T, H]
        a = torch.exp(self.a_log)  # [H], decay rate a > 0
        scale = self.dt_scale
        if self.scan == "parallel":
            y = self._parallel(xs, bm, cm, dt, a, scale).reshape(b, t, hp) * nn.functional.silu(z)
            out = self.out_proj(y)
            return (out, (dt, bm, cm)) if return_dt else out
        state = x.new_zeros(b, self.h, self.p, self.n)
        ys = []
        for i in range(t):
            bx = xs[:, i, :, :, None] * bm[:, i, None, None, :]  # [B, H, P, N]
            if self.mode == "exact":  # closed-form gates with n = dt_scale per head
                f, g = upi_gates(a * dt[:, i], dt[:, i], scale)
            else:  # Δ -> Δ/n
                step_dt = dt[:, i] / scale
                f, g = torch.exp(-a * step_dt), step_dt
            state = f[..., None, None] * state + g[..., None, None] * bx
            ys.append((state * cm[:, i, None, None, :]).sum(-1) + self.d[:, None] * xs[:, i])  # [B, H, P]
        y = torch.stack(ys, dim=1).reshape(b, t, hp) * nn.functional.silu(z)
        out = self.out_proj(y)
        return (out, (dt, bm, cm)) if return_dt else out


def erf_mmd(mixer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
    """MMD ``[H]`` of each head for the last token of ``x [B, T, d_model]`` (averaged over the batch)."""
    with torch.no_grad():
        b, t, _ = x.shape
        hp = mixer.h * mixer.p
        _, _, bm, cm, dt = torch.split(mixer.in_proj(x), [hp, hp, mixer.n, mixer.n, mixer.h], dim=-1)
        dt = nn.functional.softplus(dt + mixer.dt_bias) / mixer.dt_scale  # [B, T, H]
        a = torch.exp(mixer.a_log)
        cb = (cm[:, -1:, :] * bm).sum(-1)  # C_L·B_j: [B, T]
        after = dt.flip(1).cumsum(1).flip(1) - dt  # Σ_{k=j+1}^{L} Δ_k: [B, T, H]
        m = (cb[..., None] * dt * torch.exp(-a * after)).abs()  # |M_{L,j}|: [B, T, H]
        dist = (t - 1 - torch.arange(t, dtype=x.dtype))[None, :, None]  # L - j (0-based j, L = t - 1)
        return ((dist * m).sum(1) / m.sum(1).clamp_min(1e-30)).mean(0)


@dataclass
class HybridConfig:
    vocab_size: int = 64
    d_model: int = 64
    layers: str = "MAMA"  # M: Mamba2 mixer, A: attention (RoPE), each followed by an MLP
    n_heads: int = 4  # attention heads and Mamba heads
    head_dim: int = 16
    d_state: int = 16
    rope_theta: float = 10000.0
    max_position_embeddings: int = 128  # the training length L


class _Attention(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.h, self.d = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("original_inv_freq", inv.clone(), persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
        ang = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None]
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos() * self.attention_scaling, ang.sin() * self.attention_scaling

        def rot(u: torch.Tensor) -> torch.Tensor:
            return u * cos + torch.cat((-u[..., self.d // 2 :], u[..., : self.d // 2]), -1) * sin

        out = nn.functional.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class HybridLM(nn.Module):
    """A small hybrid language model: ``layers`` of Mamba2 mixers (``M``) and RoPE attention (``A``), pre-norm
    residual blocks with an MLP each. ``ids [B, T] -> logits [B, T, V]``."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.mixers = nn.ModuleList(
            Mamba2Mixer(cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_state) if c == "M" else _Attention(cfg)
            for c in cfg.layers
        )
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.d_model) for _ in cfg.layers)
        self.mlps = nn.ModuleList(
            nn.Sequential(
                nn.RMSNorm(cfg.d_model),
                nn.Linear(cfg.d_model, 2 * cfg.d_model),
                nn.GELU(),
                nn.Linear(2 * cfg.d_model, cfg.d_model),
            )
            for _ in cfg.layers
        )
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.longlab_position = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for mixer, norm, mlp in zip(self.mixers, self.norms, self.mlps):
            x = x + mixer(norm(x))
            x = x + mlp(x)
        return self.head(self.norm(x))

    def mamba_inputs(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The normalised input of every Mamba layer ``{index: [B, T, d_model]}`` (for the ERF metric)."""
        out = {}
        with torch.no_grad():
            x = self.emb(ids)
            for i, (mixer, norm, mlp) in enumerate(zip(self.mixers, self.norms, self.mlps)):
                if isinstance(mixer, Mamba2Mixer):
                    out[i] = norm(x)
                x = x + mixer(norm(x))
                x = x + mlp(x)
        return out

    def apply_position_method(self, method: PositionMethod) -> None:
        """How :func:`longlab.position.apply_position` reaches this model (it has no transformers rotary)."""
        if not hasattr(method, "apply_hybrid"):
            raise LonglabError(f"{method.name} does not apply to the hybrid Mamba2-attention model; use upi")
        method.apply_hybrid(self)


@register_position("upi")
@dataclass
class UPI(PositionMethod):
    """UPI ("From Collapse to Control", ICLR 2026): ``Δ <- Δ/n`` on the ``top`` fraction of Mamba heads by
    ERF (``heads="top"``; ``"all"``: every head; ``"none"``: no Mamba scaling), YaRN with ``s = n`` on the
    attention layers (``yarn=false``: none). ``mode="exact"`` uses the closed-form gates instead of ``Δ/n``.
    ERF calibration: ``calib`` random-token sequences of the training length (seeded). Only for
    :class:`HybridLM`."""

    paper = "From Collapse to Control (UPI), ICLR 2026"
    factor: float = param(2.0, low=1, high=MAX_FACTOR)
    top: float = param(0.2, low=0, high=1, low_open=True)
    heads: str = param("top", choices=("top", "all", "none"))
    yarn: bool = param(True, choices=(True, False))
    mode: str = param("dt", choices=("dt", "exact"))
    calib: int = param(8, low=1, high=4096, integer=True)
    seed: int = param(0, low=0, high=MAX_SEED, integer=True)

    def validate(self) -> None:
        check_factor(self)

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        raise LonglabError(
            "upi applies to a hybrid Mamba2-attention model (longlab.position.upi.HybridLM), "
            "not to a transformers RoPE model; for attention-only models use yarn"
        )

    def apply_hybrid(self, model: HybridLM) -> dict[int, torch.Tensor]:
        """Scale ``model`` in place; returns the ERF (MMD) of every Mamba layer's heads."""
        cfg = model.cfg
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, cfg.vocab_size, (self.calib, cfg.max_position_embeddings), generator=g)
        mmd = {i: erf_mmd(model.mixers[i], x) for i, x in model.mamba_inputs(ids).items()}
        if self.heads != "none":
            flat = torch.cat([mmd[i] for i in sorted(mmd)])
            k = len(flat) if self.heads == "all" else max(1, int(round(self.top * len(flat))))
            chosen = set(torch.topk(flat, k).indices.tolist())
            idx = 0
            for i in sorted(mmd):
                mixer = model.mixers[i]
                for h in range(mixer.h):
                    if idx in chosen:
                        mixer.dt_scale[h] = self.factor
                    idx += 1
                mixer.mode = self.mode
        if self.yarn and self.factor > 1:
            for mixer in model.mixers:
                if isinstance(mixer, _Attention):
                    mixer.inv_freq = yarn_paper_inv_freq(
                        cfg.rope_theta, cfg.head_dim, self.factor, cfg.max_position_embeddings, 1.0, 32.0
                    )
                    mixer.attention_scaling = 0.1 * math.log(self.factor) + 1.0
        model.longlab_position = self
        return mmd
