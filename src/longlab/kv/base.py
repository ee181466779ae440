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

from ..recipe import LonglabError, Method

if TYPE_CHECKING:
    from ..attention import LayerContext

__all__ = ["KVPolicy", "ScorerPolicy", "keep_top", "window_attention", "pool_scores", "group_mean"]


@dataclass
class KVPolicy(Method):
    """A KV policy acting after each prefill chunk (and optionally at decode steps).

    ``compression_ratio`` is the fraction of entries removed (the kvpress convention): a layer that
    has seen ``n`` tokens keeps ``ceil((1 - compression_ratio) * n)`` entries per head on average.
    ``budget`` instead fixes the number of entries kept per head. Set one, not both.
    """

    kind: ClassVar[str] = "kv"
    needs_observe: ClassVar[bool] = False  # wants observe(ctx) on every forward (e.g. H2O)

    compression_ratio: float = 0.0
    budget: int | None = None

    def validate(self) -> None:
        r = self.compression_ratio
        if not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
            raise LonglabError(f"{self.name}: compression_ratio must be in [0, 1), got {r!r}")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget <= 0:
                raise LonglabError(
                    f"{self.name}: budget must be a positive integer (tokens kept), got {self.budget!r}"
                )
            if r > 0:
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


def pool_scores(scores: torch.Tensor, kernel_size: int, mode: str = "avg") -> torch.Tensor:
    """1-D pooling along the slot axis (SnapKV's clustering): [B, H_kv, T] -> [B, H_kv, T]."""
    if kernel_size <= 1:
        return scores
    B, H, T = scores.shape
    x = scores.reshape(B * H, 1, T)
    if mode == "max":
        y = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        y = F.avg_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False)
    return y[..., :T].reshape(B, H, T)


@dataclass
class ScorerPolicy(KVPolicy):
    """Score every held entry, protect the last ``window_size`` and first ``sink_size`` tokens of the
    stream, keep the ``target`` best per head."""

    window_size: int = 0
    sink_size: int = 0

    def validate(self) -> None:
        super().validate()
        for name in ("window_size", "sink_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LonglabError(f"{self.name}: {name} must be an integer >= 0, got {value!r}")

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
