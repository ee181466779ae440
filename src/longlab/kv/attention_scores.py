"""Attention-based eviction: H2O (accumulated attention), TOVA (last query), SnapKV (observation
window + pooling), PyramidKV (per-layer budgets), AdaKV (head-adaptive budgets)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_BLOCK, MAX_TOKENS, param
from .base import (
    ScorerPolicy,
    group_mean,
    keep_top,
    pool_scores,
    repeat_kv_heads,
    snapkv_scores,
    window_attention,
)

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
    recent_fraction: float = param(0.5, low=0, high=1)

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
    window_size: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    kernel_size: int = param(5, low=1, high=MAX_BLOCK, integer=True)  # odd (checked below)
    pooling: str = param("avg", choices=("avg", "max"))

    def validate(self) -> None:
        super().validate()
        if self.kernel_size % 2 == 0:
            raise LonglabError(
                f"{self.name}: kernel_size must be an odd integer >= 1, got {self.kernel_size!r}"
            )

    def head_scores(self, ctx) -> torch.Tensor:
        """Window attention summed over the window queries, per query head: [B, H, T]."""
        return window_attention(ctx, self.window_size).sum(2)

    def score(self, ctx) -> torch.Tensor:  # [B, H_kv, T]
        return snapkv_scores(ctx, self.window_size, self.kernel_size, self.pooling, "sum")


def pyramid_layer_budget(
    capacity: int, n: int, window_size: int, layer_idx: int, num_layers: int, beta: float = 20.0
) -> int:
    """Entries one head of layer ``layer_idx`` keeps under PyramidKV's official rule (KVCache-Factory,
    ``PyramidKVCluster.update_kv``), for a prompt of ``n`` tokens and ``capacity`` = ``max_capacity_prompt``
    (the average per-layer budget, window included), ``W`` = ``window_size``, ``L`` = ``num_layers``:

    * ``n < C``: keep all ``n``;
    * ``C <= n < 2(C-W)``: every layer keeps ``C`` (SnapKV's uniform budget);
    * otherwise ``lo = floor((C-W)/beta)``, ``hi = 2(C-W) - lo``; if ``hi >= n - W`` then ``hi = n - W`` and
      ``lo = 2(C-W) - hi``; ``step = floor((hi - lo)/(L-1))``; layer ``l`` keeps ``hi - l*step + W``.

    The floor of the step leaves the last layer ``lo`` plus up to ``L - 2`` entries, so the layers average up
    to ``(L-1)/2`` entries more than ``C`` (as the official code). ``C <= W`` (which the official code
    refuses; reached only through a ratio on a short prompt) keeps the last ``C`` tokens. ``L = 1`` keeps
    ``hi + W``."""
    C, W = capacity, window_size
    if n < C or C <= W:
        return min(n, C)
    rest = C - W
    if n < 2 * rest:
        return C
    lo = math.floor(rest / beta)
    hi = 2 * rest - lo
    if hi >= n - W:
        hi = n - W
        lo = 2 * rest - hi
    step = (hi - lo) // (num_layers - 1) if num_layers > 1 else 0
    return hi - layer_idx * step + W


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    """Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling", arXiv:2406.02069, as its official code (KVCache-Factory ``PyramidKVCluster``, run with
    ``window_size=8, kernel_size=7, pooling=maxpool, beta=20``). Per-layer budgets decrease linearly with a
    floored step (:func:`pyramid_layer_budget`; ``budget`` is the code's ``max_capacity_prompt``, the window
    counted inside it). Score per query head: the last ``W`` queries' attention summed over the window,
    max-pooled (``kernel_size``, padding ``k//2``) over the non-window prefix; keep the window plus
    ``torch.topk`` of the prefix, called on the prefix in position order as the code calls it, so ties
    (max pooling copies each peak to ``k`` slots) break the same way.

    ``compression_ratio=r`` sets ``max_capacity_prompt = ceil((1-r) n)`` for an ``n``-token prompt (the
    code's ``--max_capacity_prompts_ratio`` rounds ``(1-r) n`` instead; kvpress's ``PyramidKVPress`` uses
    ``W + (1-r) n``): below about ``r = 0.5`` (``n < 2(C-W)``) the code, and so longlab, keeps ``C`` on every
    layer. GQA (``gqa``): the code repeats K/V to the ``H`` query heads and keeps a set per query head
    (``gqa="query"``, the layer then holds ``H/H_kv`` times the bytes); ``gqa="mean"`` (default, kvpress's
    rule) averages the pooled scores over each KV head's query heads and keeps one set per KV head. The two
    coincide without GQA."""

    paper = "arXiv:2406.02069"
    window_size: int = param(8, low=1, high=MAX_TOKENS, integer=True)
    kernel_size: int = param(7, low=1, high=MAX_BLOCK, integer=True)
    pooling: str = param("max", choices=("avg", "max"))
    # the last layer keeps (C - W) / beta: beyond MAX_TOKENS (every budget's bound) that is 0 for any budget
    beta: float = param(20.0, low=1, high=MAX_TOKENS)
    # one set per KV head (group mean) or per query head (official code)
    gqa: str = param("mean", choices=("mean", "query"))

    def validate(self) -> None:
        super().validate()
        if self.budget is not None and self.budget <= self.window_size:
            raise LonglabError(
                f"pyramidkv: budget (max_capacity_prompt, window included) must be > window_size "
                f"({self.window_size}), got {self.budget}"
            )

    def target(self, ctx) -> torch.Tensor:
        """``[B]`` entries kept per head in this layer (window included), from ``max_capacity_prompt``:
        ``budget``, or ``ceil((1 - compression_ratio) n)``."""
        n = ctx.n_real  # [B]
        C = super().target(ctx) if self.budget is None else torch.full_like(n, self.budget)
        L, layer, W = ctx.num_layers, ctx.layer_idx, self.window_size
        kept = [
            pyramid_layer_budget(c, m, W, layer, L, self.beta) for c, m in zip(C.tolist(), n.tolist())
        ]
        return torch.tensor(kept, dtype=torch.long, device=n.device)

    def select(self, ctx) -> torch.Tensor | None:
        n_keep = self.target(ctx)  # [B] entries per head, window included
        valid = ctx.layer.valid  # [B, H_kv, T]
        if bool((valid.sum(-1) <= n_keep[:, None]).all()):
            return None
        recent = torch.clamp(n_keep, max=self.window_size)  # the window never exceeds the budget
        idx = ctx.key_index
        prot = idx >= (ctx.n_real - recent)[:, None, None]
        if self.sink_size:
            prot |= (idx >= 0) & (idx < self.sink_size)
        prot &= valid
        cand = valid & ~prot
        g = ctx.groups
        s = self.head_scores(ctx)  # [B, H, T] window attention summed over the window queries
        cand_h = cand.repeat_interleave(g, dim=1) if g > 1 else cand
        s = pool_scores(s, self.kernel_size, self.pooling, cand_h)  # over the non-window prefix only
        if self.gqa == "query" and g > 1:
            repeat_kv_heads(ctx)  # ctx.layer now holds one KV head per query head: [B, H, T, D]
            prot, cand, idx = prot.repeat_interleave(g, 1), cand_h, ctx.key_index
        else:
            s = group_mean(s, g)  # [B, H_kv, T]
        keep = prot.clone()
        for b in range(keep.shape[0]):
            _keep_top_in_order(s[b], cand[b], idx[b], int(n_keep[b]) - int(prot[b].sum(-1).max()), keep[b])
        return keep


def _keep_top_in_order(
    scores: torch.Tensor, cand: torch.Tensor, pos: torch.Tensor, k: int, keep: torch.Tensor
) -> None:
    """Mark in ``keep`` [h, T] the ``torch.topk(k)`` of each head's candidates, the candidates laid out in
    position order (as the official code's ``scores[..., :n-W]``). scores, cand, pos: [h, T]."""
    m = cand.sum(-1)  # [h]
    if k <= 0:
        return
    order = torch.where(cand, pos, pos.new_full((), torch.iinfo(pos.dtype).max)).argsort(dim=-1, stable=True)
    if bool((m == m[0]).all()):  # heads hold as many candidates: one topk over [h, m]
        slots = order[:, : int(m[0])]
        top = scores.gather(-1, slots).topk(min(k, int(m[0])), dim=-1).indices
        keep.scatter_(-1, slots.gather(-1, top), True)
        return
    for h in range(scores.shape[0]):
        slots = order[h, : int(m[h])]
        keep[h, slots[scores[h, slots].topk(min(k, int(m[h]))).indices]] = True


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
    window_size: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    kernel_size: int = param(7, low=1, high=MAX_BLOCK, integer=True)
    pooling: str = param("max", choices=("avg", "max"))
    alpha: float = param(0.2, low=0, high=1)  # the floor's share of each head's budget

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
