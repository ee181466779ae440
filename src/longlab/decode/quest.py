"""Quest: query-aware page selection at decode time.

Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774. The KV cache is kept in full; each decode step reads only a subset of it. The held
slots are cut into pages of ``P`` tokens; each page keeps the per-channel minimum ``m_p`` and maximum
``M_p`` of its keys. For a query ``q`` (per query head) the page's upper bound on any key's logit is

    ``U_p = sum_c max(q_c m_{p,c}, q_c M_{p,c}) = q.(M_p + m_p)/2 + |q|.(M_p - m_p)/2``

and attention runs over the top ``K - 1`` pages by ``U_p`` plus the last (current) page, with
``K = max(min_pages, budget // P)``. Layers ``< dense_layers`` (0 and 1), sliding-window layers and
prefill use dense attention, as in Quest's code (``q_len > 1 or layer_id < 2``).

Dense is *not* decided by the budget: a decode step reads every page, hence is exact, exactly when the
layer's held slots ``T`` (empty slots included) span at most ``K`` pages, ``T <= K * P``. That bound is
``budget`` only when ``budget`` is a multiple of ``P`` and at least ``min_pages * P``; otherwise a context
can fit the budget and still be read sparsely (``budget=1000, P=16``: K = 62, sparse from 993 slots) or
exceed it and be read densely (``budget=20, P=16``: K = 3, dense up to 48 slots). Quest's code behaves
the same way: it takes the top ``min(K, n_pages)`` pages, i.e. every page once ``n_pages <= K`` (it ranks
the last page with the others instead of always reading it; here it is always read).

Selecting and reading the pages: with ``fused=true`` (the default) a decode step runs
:func:`longlab.ops.qdecode.page_select` (the bounds, the top pages and their slots in one call, one read of
the summaries) where the C++ extension runs (CPU, built), and :func:`longlab.ops.qdecode.paged_decode` where
it also gets float32 K/V: each query head reads only its own pages' K/V rows, in place, with an online
softmax. Otherwise (``fused=false``, no compiler, ``LONGLAB_QDECODE=0``) :func:`page_scores` and
``torch.topk`` select and :func:`attend_slots` gathers those rows in PyTorch. The two selections compute the
same bounds in a different summation order, so they can differ only between pages whose bounds tie to float
rounding. Both readers return the output and the log-sum-exp RetroAttention merges by.

Grouped-query attention: the paper's models have one query head per KV head. With ``g`` query heads per KV
head, per-head selection (``selection=head``, the paper's rule) lets the ``g`` heads pick different pages,
so a step reads up to ``g * K`` pages of each KV head. ``selection=group`` picks one set of ``K - 1`` pages
per KV head by the group's largest bound, ``max_j U_p^(j)`` (still an upper bound on any of the group's
logits in page ``p``), and the kernel reads those pages once for the ``g`` heads: ``K`` pages per KV head,
the budget.

Page summaries are computed once per complete page and kept in ``layer.state`` (``quest.*``), so
:meth:`Stream.fork <longlab.engine.stream.Stream.fork>` and batch selection carry them and ``nbytes`` counts
them; they are recomputed if an eviction repacks the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..attention import layer_attention
from ..ops import qdecode
from ..recipe import Method, register
from ..registry import MAX_BLOCK, MAX_LAYERS, MAX_TOKENS, param

__all__ = [
    "Quest", "PageSummary", "page_summary", "page_scores", "attend_slots", "page_slots", "per_head_slots",
]


@dataclass
class PageSummary:
    """Per complete page: ``center = (M + m)/2``, ``radius = (M - m)/2`` [B, H_kv, n, D]; ``ok`` [B, H_kv, n]
    (page holds a real token); ``marks`` [B, H_kv, n, 2] positions of each page's first and last slot,
    to detect repacking."""

    center: torch.Tensor
    radius: torch.Tensor
    ok: torch.Tensor
    marks: torch.Tensor

    @property
    def n(self) -> int:
        return self.center.shape[2]


_STATE_KEYS = ("quest.center", "quest.radius", "quest.ok", "quest.marks")  # layer.state: a PageSummary


def _stored_summary(layer) -> PageSummary | None:
    state = getattr(layer, "state", None)
    if state is None or any(k not in state for k in _STATE_KEYS):
        return None
    return PageSummary(*(state[k] for k in _STATE_KEYS))


def _store_summary(layer, summary: PageSummary) -> None:
    state = getattr(layer, "state", None)
    if state is not None:  # [B, ...] tensors: forked, batch-selected and counted with the layer
        state.update(zip(_STATE_KEYS, (summary.center, summary.radius, summary.ok, summary.marks)))


def _summarise(keys: torch.Tensor, index: torch.Tensor, page_size: int) -> PageSummary:
    # keys: [B, H_kv, n*P, D]; index: [B, H_kv, n*P] -> summaries of the n pages
    B, H_kv, T, D = keys.shape
    n = T // page_size
    k = keys.float().reshape(B, H_kv, n, page_size, D)
    valid = (index >= 0).reshape(B, H_kv, n, page_size, 1)
    hi = k.masked_fill(~valid, float("-inf")).amax(3)  # [B, H_kv, n, D]
    lo = k.masked_fill(~valid, float("inf")).amin(3)
    ok = valid.any(3)[..., 0]  # [B, H_kv, n]
    hi = torch.where(ok[..., None], hi, 0.0)
    lo = torch.where(ok[..., None], lo, 0.0)
    idx = index.reshape(B, H_kv, n, page_size)
    marks = torch.stack([idx[..., 0], idx[..., -1]], dim=-1)
    return PageSummary((hi + lo) / 2, (hi - lo) / 2, ok, marks)


def _marks_match(index: torch.Tensor, marks: torch.Tensor, page_size: int) -> bool:
    """Whether the summarised pages still hold the slots they were summarised from: index [B, H_kv, T],
    marks [B, H_kv, n, 2] (each page's first and last position)."""
    if qdecode.available(index):
        return qdecode.page_marks_match(index, marks, page_size)
    n = marks.shape[2]
    idx = index[..., : n * page_size].reshape(*index.shape[:2], n, page_size)
    return torch.equal(torch.stack([idx[..., 0], idx[..., -1]], dim=-1), marks)


def page_summary(layer, page_size: int, n_pages: int, keys: torch.Tensor | None = None) -> PageSummary:
    """Summaries of the first ``n_pages`` complete pages of a cache layer, updated incrementally and kept
    in ``layer.state``. ``keys`` [B, H_kv, T, D]: the layer's keys as attention reads them (the
    dequantised view of a quantized layer; default ``layer.keys``)."""
    keys = layer.keys if keys is None else keys  # [B, H_kv, T, D]
    index = layer.index  # [B, H_kv, T]
    old = _stored_summary(layer)
    if old is not None and old.n <= n_pages and old.center.shape[:2] == keys.shape[:2]:
        if not _marks_match(index, old.marks, page_size):
            old = None
    else:
        old = None
    start = 0 if old is None else old.n
    if start == n_pages and old is not None:
        return old
    lo, hi = start * page_size, n_pages * page_size
    new = _summarise(keys[:, :, lo:hi], index[:, :, lo:hi], page_size)
    if old is not None and start > 0:
        parts = zip((old.center, old.radius, old.ok, old.marks), (new.center, new.radius, new.ok, new.marks))
        new = PageSummary(*(torch.cat([a, b], dim=2) for a, b in parts))
    _store_summary(layer, new)
    return new


def page_scores(q: torch.Tensor, summary: PageSummary) -> torch.Tensor:
    """Quest's upper bound ``U_p`` per query head: q [B, H, D] -> [B, H, n] (-inf for empty pages)."""
    B, H, D = q.shape
    H_kv = summary.center.shape[1]
    qg = q.float().reshape(B, H_kv, H // H_kv, D)  # [B, H_kv, g, D]
    u = qg @ summary.center.transpose(-1, -2) + qg.abs() @ summary.radius.transpose(-1, -2)  # [B, H_kv, g, n]
    u = u.masked_fill(~summary.ok[:, :, None, :], float("-inf"))
    return u.reshape(B, H, -1)


def page_slots(pages: torch.Tensor, page_size: int, T: int) -> torch.Tensor:
    """Slots of the selected pages [B, H, k] plus the last page: [B, H, k*P + tail]."""
    B, H, k = pages.shape
    last = (T - 1) // page_size
    offs = torch.arange(page_size, device=pages.device)
    sel = (pages[..., None] * page_size + offs).reshape(B, H, k * page_size)
    tail = torch.arange(last * page_size, T, device=pages.device).expand(B, H, -1)
    return torch.cat([sel, tail], dim=-1)


def per_head_slots(slots: torch.Tensor, H: int) -> torch.Tensor:
    """Slots [B, H, S] as given, or [B, H_kv, S] (one list per KV head) as [B, H, S]: each query head its
    group's list."""
    return slots if slots.shape[1] == H else slots.repeat_interleave(H // slots.shape[1], 1)


def attend_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_index: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    slots: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the held keys (``slots=None``) or a per-query-head subset of slots.

    q: [B, H, t, D]; k, v: [B, H_kv, T, D]; key_index: [B, H_kv, T]; query_pos: [B, t];
    slots: [B, H, S] slot ids (or [B, H_kv, S], one list per KV head: :func:`per_head_slots`);
    allowed: optional extra mask [B, H, t, S or T].
    Returns ``(out [B, H, t, D], lse [B, H, t])``; rows with no visible key give out 0 and lse -inf.
    """
    B, H, t, D = q.shape
    H_kv = k.shape[1]
    g = H // H_kv
    if slots is None:
        qg = q.float().reshape(B, H_kv, g * t, D)
        logits = (qg @ k.float().transpose(-1, -2)).reshape(B, H, t, -1) * scaling  # [B, H, t, T]
        kpos = key_index.repeat_interleave(g, dim=1)[:, :, None, :]  # [B, H, 1, T]
        vals = v.float().repeat_interleave(g, dim=1)  # [B, H, T, D]
    else:
        slots = per_head_slots(slots, H)
        b = torch.arange(B, device=q.device)[:, None, None]
        h = (torch.arange(H, device=q.device) // g)[None, :, None]
        ks, vals = k[b, h, slots].float(), v[b, h, slots].float()  # [B, H, S, D]
        logits = (q.float() @ ks.transpose(-1, -2)) * scaling  # [B, H, t, S]
        kpos = key_index[b, h, slots][:, :, None, :]  # [B, H, 1, S]
    vis = (kpos >= 0) & (kpos <= query_pos[:, None, :, None])
    if allowed is not None:
        vis = vis & allowed
    logits = logits.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, t]
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = probs @ vals  # [B, H, t, D]
    return out, lse


@register("quest")
@dataclass
class Quest(Method):
    """Quest (Tang et al. 2024, arXiv:2406.10774): per query head, attend over the top pages by
    ``U_p = sum_c max(q_c m_pc, q_c M_pc)`` plus the last page; ``budget`` tokens, pages of ``page_size``;
    ``selection``: ``head`` (per query head, the paper) or ``group`` (one page set per KV head, by
    ``max_j U_p^(j)`` over its query heads); ``fused``: the pages are selected and read by the kernels of
    :mod:`longlab.ops.qdecode` where they run."""

    kind: ClassVar[str] = "decode"
    paper = "arXiv:2406.10774"
    budget: int = param(1024, low=1, high=MAX_TOKENS, integer=True)
    page_size: int = param(16, low=1, high=MAX_BLOCK, integer=True)
    min_pages: int = param(3, low=2, high=MAX_TOKENS, integer=True)
    dense_layers: int = param(2, low=0, high=MAX_LAYERS, integer=True)
    selection: str = param("head", choices=("head", "group"))
    fused: bool = param(True, choices=(True, False))

    @property
    def n_pages(self) -> int:
        """Pages read per step, the last page included: ``K = max(min_pages, budget // page_size)``."""
        return max(self.min_pages, self.budget // self.page_size)

    def slots_read(self, ctx: Any, held: int) -> int:
        """``K * page_size`` slots on a sparse layer (of the ``held`` ones), every slot elsewhere."""
        return min(held, self.n_pages * self.page_size) if self.is_sparse_layer(ctx) else held

    def is_sparse_layer(self, ctx) -> bool:
        return ctx.layer is not None and ctx.layer_idx >= self.dense_layers and ctx.sliding_window is None

    def select(self, ctx) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(slots [B, H, S], pages [B, H, K-1])`` for this decode query, or ``(None, None)`` when the
        held slots span at most ``K`` pages (``T <= K * page_size``: every page is read, dense). With
        ``selection=group`` the slots stay one list per KV head, ``[B, H_kv, S]``, as the kernel reads them
        (:func:`per_head_slots` gives each query head its group's list)."""
        T = ctx.k.shape[-2]
        n_cand = (T - 1) // self.page_size  # complete pages before the last one
        k = self.n_pages - 1
        if n_cand <= k:
            return None, None
        summary = page_summary(ctx.layer, self.page_size, n_cand, ctx.k)
        g = ctx.q.shape[1] // ctx.k.shape[1]
        group = self.selection == "group" and g > 1
        if self.fused and qdecode.available(ctx.q):  # bounds, top-k and slots in one kernel call
            slots, pages = qdecode.page_select(ctx.q[:, :, -1], summary.center, summary.radius, summary.ok, k,
                                               self.page_size, T, group)
            return slots, (pages.repeat_interleave(g, 1) if group else pages)
        u = page_scores(ctx.q[:, :, -1], summary)  # [B, H, n_cand]
        if group:
            B, H, n = u.shape
            u = u.reshape(B, H // g, g, n).amax(2)  # [B, H_kv, n_cand]: the group's largest bound
            shared = u.topk(k, dim=-1).indices.sort(dim=-1).values  # [B, H_kv, k]
            return page_slots(shared, self.page_size, T), shared.repeat_interleave(g, 1)
        pages = u.topk(k, dim=-1).indices.sort(dim=-1).values  # [B, H, k]
        return page_slots(pages, self.page_size, T), pages

    def attend_lse(self, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(out [B, H, 1, D], lse [B, H, 1], slots, pages)``; slots/pages None when dense."""
        slots, pages = self.select(ctx)
        k, v = ctx.k, ctx.v
        if slots is not None and self.uses_fused(ctx.q, k):
            qpos = ctx.query_index[:, -1]  # shared slots [B, H_kv, S]: each row read once per KV head
            out, lse = qdecode.paged_decode(ctx.q, k, v, ctx.key_index, qpos, slots, ctx.scaling)
            return out, lse, slots, pages
        out, lse = attend_slots(ctx.q, k, v, ctx.key_index, ctx.query_index, ctx.scaling, slots)
        return out.to(ctx.q.dtype), lse, slots, pages

    def uses_fused(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether selected pages are read by :func:`longlab.ops.qdecode.paged_decode`: ``fused`` on, one
        decode query per row, float32 K/V, the kernel available here."""
        return self.fused and q.shape[-2] == 1 and k.dtype == torch.float32 and qdecode.available(q)

    def attend(self, ctx) -> torch.Tensor:  # [B, H, T_q, D]
        if not self.is_sparse_layer(ctx) or ctx.q.shape[-2] != 1:
            return layer_attention(ctx, None)
        return self.attend_lse(ctx)[0]
