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
   (over every held key, window included, as the code sorts whole attention rows) between the first and
   second halves of the window (batch row 0, rank-aligned) sets a kernel
   ``k_h = max(k0, 2 floor(|t_h|/sigma) + 1)`` and shift ``floor(t_h/sigma)`` (``+1`` if ``t_h <= 0``),
   applied over ``[0, L-W)`` as a replicate-padded average pool; with ``sigma = 2000`` this is mostly
   avg-pool k0 = 5; ``pooling="avg"`` is the code's ``avgpool``: ``avg_pool1d(k0, padding=k0//2)`` with
   zero padding counted;
6. keep the top ``C - W`` of ``[0, L-W)`` plus the last ``W`` tokens.

GQA (``gqa``): the official code (on KVCache-Factory) repeats K/V to the ``H`` query heads before
scoring and caches the repeated heads, so each *query head* keeps its own ``C`` tokens. ``gqa="query"``
(default) does the same: the layer is expanded to one KV head per query head
(:func:`~longlab.kv.base.repeat_kv_heads`), which holds ``H / H_kv`` times the bytes of a per-KV-head
policy at the same ratio (``nbytes`` counts it). ``gqa="mean"`` averages the per-query-head scores over
the heads sharing a KV head and keeps ``C`` tokens per KV head. Compression runs at prefill only
(decode appends); ``pyramid=true`` uses PyramidKV's per-layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..recipe import LonglabError, register
from ..registry import MAX_BLOCK, MAX_TOKENS, param
from .base import ScorerPolicy, group_mean, keep_top, pool_scores, repeat_kv_heads, window_attention

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
    W = o_proj_weight.detach().float().reshape(hidden, num_heads, -1).permute(1, 0, 2)  # [H, hidden, D]
    return W.transpose(1, 2) @ W


def reconstruction_scores(
    a: torch.Tensor, v: torch.Tensor, o_bar: torch.Tensor, gram: torch.Tensor | None = None, tau: float = 1.0
) -> torch.Tensor:
    """``s_j = a_j/(1-a_j) * ||W_o^h (o_bar - v_j)||^tau`` per query head.

    a: [B, H, T] attention; v: [B, H_kv, T, D] values (query head h reads KV head h // (H/H_kv));
    o_bar: [B, H, D]; gram: [H, D, D] or None (norm in value space). Returns [B, H, T] (fp32, or fp64
    when given fp64). The squared norm is expanded as ``o.Go - 2 (Go).v + v.Gv`` so no [B, H, T, D]
    difference tensor is formed: ``v.Gv`` is one [T, D] x [D, g*D] product per KV head.
    """
    dt = torch.promote_types(v.dtype, torch.float32)
    B, H, T = a.shape
    H_kv, D = v.shape[1], v.shape[-1]
    g = H // H_kv
    v, o_bar = v.to(dt), o_bar.to(dt)
    if gram is None:
        gram = torch.eye(D, dtype=dt, device=v.device).expand(H, D, D)
    gram = gram.to(dt)
    g_cat = gram.reshape(H_kv, g, D, D).permute(0, 2, 1, 3).reshape(H_kv, D, g * D)  # [H_kv, D, g*D]
    vgv = ((v @ g_cat).reshape(B, H_kv, T, g, D) * v[:, :, :, None, :]).sum(-1)  # [B, H_kv, T, g]
    go = torch.einsum("hde,bhe->bhd", gram, o_bar)  # [B, H, D]  G o_bar
    cross = v @ go.reshape(B, H_kv, g, D).transpose(-1, -2)  # [B, H_kv, T, g]  (G o_bar).v
    ogo = (go * o_bar).sum(-1).reshape(B, H_kv, 1, g)  # o_bar.G o_bar
    sq = (ogo - 2 * cross + vgv).permute(0, 1, 3, 2).reshape(B, H, T)
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
    The drift ``t_h = mean_{i, r}(P1_{i,r} - P2_{i,r})`` of rank-aligned top positions equals the
    difference of the mean top-``n_top`` position of the first- and second-half rows, so one unsorted
    top-k serves every head. Each head gets its kernel and shift; the pool is a replicate-padded
    average (heads sharing a kernel and shift are pooled together)."""
    B, H, T = scores.shape
    half = probs.shape[1] // 2
    n_top = max(1, min(n_top, T))
    k = torch.full((H,), kernel_size, dtype=torch.long)
    shift = torch.zeros(H, dtype=torch.long)
    if half >= 1 and T > 1:
        top = probs[:, : 2 * half].topk(n_top, dim=-1, sorted=False).indices.double().mean(-1)  # [H, 2*half]
        drift = (top[:, :half] - top[:, half:]).mean(-1).cpu()  # t_h, in tokens
        k = torch.clamp(2 * torch.floor(drift.abs() / scale).long() + 1, min=kernel_size)
        shift = torch.where(drift > 0, torch.floor(drift / scale), torch.floor(drift / scale) + 1).long()
    out = torch.empty_like(scores)
    for kh, sh in sorted({(int(a), int(b)) for a, b in zip(k, shift)}):
        heads = [h for h in range(H) if int(k[h]) == kh and int(shift[h]) == sh]
        left, right = max(0, kh // 2 - sh), max(0, kh // 2 + sh)
        x = F.pad(scores[:, heads].reshape(B * len(heads), 1, T), (left, right), mode="replicate")
        y = F.avg_pool1d(x, kh, stride=1)  # [B*h, 1, T + left + right - kh + 1]
        if y.shape[-1] < T:
            y = F.pad(y, (0, T - y.shape[-1]), mode="replicate")
        out[:, heads] = y[:, 0, :T].reshape(B, len(heads), T)
    return out


@register("restkv")
@dataclass
class RestKV(ScorerPolicy):
    """ReST-KV (An et al. 2026, arXiv:2605.08840): ``s_j = a_j/(1-a_j) ||W_o^h(o_bar - v_j)||`` with EMA
    temporal smoothing (``alpha``) and adaptive spatial pooling; keeps the last ``window_size`` tokens and,
    under GQA, a token set per query head (``gqa="query"``, the official code) or per KV head (``"mean"``)."""

    paper = "arXiv:2605.08840"
    window_size: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    alpha: float = param(0.3, low=0, high=1, low_open=True)  # EMA weight of the newer query
    use_wo: bool = param(True, choices=(True, False))
    # exponent of the reconstruction norm: norm^tau stays finite in fp32 up to 10 for any norm below 1e3
    tau: float = param(1.0, low=0, high=10, low_open=True)
    pooling: str = param("adaptive", choices=("adaptive", "avg", "none"))
    kernel_size: int = param(5, low=1, high=MAX_BLOCK, integer=True)  # k0, odd (checked below)
    # sigma, in tokens: a drift is divided by it, so beyond MAX_TOKENS every kernel is k0
    scale: float = param(2000.0, low=0, high=MAX_TOKENS, low_open=True)
    pyramid: bool = param(False, choices=(True, False))
    beta: float = param(20.0, low=1, high=MAX_TOKENS)  # PyramidKV's beta (see pyramidkv)
    # select per query head (official code) or per KV head (group mean)
    gqa: str = param("query", choices=("query", "mean"))

    def validate(self) -> None:
        super().validate()
        if self.kernel_size % 2 == 0:
            raise LonglabError(f"restkv: kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")

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
        v = ctx.v.float()  # [B, H_kv, T, D]
        B, H, T = a.shape
        o_bar = ((a * cand).reshape(B, H // g, g, T) @ v).reshape(B, H, -1)  # [B, H, D], window excluded
        gram = wo_gram(ctx.module.o_proj.weight, H) if self.use_wo else None
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
        if self.pooling == "adaptive":  # drift from whole attention rows of batch row 0, window included
            n_top = int(C[0]) - n_win
            s[..., region] = adaptive_pool(s[..., region], probs[0], n_top, self.kernel_size, self.scale)
        elif self.pooling == "avg":  # the code's avgpool: zero padding counted
            s[..., region] = pool_scores(s[..., region], self.kernel_size, "avg")
        g = ctx.groups
        if self.gqa == "mean" or g == 1:
            return keep_top(group_mean(s, g), C, valid, protected)  # [B, H_kv, T]
        repeat_kv_heads(ctx)  # ctx.layer now holds one KV head per query head: [B, H, T, D]
        valid, protected = valid.repeat_interleave(g, dim=1), protected.repeat_interleave(g, dim=1)
        return keep_top(s, C, valid, protected)  # [B, H, T], per query head
