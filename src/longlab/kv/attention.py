"""Attention-based eviction: H2O (accumulated attention), TOVA (last query), SnapKV (observation
window + pooling), PyramidKV (per-layer budgets), AdaKV (head-adaptive budgets)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipe import LonglabError, register
from .base import ScorerPolicy, group_mean, keep_top, snapkv_scores, window_attention

_H2O_STATE = "h2o_acc"


@register("h2o")
@dataclass
class H2O(ScorerPolicy):
    """Heavy-Hitter Oracle. Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
    Inference of LLMs", arXiv:2306.14048.

    Score ``s_j = sum_{i <= t} A_ij``: attention accumulated over every query seen (prefill and
    decode), per KV head (mean over its query heads). Keeps ``recent_fraction`` of the budget as the
    most recent tokens and fills the rest with the highest scores. Accumulation runs in query blocks,
    never materialising the n x n matrix.
    """

    paper = "arXiv:2306.14048"
    needs_observe = True
    recent_fraction: float = 0.5

    def validate(self) -> None:
        super().validate()
        self.check("recent_fraction", 0.0, 1.0)

    def observe(self, ctx) -> None:
        layer = ctx.layer
        acc = layer.extras.get(_H2O_STATE)
        if acc is None:
            acc = torch.zeros(layer.index.shape, dtype=torch.float32, device=layer.index.device)
        for rows in ctx.query_blocks():
            acc = acc + group_mean(ctx.attention_probs(rows).sum(2), ctx.groups)
        layer.extras[_H2O_STATE] = acc

    def score(self, ctx) -> torch.Tensor:
        return ctx.layer.extras[_H2O_STATE]

    def protected(self, ctx, n_keep: torch.Tensor) -> torch.Tensor:
        n_recent = torch.floor(n_keep.double() * self.recent_fraction).long()  # [B]
        return ctx.key_index >= (ctx.n_real - n_recent)[:, None, None]


@register("tova")
@dataclass
class TOVA(ScorerPolicy):
    """Token Omission Via Attention. Oren et al. 2024, "Transformers are Multi-State RNNs",
    arXiv:2401.06104. Score ``s_j = (1/H) sum_h A^h_{t,j}`` for the last query t, shared by all
    heads of the layer (heads keep the same tokens). No recent window."""

    paper = "arXiv:2401.06104"

    def score(self, ctx) -> torch.Tensor:
        probs = window_attention(ctx, 1)[:, :, -1]  # [B, H, T]
        shared = probs.mean(1, keepdim=True)  # [B, 1, T]
        return shared.expand(-1, ctx.k.shape[1], -1)


@register("snapkv")
@dataclass
class SnapKV(ScorerPolicy):
    """Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
    arXiv:2404.14469. Score ``s_j = mean_{h in group} pool_k(sum_{i in last W} A^h_ij)``: per query head,
    the window attention summed over the last W queries, pooled over the non-window slots only with the
    zero padding counted (``avg_pool1d(k, padding=k//2)``, as the official ``snapkv_utils`` and kvpress),
    then averaged over the query heads of a KV head (kvpress's GQA rule); keep the last W tokens plus
    the top ``target - W`` others (:func:`~longlab.kv.base.snapkv_scores`)."""

    paper = "arXiv:2404.14469"
    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"

    def validate(self) -> None:
        super().validate()
        self.check("pooling", choices=("avg", "max"))
        self.check("kernel_size", 1, integer=True)
        if self.kernel_size % 2 == 0:
            raise LonglabError(
                f"{self.name}: kernel_size must be an odd integer >= 1, got {self.kernel_size!r}"
            )
        self.check("window_size", 1, integer=True)

    def head_scores(self, ctx) -> torch.Tensor:
        """Window attention summed over the window queries, per query head: [B, H, T]."""
        return window_attention(ctx, self.window_size).sum(2)

    def score(self, ctx) -> torch.Tensor:  # [B, H_kv, T]
        return snapkv_scores(ctx, self.window_size, self.kernel_size, self.pooling, "sum")


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    """Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling", arXiv:2406.02069. SnapKV scores (per query head, pooled over the non-window slots,
    then the group mean: kvpress's order) with per-layer budgets decreasing linearly:
    ``k_{L-1} = (C-W)/beta``, ``k_0 = 2(C-W) - k_{L-1}``, ``k_l = k_0 - l*floor((k_0-k_{L-1})/(L-1))``,
    each plus W, so the layers average C."""

    paper = "arXiv:2406.02069"
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    beta: float = 20.0

    def target(self, ctx) -> torch.Tensor:
        C = super().target(ctx)  # [B] average per-layer budget
        W = self.window_size
        L = max(ctx.num_layers, 2)
        rest = torch.clamp(C - W, min=0).double()
        k_last = rest / self.beta
        k_first = 2 * rest - k_last
        # k_0 can hold at most the n - W non-window tokens; then flatten the pyramid (raise k_last)
        # so the layers still average C instead of silently keeping less.
        room = (ctx.n_real - W).clamp(min=0).double()
        k_last = torch.where(k_first > room, 2 * rest - room, k_last)
        k_first = torch.minimum(k_first, room)
        step = torch.floor((k_first - k_last) / (L - 1))
        k_layer = k_first - ctx.layer_idx * step
        return torch.clamp(k_layer.long() + W, min=1)


@register("adakv")
@dataclass
class AdaKV(SnapKV):
    """Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation",
    arXiv:2407.11550. Head scores ``s^h = mean_{q in group(h)} maxpool(mean_{i in W} A^q_i)`` (pooled per
    query head over the non-window slots, then averaged over the GQA group, kvpress's order); the layer budget
    ``H_kv * B`` (``B = C - W``) is split by each head's share ``n_h`` of the layer-wide top
    ``H_kv * B`` scores, with a floor: ``B_h = round((1 - alpha) n_h + alpha B)``. Each head keeps
    its own top ``B_h`` plus the window — heads really hold different numbers of entries."""

    paper = "arXiv:2407.11550"
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    alpha: float = 0.2

    def validate(self) -> None:
        super().validate()
        self.check("alpha", 0.0, 1.0)

    def score(self, ctx, region: torch.Tensor | None = None) -> torch.Tensor:  # [B, H_kv, T]
        return snapkv_scores(ctx, self.window_size, self.kernel_size, self.pooling, "mean", region)

    def select(self, ctx) -> torch.Tensor | None:
        C = self.target(ctx)  # [B]
        layer = ctx.layer
        valid = layer.valid
        if bool((valid.sum(-1) <= C[:, None]).all()):
            return None
        # the window never exceeds the budget: it is the most recent min(W, C) tokens
        recent = torch.minimum(C, torch.full_like(C, self.window_size))
        window = (ctx.key_index >= (ctx.n_real - recent)[:, None, None]) & valid  # [B, H_kv, T]
        candidates = valid & ~window
        scores = self.score(ctx, candidates).masked_fill(~candidates, float("-inf"))
        B, H_kv, T = scores.shape
        budgets = torch.zeros(B, H_kv, dtype=torch.long, device=scores.device)
        for b in range(B):
            per_head = int(C[b]) - int(window[b].sum(-1).max())
            per_head = max(0, min(per_head, int(candidates[b].sum(-1).min())))
            total = per_head * H_kv
            if total == 0:
                continue
            flat = scores[b].reshape(-1)
            top = flat.topk(total).indices // T
            share = torch.bincount(top, minlength=H_kv).double()  # n_h
            raw = (1 - self.alpha) * share + self.alpha * per_head
            b_h = torch.floor(raw).long()
            short = total - int(b_h.sum())  # distribute rounding so the layer sum is exact
            if short > 0:
                b_h[torch.argsort(raw - b_h, descending=True)[:short]] += 1
            budgets[b] = torch.minimum(b_h, candidates[b].sum(-1))
        return keep_top(scores, budgets, candidates) | window
