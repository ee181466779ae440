"""ReST-KV: eviction by layer-wise output reconstruction with spatial-temporal smoothing.

An et al. 2026, "ReST-KV: Robust KV Cache Eviction with Layer-wise Output Reconstruction and
Spatial-Temporal Smoothing", ICLR 2026, arXiv:2605.08840 (official code: an-yongqi/rest-kv).

Removing token ``j`` from ``o = sum_i a_i v_i`` and renormalising gives ``o' = (o - a_j v_j)/(1 - a_j)``,
so ``o' - o = a_j/(1 - a_j) (o - v_j)``: the attention odds ratio times the value deviation, which is
exactly the layer's reconstruction error. Per query head ``h`` (``W_o^h`` its slice of ``o_proj``):

1. ``A [W, T]``: attention of the last ``W`` queries over the held keys (fp32, causal);
2. temporal smoothing, oldest to newest: ``acc <- alpha A_i + (1 - alpha) acc`` from ``acc = A_0``,
   giving ``a_j``;
3. ``o_bar = sum_{j < L-W} a_j v_j`` (window tokens excluded, not renormalised, as the code does);
4. ``s_j = a_j/(1 - a_j) * ||W_o^h (o_bar - v_j)||_2^tau`` (``use_wo=false``: the norm in value space),
   evaluated through the Gram matrix ``G_h = W_o^hT W_o^h`` ([D, D]), never a [T, hidden] tensor;
5. adaptive spatial smoothing (``pooling="adaptive"``): the drift ``t_h`` of the top-(C-W) positions
   between the first and second halves of the window (batch row 0, rank-aligned) sets a kernel
   ``k_h = max(k0, 2 floor(|t_h|/sigma) + 1)`` and shift ``floor(t_h/sigma)`` (``+1`` if ``t_h <= 0``),
   applied as a replicate-padded average pool; with ``sigma = 2000`` this is mostly avg-pool k0 = 5;
6. keep the top ``C - W`` of ``[0, L-W)`` plus the last ``W`` tokens.

GQA: the per-query-head scores are averaged over the heads sharing a KV head. Compression runs at
prefill only (decode appends); ``pyramid=true`` uses PyramidKV's per-layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..recipe import LonglabError, register
from .base import ScorerPolicy, group_mean, keep_top, window_attention

__all__ = ["RestKV", "ema_weights", "reconstruction_scores", "wo_gram", "adaptive_pool"]


def ema_weights(n: int, alpha: float, device=None) -> torch.Tensor:
    """Weights ``[n]`` of ``acc <- alpha x_i + (1 - alpha) acc`` over ``x_0..x_{n-1}`` with ``acc = x_0``."""
    i = torch.arange(n, device=device, dtype=torch.float64)
    w = alpha * (1 - alpha) ** (n - 1 - i)
    w[0] = (1 - alpha) ** (n - 1)
    return w.float()


def wo_gram(o_proj_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``G_h = W_o^hT W_o^h`` for each head: o_proj weight [hidden, H*D] -> [H, D, D] (fp32)."""
    hidden = o_proj_weight.shape[0]
    W = o_proj_weight.float().reshape(hidden, num_heads, -1).permute(1, 0, 2)  # [H, hidden, D]
    return W.transpose(1, 2) @ W


def reconstruction_scores(
    a: torch.Tensor, v: torch.Tensor, o_bar: torch.Tensor, gram: torch.Tensor | None = None, tau: float = 1.0
) -> torch.Tensor:
    """``s_j = a_j/(1-a_j) * ||W_o^h (o_bar - v_j)||^tau``.

    a: [B, H, T] attention; v: [B, H, T, D] values (repeated to query heads); o_bar: [B, H, D];
    gram: [H, D, D] or None (norm in value space). Returns [B, H, T] (fp32 or fp64).
    """
    dt = torch.promote_types(v.dtype, torch.float32)  # fp32, or fp64 when given fp64
    u = o_bar.to(dt)[:, :, None, :] - v.to(dt)  # [B, H, T, D]
    if gram is None:
        sq = (u * u).sum(-1)
    else:
        sq = (torch.matmul(u, gram.to(dt)[None]) * u).sum(-1)  # u^T G u: [B, H, T]
    norm = sq.clamp(min=0).sqrt()
    if tau != 1.0:
        norm = norm**tau
    a = a.to(dt)
    return a / (1 - a).clamp(min=1e-6) * norm


def adaptive_pool(
    scores: torch.Tensor, probs: torch.Tensor, n_top: int, kernel_size: int, scale: float
) -> torch.Tensor:
    """ReST-KV's adaptive window smoothing of ``scores`` [B, H, T] along T.

    probs: [H, W, T] window attention of batch row 0 (drift statistic); n_top: C - W positions compared.
    Each head gets its own kernel and shift; the pool is an average with replicate padding."""
    B, H, T = scores.shape
    W = probs.shape[1]
    half = W // 2
    out = torch.empty_like(scores)
    n_top = max(1, min(n_top, T))
    for h in range(H):
        k, shift = kernel_size, 0
        if half >= 1 and T > 1:
            p1 = probs[h, :half].topk(n_top, dim=-1).indices.float()  # [half, n_top], rank-aligned
            p2 = probs[h, half : 2 * half].topk(n_top, dim=-1).indices.float()
            drift = float((p1 - p2).mean())  # t_h, in tokens
            k = max(kernel_size, 2 * int(abs(drift) // scale) + 1)
            shift = int(drift // scale) if drift > 0 else int(drift // scale) + 1
        left, right = max(0, k // 2 - shift), max(0, k // 2 + shift)
        x = F.pad(scores[:, h : h + 1], (left, right), mode="replicate")  # [B, 1, T + left + right]
        y = F.avg_pool1d(x, k, stride=1)
        if y.shape[-1] < T:
            y = F.pad(y, (0, T - y.shape[-1]), mode="replicate")
        out[:, h] = y[:, 0, :T]
    return out


@register("restkv")
@dataclass
class RestKV(ScorerPolicy):
    """ReST-KV (An et al. 2026, arXiv:2605.08840): ``s_j = a_j/(1-a_j) ||W_o^h(o_bar - v_j)||`` with EMA
    temporal smoothing (``alpha``) and adaptive spatial pooling; keeps the last ``window_size`` tokens."""

    paper = "arXiv:2605.08840"
    window_size: int = 32
    alpha: float = 0.3
    use_wo: bool = True
    tau: float = 1.0
    pooling: str = "adaptive"  # adaptive | avg | none
    kernel_size: int = 5  # k0
    scale: float = 2000.0  # sigma
    pyramid: bool = False
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if self.window_size < 1:
            raise LonglabError(f"restkv: window_size must be >= 1, got {self.window_size!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise LonglabError(f"restkv: alpha must be in (0, 1], got {self.alpha!r}")
        if not isinstance(self.use_wo, bool) or not isinstance(self.pyramid, bool):
            raise LonglabError("restkv: use_wo and pyramid must be true or false")
        if not self.tau > 0:
            raise LonglabError(f"restkv: tau must be > 0, got {self.tau!r}")
        if self.pooling not in ("adaptive", "avg", "none"):
            raise LonglabError(f"restkv: pooling must be 'adaptive', 'avg' or 'none', got {self.pooling!r}")
        k0 = self.kernel_size
        if isinstance(k0, bool) or not isinstance(k0, int) or k0 < 1 or k0 % 2 == 0:
            raise LonglabError(f"restkv: kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")
        if not self.scale > 0:
            raise LonglabError(f"restkv: scale must be > 0, got {self.scale!r}")
        if not self.beta >= 1:
            raise LonglabError(f"restkv: beta must be >= 1, got {self.beta!r}")

    def target(self, ctx) -> torch.Tensor:
        C = super().target(ctx)  # [B] average per-layer budget
        if not self.pyramid:
            return C
        W, L = self.window_size, max(ctx.num_layers, 2)  # PyramidKV's linear schedule, averaging C
        rest = torch.clamp(C - W, min=0).double()
        k_last = rest / self.beta
        k_first = 2 * rest - k_last
        room = (ctx.n_real - W).clamp(min=0).double()  # k_0 holds at most the non-window tokens:
        k_last = torch.where(k_first > room, 2 * rest - room, k_last)  # flatten so layers still average C
        k_first = torch.minimum(k_first, room)
        step = torch.floor((k_first - k_last) / (L - 1))
        return torch.clamp((k_first - ctx.layer_idx * step).long() + W, min=1)

    def head_scores(self, ctx, probs: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Unpooled ReST-KV scores per query head: [B, H, T] (0 outside ``candidates``)."""
        g = ctx.groups
        w = ema_weights(probs.shape[2], self.alpha, probs.device)
        a = torch.einsum("bhwt,w->bht", probs, w)  # [B, H, T] EMA-smoothed attention
        cand = candidates.repeat_interleave(g, dim=1)  # [B, H, T]
        v = ctx.v.float().repeat_interleave(g, dim=1)  # [B, H, T, D]
        o_bar = torch.einsum("bht,bhtd->bhd", a * cand, v)  # window tokens excluded
        gram = wo_gram(ctx.module.o_proj.weight, ctx.q.shape[1]) if self.use_wo else None
        s = reconstruction_scores(a, v, o_bar, gram, self.tau)
        return s.masked_fill(~cand, 0.0)

    def select(self, ctx) -> torch.Tensor | None:
        C = self.target(ctx)  # [B]
        valid = ctx.layer.valid
        if bool((valid.sum(-1) <= C[:, None]).all()):
            return None
        protected = self.protected(ctx, C) & valid  # [B, H_kv, T] last W tokens
        candidates = valid & ~protected
        probs = window_attention(ctx, self.window_size)  # [B, H, w, T]
        s = self.head_scores(ctx, probs, candidates)  # [B, H, T]
        T = s.shape[-1]
        n_win = int(protected[0].sum(-1).max())
        region = slice(0, max(1, T - n_win))  # candidate slots [0, L - W) for an unpadded layout
        if self.pooling != "none":  # "avg": no drift statistic (zero window rows), plain replicate-padded avg
            stats = probs[0, :, :, region] if self.pooling == "adaptive" else probs[0, :, :0, region]
            n_top = int(C[0]) - n_win
            s[..., region] = adaptive_pool(s[..., region], stats, n_top, self.kernel_size, self.scale)
        scores = group_mean(s, ctx.groups)  # [B, H_kv, T]
        return keep_top(scores, C, valid, protected)
