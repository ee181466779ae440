"""Base classes for KV policies.

Two-level extension point (STYLE.md): a policy may implement ``select(ctx) -> keep mask``; most
implement only ``score(ctx) -> [B, H_kv, T]`` (higher = keep) and inherit the budget, protection
of recent/sink tokens and top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from ..cache import LonglabLayer
from ..recipe import LonglabError, Method
from ..registry import MAX_TOKENS, param

if TYPE_CHECKING:
    from ..attention import LayerContext

__all__ = [
    "KVPolicy",
    "ScorerPolicy",
    "keep_top",
    "window_attention",
    "pool_scores",
    "group_mean",
    "outside_window",
    "snapkv_scores",
    "RepeatedKVLayer",
    "repeat_kv_heads",
]


@dataclass
class KVPolicy(Method):
    """A KV policy acting after each prefill chunk (and optionally at decode steps).

    ``compression_ratio`` is the fraction of entries removed (the kvpress convention): a layer that
    has seen ``n`` tokens keeps ``ceil((1 - compression_ratio) * n)`` entries per head on average.
    ``budget`` instead fixes the number of entries kept per head. Set one, not both.
    """

    kind: ClassVar[str] = "kv"
    needs_observe: ClassVar[bool] = False  # wants observe(ctx) on every forward (e.g. H2O)
    # A policy that overrides select_decode (or updates its state at decode) sets acts_during_decode;
    # one that keeps decode-time state outside layer.extras / layer.state sets batch_select_safe False.
    acts_during_decode: ClassVar[bool] = False
    batch_select_safe: ClassVar[bool] = True  # per-slot state lives in layer.extras (batch first)

    compression_ratio: float = param(0.0, low=0, high=1, high_open=True)
    budget: int | None = param(None, low=1, high=MAX_TOKENS, integer=True)  # entries kept per head

    @property
    def observation_window(self) -> int:
        """The last-chunk queries this policy's compression reads: its ``window_size`` (0 without one)."""
        return int(getattr(self, "window_size", 0) or 0)

    def validate(self) -> None:
        if self.budget is not None and self.compression_ratio > 0:
            raise LonglabError(f"{self.name}: set compression_ratio or budget, not both")

    def target(self, ctx: LayerContext) -> torch.Tensor:
        """``[B]`` entries to keep per head in this layer."""
        n = ctx.n_real
        if self.budget is not None:
            return torch.clamp(n, max=self.budget)
        return torch.clamp(torch.ceil((1.0 - self.compression_ratio) * n.double() - 1e-9).long(), min=1)

    def select(self, ctx: LayerContext) -> torch.Tensor | None:
        """``[B, H_kv, T]`` bool keep mask after a prefill chunk, or None to keep everything."""
        return None

    def select_decode(self, ctx: LayerContext) -> torch.Tensor | None:
        """Keep mask after a decode step (None: no decode-time eviction)."""
        return None

    def observe(self, ctx: LayerContext) -> None:
        """Called before attention on every forward when ``needs_observe``."""


def keep_top(
    scores: torch.Tensor, n_keep: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep mask of the ``n_keep[b, h]`` best valid slots per head; protected slots rank first.

    scores, valid, protected: [B, H_kv, T]; n_keep: [B, H_kv] or [B]. Returns [B, H_kv, T] bool.
    """
    scores = scores.float().masked_fill(~valid, float("-inf"))
    if protected is not None:
        finite = scores.masked_fill(~torch.isfinite(scores), 0)
        top = finite.abs().amax() + 1.0
        order = torch.arange(scores.shape[-1], device=scores.device, dtype=scores.dtype)
        scores = torch.where(protected & valid, 2 * top + order / scores.shape[-1], scores)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    if n_keep.dim() == 1:
        n_keep = n_keep[:, None]
    return (ranks < n_keep[..., None]) & valid


def group_mean(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Average query heads sharing a KV head: [B, H, ...] -> [B, H_kv, ...]."""
    B, H = x.shape[:2]
    return x.reshape(B, H // groups, groups, *x.shape[2:]).mean(2)


def window_attention(ctx: LayerContext, window_size: int) -> torch.Tensor:
    """Attention of the last ``window_size`` queries of this chunk over the held keys: [B, H, W, T]."""
    T_q = ctx.q.shape[-2]
    return ctx.attention_probs(slice(max(0, T_q - window_size), T_q))


def pool_scores(
    scores: torch.Tensor, kernel_size: int, mode: str = "avg", region: torch.Tensor | None = None
) -> torch.Tensor:
    """1-D pooling along the slot axis (SnapKV's clustering), as the reference code pools:
    ``avg_pool1d(k, stride=1, padding=k//2)`` with the zero padding counted (``count_include_pad``: every
    output is a sum over ``k`` slots divided by ``k``), or ``max_pool1d`` (padding never wins).

    scores: [B, h, T] (h = H or H_kv); region: [B, h or 1, T] bool, the slots that enter the pooling (the
    others count as padding: 0 for avg, -inf for max). Pass the non-window slots to pool "over the
    non-window part only" as ``snapkv_utils`` does (``scores[..., :L-W]``); outputs outside the region
    are meaningless (callers protect or mask those slots). Returns [B, h, T]."""
    if region is not None:
        scores = scores.masked_fill(~region, float("-inf") if mode == "max" else 0.0)
    if kernel_size <= 1:
        return scores
    B, H, T = scores.shape
    x = scores.reshape(B * H, 1, T)
    if mode == "max":
        y = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        y = F.avg_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=True)
    return y[..., :T].reshape(B, H, T)


def outside_window(ctx: LayerContext, window_size: int) -> torch.Tensor:
    """[B, H_kv, T] bool: held (valid) slots older than the row's last ``window_size`` tokens."""
    idx = ctx.key_index
    return (idx >= 0) & (idx < (ctx.n_real - window_size)[:, None, None])


def snapkv_scores(
    ctx: LayerContext,
    window_size: int,
    kernel_size: int,
    pooling: str = "avg",
    reduce: str = "sum",
    region: torch.Tensor | None = None,
) -> torch.Tensor:
    """SnapKV-family scores in the reference order (kvpress ``SnapKVPress``; ``snapkv_utils``):

    1. ``A [B, H, w, T]``: attention of the last ``w = min(W, T_q)`` queries over the held keys (fp32,
       causal, softmax over every held key);
    2. per query head, ``s_j = sum_i A_ij`` (``reduce="mean"``: the mean) over the window queries;
    3. 1-D pooling along the slots per query head, over the non-window slots only (``region``, default
       :func:`outside_window`), zero padding counted (:func:`pool_scores`);
    4. mean over the query heads sharing a KV head.

    Returns [B, H_kv, T]; slots outside ``region`` score 0 (the window is protected by the caller)."""
    probs = window_attention(ctx, window_size)  # [B, H, w, T]
    s = probs.sum(2) if reduce == "sum" else probs.mean(2)  # [B, H, T]
    if region is None:
        region = outside_window(ctx, window_size)  # [B, H_kv, T]
    g = ctx.groups
    per_head = region.repeat_interleave(g, dim=1) if g > 1 and region.shape[1] > 1 else region
    s = pool_scores(s, kernel_size, pooling, per_head).masked_fill(~per_head, 0.0)
    return group_mean(s, g)


class RepeatedKVLayer(LonglabLayer):
    """A full-precision cache layer whose KV heads were repeated to one per query head
    (:func:`repeat_kv_heads`): it holds ``[B, H, T, D]`` and repeats each incoming ``[B, H_kv, t, D]``
    entry ``kv_repeat`` times along the head axis, so every query head keeps its own token set."""

    kv_repeat: int = 1
    # its rows hold H heads, not H_kv: it cannot be stacked with other branches' layers as batch rows
    batchable: ClassVar[bool] = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H_kv, t, D] -> stored as [B, H_kv * kv_repeat, t, D]
        if self.is_initialized and key_states.shape[1] * self.kv_repeat == self.index.shape[1]:
            key_states = key_states.repeat_interleave(self.kv_repeat, dim=1)
            value_states = value_states.repeat_interleave(self.kv_repeat, dim=1)
        return super().update(key_states, value_states, *args, **kwargs)


def repeat_kv_heads(ctx: LayerContext) -> LonglabLayer:
    """Give every query head its own copy of its KV head's entries, so a policy can keep a different token
    set per query head under GQA, as code built on KVCache-Factory does (it repeats K/V to H heads before
    selecting and caches the repeated heads). The layer (``ctx.layer``, replaced in ``ctx.cache``) becomes
    ``[B, H, T, D]`` with ``kv_repeat = H / H_kv``; its bytes grow by that factor, which ``nbytes`` counts
    and ``LonglabCache.full_nbytes`` does not (it divides it out). Per-slot extras are repeated with the
    slots; per-layer ``state`` is left as is. Returns the (new) layer; a no-op without GQA."""
    layer, g = ctx.layer, ctx.groups
    if g == 1:
        return layer

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(g, dim=1)

    if getattr(layer, "dequantized_keys", None) is not None:  # packed storage (longlab.quant.storage)
        layer.keys, layer.values = rep(layer.keys), rep(layer.values)
        layer.sink_keys, layer.sink_values = rep(layer.sink_keys), rep(layer.sink_values)
        for store in (layer.key_store, layer.value_store):
            store.map(rep)
            if getattr(store, "channel_scale", None) is not None:
                store.channel_scale = rep(store.channel_scale)
        new = layer
    else:
        new = RepeatedKVLayer.__new__(RepeatedKVLayer)
        new.__dict__.update(layer.__dict__)
        new.keys, new.values = rep(layer.keys), rep(layer.values)
    new.index = rep(layer.index)
    new.extras = {k: rep(v) for k, v in layer.extras.items()}
    new.kv_repeat = getattr(layer, "kv_repeat", 1) * g
    if new is not layer:
        if ctx.cache is not None:
            ctx.cache.layers[ctx.layer_idx] = new
        ctx.layer = new
    return new


@dataclass
class ScorerPolicy(KVPolicy):
    """Score every held entry, protect the last ``window_size`` and first ``sink_size`` tokens of the
    stream, keep the ``target`` best per head."""

    window_size: int = param(0, low=0, high=MAX_TOKENS, integer=True)
    sink_size: int = param(0, low=0, high=MAX_TOKENS, integer=True)

    def score(self, ctx: LayerContext) -> torch.Tensor:  # [B, H_kv, T]
        raise NotImplementedError

    def protected(self, ctx: LayerContext, n_keep: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, T] slots that always stay (recent window, sinks)."""
        idx = ctx.key_index  # positions: 0 is the first real token of the row
        prot = idx >= (ctx.n_real - self.window_size)[:, None, None]
        if self.sink_size:
            prot |= (idx >= 0) & (idx < self.sink_size)
        return prot

    def select(self, ctx: LayerContext) -> torch.Tensor | None:
        n_keep = self.target(ctx)  # [B]
        valid = ctx.layer.valid
        if bool((valid.sum(-1) <= n_keep[:, None]).all()):
            return None
        return keep_top(self.score(ctx), n_keep, valid, self.protected(ctx, n_keep))
