"""The one attention entry point: a function registered with ``transformers.AttentionInterface``.

Models run with ``attn_implementation="longlab"``. Every attention layer calls :func:`longlab_attention`
with post-RoPE ``q [B, H, T_q, D]`` and the layer's whole cache ``k, v [B, H_kv, T, D]`` (transformers
calls ``cache.update`` first). The hook builds a :class:`LayerContext` and dispatches to the recipe:

1. KV policies that observe every forward (H2O's accumulated attention) see the new queries;
2. attention is computed by the prefill policy (prefill chunks), the decode policy (decode steps),
   or dense SDPA over the entries the cache holds, masked by their true stream positions;
3. after a prefill chunk, the KV policies select what to keep and the cache drops the rest.

Nothing is patched: registration adds the name ``"longlab"`` to transformers' attention and mask
interfaces when a model is loaded or a :class:`LonglabCache` is created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .cache import LonglabCache, LonglabLayer, active_layer

__all__ = [
    "LayerContext",
    "longlab_attention",
    "register_attention",
    "dense_attention",
    "ATTN_NAME",
    "ChunkRecorder",
    "replay_compression",
]

ATTN_NAME = "longlab"
_MAX_SCORE_BYTES = 256 * 2**20  # bound on one [B, H, t_q, T] float block of attention scores


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
    layer: LonglabLayer | None = None  # the cache layer (None without a LonglabCache)
    cache: LonglabCache | None = None
    attn_output: torch.Tensor | None = None  # [B, H, T_q, D] once computed
    fallback_kv: tuple | None = field(default=None, repr=False)  # (k, v, key_index) without a cache

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
    def groups(self) -> int:
        return self.q.shape[1] // self.key_index.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    def mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """``[B, H_kv or 1, t_q, T]`` bool: key visible to query (valid, causal, inside the window)."""
        kidx = self.key_index
        if kidx.shape[1] > 1 and bool((kidx == kidx[:, :1]).all()):
            kidx = kidx[:, :1]  # heads share slots: one mask for all heads
        qidx = self.query_index[:, rows].to(kidx.dtype)[:, None, :, None]  # [B, 1, t_q, 1]
        k = kidx[:, :, None, :]  # [B, H_kv|1, 1, T]
        m = (k >= 0) & (k <= qidx)
        if self.sliding_window is not None:
            m &= k > qidx - self.sliding_window
        return m

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
        step = max(1, min(T_q, _MAX_SCORE_BYTES // per_row))
        return [slice(i, min(i + step, T_q)) for i in range(0, T_q, step)]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention. q: [B, H, T_q, D]; k, v: [B, H_kv, T, D]; mask: [B, H_kv|1, T_q, T] bool or None
    (plain causal with T_q == T). Returns [B, H, T_q, D]. Rows with no visible key attend to all keys
    (their outputs are padding and never read), which keeps every value finite."""
    groups = q.shape[1] // k.shape[1]
    if softcap is not None:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
        logits = torch.tanh(logits / softcap) * softcap
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()[None, None]
        mask = mask | ~mask.any(-1, keepdim=True)
        if mask.shape[1] not in (1, q.shape[1]):
            mask = mask.repeat_interleave(groups, dim=1)
        logits = logits.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(logits.float(), -1).to(v.dtype), v)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
    mask = mask | ~mask.any(-1, keepdim=True)
    if mask.shape[1] not in (1, q.shape[1]):
        mask = mask.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


def _sliding_window_of(module: Any, kwargs: dict) -> int | None:
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    return int(window) if window else None


def _layer_attention(ctx: LayerContext, softcap: float | None) -> torch.Tensor:
    """Dense attention for the context, in query blocks when the score matrix would be large."""
    T_q, T = ctx.q.shape[-2], ctx.k.shape[-2]
    plain_causal = (
        ctx.sliding_window is None
        and T_q == T
        and bool((ctx.key_index >= 0).all())
        and int(ctx.key_index[0, 0, 0]) == 0
    )
    if plain_causal:
        return dense_attention(ctx.q, ctx.k, ctx.v, None, ctx.scaling, softcap)
    outs = [
        dense_attention(ctx.q[:, :, rows], ctx.k, ctx.v, ctx.mask(rows), ctx.scaling, softcap)
        for rows in ctx.query_blocks()
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def longlab_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"longlab"`` attention function. query: [B, H, T_q, D]; key/value: [B, H_kv, T, D].

    Returns ``(out [B, T_q, H, D], None)`` as transformers expects."""
    B, H, T_q, D = query.shape
    scaling = scaling if scaling is not None else D**-0.5
    softcap = kwargs.get("softcap")
    num_layers = getattr(getattr(module, "config", None), "num_hidden_layers", 1)
    padding = (
        attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    )
    found = active_layer(key)
    if found is not None:
        cache, layer_idx = found
        layer = cache.layers[layer_idx]
        window = _sliding_window_of(module, kwargs)
        layer.sliding_window = window
        if padding is not None:
            layer.mark_padding(padding[:, -T_q:])
        query_index = layer.index[:, 0, -T_q:]  # new tokens are the last T_q slots of every head
        ctx = LayerContext(
            layer_idx,
            num_layers,
            module,
            "prefill" if T_q > 1 else "decode",
            query,
            scaling,
            query_index,
            window,
            layer,
            cache,
        )
        recipe = cache.recipe
    else:  # no LonglabCache (use_cache=False, or another cache class): plain causal attention
        T = key.shape[-2]
        if padding is not None:
            real = padding[:, -T:].to(torch.bool)
            positions = (real.long().cumsum(-1) - 1).masked_fill(~real, -1).to(torch.int32)
        else:
            positions = torch.arange(T, device=query.device, dtype=torch.int32).expand(B, T)
        key_index = positions[:, None, :].expand(B, key.shape[1], T)
        ctx = LayerContext(
            getattr(module, "layer_idx", 0),
            num_layers,
            module,
            "prefill" if T_q > 1 else "decode",
            query,
            scaling,
            positions[:, -T_q:],
            _sliding_window_of(module, kwargs),
            fallback_kv=(key, value, key_index),
        )
        recipe = None

    if recipe is not None:
        for policy in recipe.kv:
            if getattr(policy, "needs_observe", False):
                policy.observe(ctx)

    if recipe is not None and ctx.phase == "prefill" and recipe.prefill is not None:
        out = recipe.prefill.attend(ctx)
    elif recipe is not None and ctx.phase == "decode" and recipe.decode is not None:
        out = recipe.decode.attend(ctx)
    elif recipe is not None and (reader := _kv_reader(recipe)) is not None:
        out = reader.attend(ctx)  # a KV policy that also reads what it evicted (e.g. a latent memory)
    elif ctx.layer is not None and hasattr(ctx.layer, "attend"):
        out = ctx.layer.attend(ctx)  # storage with its own attention (e.g. quantized, dequantised in chunks)
    else:
        out = _layer_attention(ctx, softcap)
    ctx.attn_output = out

    if recipe is not None:
        _after_attention(ctx, recipe)
    return out.transpose(1, 2).contiguous(), None


def _kv_reader(recipe) -> Any:
    """The first KV policy that computes attention itself (defines ``attend(ctx)``), or None."""
    for policy in recipe.kv:
        if getattr(policy, "reads_attention", False):
            return policy
    return None


def _after_attention(ctx: LayerContext, recipe) -> None:
    """Evict: sliding-window layers drop what no query can see; other layers run the KV policies."""
    layer, cache = ctx.layer, ctx.cache
    if ctx.sliding_window is not None:
        layer.trim_to_window(ctx.sliding_window)
        return
    if ctx.phase == "prefill" and not cache.compressing:
        return
    start = time.perf_counter()
    acted = False
    for policy in recipe.kv:
        if policy.kind == "quant":  # storage policies convert or update the layer in place
            acted |= bool(policy.apply(ctx))
            continue
        keep = policy.select(ctx) if ctx.phase == "prefill" else policy.select_decode(ctx)
        if keep is not None:
            ctx.layer.keep(keep)
            acted = True
    if acted:
        cache.stats["compress_s"] += time.perf_counter() - start
        cache.stats["compress_calls"] += 1


class ChunkRecorder:
    """Stand-in KV policy that records, per layer, what the compression step of a prefill chunk sees
    (post-RoPE queries, attention output, positions, module) and keeps every entry.

    With :func:`replay_compression` this makes compression a pure function of the uncompressed cache
    plus the last chunk's record: the harness prefills a context once, forks the cache per recipe and
    replays only the compression, which gives the same cache as prefilling with that recipe and
    ``compress="end"``. (Attention of a chunk runs before that layer evicts, so the chunk's outputs and
    the next layers' inputs do not depend on the recipe's choice.)"""

    kind = "kv"
    needs_observe = False

    def __init__(self) -> None:
        self.records: dict[int, LayerContext] = {}

    def select(self, ctx: LayerContext) -> None:
        self.records[ctx.layer_idx] = LayerContext(
            ctx.layer_idx,
            ctx.num_layers,
            ctx.module,
            ctx.phase,
            ctx.q,
            ctx.scaling,
            ctx.query_index.clone(),
            ctx.sliding_window,
            attn_output=ctx.attn_output,
        )
        return None

    def select_decode(self, ctx: LayerContext) -> None:
        return None


def replay_compression(cache: LonglabCache, records: dict[int, LayerContext]) -> None:
    """Run ``cache.recipe``'s compression step on every recorded layer of ``cache``, as the hook would
    have run it after the recorded chunk's attention (see :class:`ChunkRecorder`)."""
    saved = cache.compressing
    cache.compressing = True
    try:
        for layer_idx in sorted(records):
            rec = records[layer_idx]
            ctx = LayerContext(
                rec.layer_idx,
                rec.num_layers,
                rec.module,
                rec.phase,
                rec.q,
                rec.scaling,
                rec.query_index,
                rec.sliding_window,
                cache.layers[layer_idx],
                cache,
                attn_output=rec.attn_output,
            )
            _after_attention(ctx, cache.recipe)
    finally:
        cache.compressing = saved


def _longlab_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask interface for ``"longlab"``: pass the 2-D padding mask ``[B, n_seen]`` through.

    The hook builds causal and window masks itself from the cache's stream indices."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask[:, -kv_length:] if attention_mask.shape[-1] >= kv_length else attention_mask


def register_attention() -> None:
    """Register ``"longlab"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, longlab_attention)
    AttentionMaskInterface.register(ATTN_NAME, _longlab_mask)


def ceil_keep(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """Entries kept when removing fraction ``ratio`` of ``n``: ``ceil((1 - ratio) * n)``."""
    return torch.clamp(torch.ceil((1.0 - ratio) * n.double() - 1e-9).long(), min=1)
