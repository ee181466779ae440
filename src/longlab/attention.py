"""The per-layer view methods work on, and the exact attention kernels they share.

This module sits below the hook, the cache's users and every method family: methods import
:class:`LayerContext` and :func:`dense_attention` from here, never from :mod:`longlab.hook`.

Shapes: ``q [B, H, T_q, D]`` post-RoPE queries, ``k, v [B, H_kv, T, D]`` what the cache holds,
``key_index [B, H_kv, T]`` each slot's token position (``-1`` = empty), ``query_index [B, T_q]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "LayerContext",
    "StandIn",
    "MAX_SCORE_BYTES",
    "compiled_flex",
    "dense_attention",
    "layer_attention",
    "lse_merge",
    "merge_by_lse",
    "visibility_mask",
    "ceil_keep",
]

MAX_SCORE_BYTES = 256 * 2**20  # bound on one [B, H, rows, T] fp32 block of attention scores (every kernel)


@dataclass
class LayerContext:
    """What a method sees in one layer for one forward call."""

    layer_idx: int
    num_layers: int
    module: Any
    phase: str  # "prefill" (a chunk of T_q > 1 tokens) or "decode" (one token)
    q: torch.Tensor  # [B, H, T_q, D] post-RoPE queries of this forward
    scaling: float
    query_index: torch.Tensor  # [B, T_q] position of each query (-1 for padding)
    sliding_window: int | None = None  # keys with q - k >= sliding_window are invisible
    layer: Any = None  # LonglabLayer  # the cache layer (None without a LonglabCache)
    cache: Any = None  # LonglabCache
    attn_output: torch.Tensor | None = None  # [B, H, T_q, D] once computed
    fallback_kv: tuple | None = field(default=None, repr=False)  # (k, v, key_index) without a cache
    # without a cache layer: whether every slot of ``fallback_kv`` is valid, when the caller knows
    # (rows of a stacked layer, ``layer.row_valid``); None = one pass over ``key_index`` when asked
    valid_hint: bool | None = field(default=None, repr=False)

    # Views of the cache layer, always current (they change when a policy evicts).
    @property
    def k(self) -> torch.Tensor:  # [B, H_kv, T, D]
        if self.layer is None:
            return self.fallback_kv[0]
        # Quantized storage exposes a transient dequantised view for scorers (longlab.quant.storage).
        dense = getattr(self.layer, "dequantized_keys", None)
        return dense() if dense is not None else self.layer.keys

    @property
    def v(self) -> torch.Tensor:  # [B, H_kv, T, D]
        if self.layer is None:
            return self.fallback_kv[1]
        dense = getattr(self.layer, "dequantized_values", None)
        return dense() if dense is not None else self.layer.values

    @property
    def key_index(self) -> torch.Tensor:  # [B, H_kv, T] token position, -1 = empty slot
        return self.layer.index if self.layer is not None else self.fallback_kv[2]

    @property
    def n_seen(self) -> int:
        """Stream length (tokens written, padding included)."""
        return self.layer.n_seen if self.layer is not None else self.k.shape[-2]

    @property
    def n_real(self) -> torch.Tensor:  # [B] non-padding tokens seen per row
        if self.layer is not None:
            return self.layer.n_real
        return (self.key_index[:, 0] >= 0).sum(-1)

    @property
    def all_valid(self) -> bool:
        """Every held slot holds a real token (tracked by the cache layer, no pass over ``T``)."""
        flag = getattr(self.layer, "all_valid", None)
        if flag is None:
            flag = self.valid_hint
        return flag if flag is not None else bool((self.key_index >= 0).all())

    @property
    def heads_share_slots(self) -> bool | None:
        """Every KV head holds the same positions (tracked by the cache layer); None = not known."""
        return getattr(self.layer, "heads_share_slots", None)

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.key_index.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    def mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """``[B, H_kv or 1, t_q, T]`` bool: key visible to query (valid, causal, inside the window)."""
        return visibility_mask(
            self.key_index, self.query_index[:, rows], self.sliding_window, self.heads_share_slots
        )

    def attention_probs(self, rows: slice = slice(None)) -> torch.Tensor:
        """Softmax attention of the selected queries over the held keys, fp32: ``[B, H, t_q, T]``.

        Callers pass a small row range (an observation window, or a query block).
        """
        q = self.q[:, :, rows].float()
        k = self.k.float().repeat_interleave(self.groups, dim=1)
        logits = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        m = self.mask(rows)
        if m.shape[1] > 1:
            m = m.repeat_interleave(self.groups, dim=1)
        logits = logits.masked_fill(~m, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.nan_to_num(probs, nan=0.0)

    def query_blocks(self) -> list[slice]:
        """Row blocks small enough that ``[B, H, rows, T]`` fp32 stays under a fixed size."""
        B, H, T_q, _ = self.q.shape
        per_row = max(1, B * H * self.key_index.shape[-1] * 4)
        step = max(1, min(T_q, MAX_SCORE_BYTES // per_row))
        return [slice(i, min(i + step, T_q)) for i in range(0, T_q, step)]


def visibility_mask(
    key_index: torch.Tensor,
    query_index: torch.Tensor,
    sliding_window: int | None = None,
    heads_shared: bool | None = None,
) -> torch.Tensor:
    """Which held keys each query may see. key_index: [B, H_kv, T] (-1 = empty slot);
    query_index: [B, t_q]. Returns [B, H_kv or 1, t_q, T] bool: ``0 <= k_pos <= q_pos`` and, with a
    window, ``q_pos - k_pos < sliding_window``. Heads that share their slots get one mask (dim 1 = 1);
    ``heads_shared`` says whether they do when the caller knows (None: compared here, one pass over T)."""
    kidx = key_index
    if heads_shared is None:
        heads_shared = kidx.shape[1] == 1 or bool((kidx == kidx[:, :1]).all())
    if heads_shared:
        kidx = kidx[:, :1]  # heads share slots: one mask for all heads
    qidx = query_index.to(kidx.dtype)[:, None, :, None]  # [B, 1, t_q, 1]
    k = kidx[:, :, None, :]  # [B, H_kv|1, 1, T]
    m = (k >= 0) & (k <= qidx)
    if sliding_window is not None:
        m &= k > qidx - sliding_window
    return m


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Exact attention. q: [B, H, T_q, D]; k, v: [B, H_kv, T, D]; mask: [B, H_kv|1, T_q, T] bool or None:
    plain causal (``T_q == T``), or with ``causal=False`` every query sees every key. Returns
    [B, H, T_q, D]. Rows with no visible key attend to all keys (their outputs are padding and never
    read), which keeps every value finite."""
    groups = q.shape[1] // k.shape[1]
    if softcap is not None:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
        logits = torch.tanh(logits / softcap) * softcap
        if mask is None and not causal:
            return torch.matmul(torch.softmax(logits.float(), -1).to(v.dtype), v)
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()[None, None]
        mask = mask | ~mask.any(-1, keepdim=True)
        if mask.shape[1] not in (1, q.shape[1]):
            mask = mask.repeat_interleave(groups, dim=1)
        logits = logits.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(logits.float(), -1).to(v.dtype), v)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=groups > 1)
    mask = mask | ~mask.any(-1, keepdim=True)
    if mask.shape[1] not in (1, q.shape[1]):
        mask = mask.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


def sliding_window_of(module: Any, kwargs: dict) -> int | None:
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    return int(window) if window else None


def layer_attention(ctx: LayerContext, softcap: float | None) -> torch.Tensor:
    """Dense attention for the context, in query blocks when the score matrix would be large.

    Without a window, a decode query (``T_q == 1``, the newest token) sees every valid slot: no mask
    at all when every slot is valid (tracked by the cache layer, no pass over ``T``), else one
    comparison ``index >= 0`` (:func:`_decode_attention`). With every slot valid, a forward whose
    queries are every held slot (``T_q == T``, in stream order) is plain causal. Otherwise the
    visibility mask of the slots' positions is used (prefill chunks after the first, sliding windows)."""
    rows = _ragged_rows(ctx)
    if rows is not None:
        return torch.cat([layer_attention(row, softcap) for row in rows], dim=0)
    T_q, T = ctx.q.shape[-2], ctx.key_index.shape[-1]
    if ctx.sliding_window is None and T_q == 1 and softcap is None:
        return _decode_attention(ctx)
    if ctx.sliding_window is None and (T_q == 1 or T_q == T) and ctx.all_valid:
        return dense_attention(ctx.q, ctx.k, ctx.v, None, ctx.scaling, softcap, causal=T_q > 1)
    outs = [
        dense_attention(ctx.q[:, :, rows], ctx.k, ctx.v, ctx.mask(rows), ctx.scaling, softcap)
        for rows in ctx.query_blocks()
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _ragged_rows(ctx: LayerContext) -> list[LayerContext] | None:
    """Batch rows of unequal length, each held after leading empty slots (``layer.lead_pad [B]``, set
    when the harness stacks several branches into one batch), as one context per run of consecutive
    rows with the same lead, over their own slots ``[lead_pad[b]:]``; None when the batch is uniform
    enough (under a quarter of the slots are leading padding) that one padded call costs less. Exact
    either way: a row's empty slots are invisible to its queries. ``layer.row_valid`` tells each run
    whether all its slots are valid, so no run makes a pass over its slots to find out."""
    lead = getattr(ctx.layer, "lead_pad", None)
    B, T = ctx.q.shape[0], ctx.key_index.shape[-1]
    if lead is None or B == 1:
        return None
    starts = lead.tolist()
    if 4 * sum(starts) < B * T:
        return None
    flags = getattr(ctx.layer, "row_valid", None)
    k, v, kidx = ctx.k, ctx.v, ctx.key_index
    runs, b0 = [], 0
    for b in range(1, B + 1):
        if b == B or starts[b] != starts[b0]:
            runs.append((b0, b, starts[b0]))
            b0 = b
    return [
        LayerContext(
            ctx.layer_idx, ctx.num_layers, ctx.module, ctx.phase, ctx.q[b0:b1], ctx.scaling,
            ctx.query_index[b0:b1], ctx.sliding_window,
            fallback_kv=(k[b0:b1, :, s:], v[b0:b1, :, s:], kidx[b0:b1, :, s:]),
            valid_hint=all(flags[b0:b1]) if flags is not None else None,
        )
        for b0, b1, s in runs
    ]


def _decode_attention(ctx: LayerContext) -> torch.Tensor:
    """One decode query per row (``q [B, H, 1, D]``, the newest token), no window: it sees exactly the
    valid slots, whatever their positions. Returns ``[B, H, 1, D]``.

    The ``g`` query heads of a KV head become ``g`` query rows of that head (``[B, H_kv, g, D]``, as
    transformers' ``pack_gqa``): one SDPA call without GQA expansion, which on CPU is also faster than
    ``enable_gqa`` over a view of the cache's buffer. Every slot valid (tracked by the layer): no mask.
    Else the mask is ``index >= 0`` (``[B, H_kv|1, 1, T]``, one comparison, no causal test, no repeat
    over query heads); a padding query (position -1) sees every slot, its output is never read."""
    q = ctx.q
    B, H, _, D = q.shape
    kidx = ctx.key_index  # [B, H_kv, T]
    H_kv = kidx.shape[1]
    mask = None
    if not ctx.all_valid:
        if ctx.heads_share_slots:
            kidx = kidx[:, :1]
        mask = (kidx >= 0)[:, :, None, :] | (ctx.query_index < 0)[:, None, :, None]  # [B, H_kv|1, 1, T]
    out = F.scaled_dot_product_attention(
        q.reshape(B, H_kv, H // H_kv, D), ctx.k, ctx.v, attn_mask=mask, scale=ctx.scaling
    )  # [B, H_kv, g, D]
    return out.reshape(B, H, 1, D)


def ceil_keep(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """Entries kept when removing fraction ``ratio`` of ``n``: ``ceil((1 - ratio) * n)``."""
    return torch.clamp(torch.ceil((1.0 - ratio) * n.double() - 1e-9).long(), min=1)


class StandIn:
    """Base of the harness's stand-in KV policies (recorders and probes placed in a recipe's KV list for
    one forward): the capabilities the hook reads, declared as a real policy declares them, and no
    selection (every entry kept). Subclasses override what they do."""

    kind = "kv"
    name = "stand-in"
    needs_observe = False  # observe(ctx) on every forward
    reads_attention = False  # computes attention itself: attend(ctx)
    acts_during_decode = False
    batch_select_safe = True

    def select(self, ctx: LayerContext) -> None:
        return None

    def select_decode(self, ctx: LayerContext) -> None:
        return None


# ------------------------------------------------------------------------------ shared attention primitives
def lse_merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets, merged: ``o = w1 o1 + w2 o2`` with ``w_i = exp(lse_i - lse)``,
    ``lse = log(exp(lse1) + exp(lse2))``. o: ``[..., D]``, lse: ``[...]``. Exact when each ``(o_i, lse_i)``
    is the softmax attention over its set; an empty set (``lse = -inf``, its ``o`` possibly NaN) adds
    nothing, and a row that sees nothing gets ``o = 0``. The one online-softmax merge of the package
    (RetroAttention, LoSA, sparse verification, the block-sparse executor, context parallelism)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    w1 = torch.exp(lse1 - safe)[..., None].to(o1.dtype)
    w2 = torch.exp(lse2 - safe)[..., None].to(o2.dtype)
    return torch.where(w1 > 0, o1 * w1, 0.0) + torch.where(w2 > 0, o2 * w2, 0.0), lse


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Outputs over disjoint key sets combined by their row log-sum-exp (:func:`lse_merge` folded over
    ``parts``; a row seeing nothing -> 0)."""
    o, lse = parts[0]
    if len(parts) == 1:
        return torch.where(torch.isinf(lse)[..., None], 0.0, o)
    for o2, l2 in parts[1:]:
        o, lse = lse_merge(o, lse, o2, l2)
    return o


@functools.cache
def compiled_flex() -> Any:
    """``torch.compile(flex_attention)``, compiled once per process (~30 s on CPU) for every caller."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
