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

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from .attention import LayerContext, StandIn, layer_attention, sliding_window_of
from .cache import CACHE_KWARG, LonglabCache

__all__ = [
    "longlab_attention",
    "register_attention",
    "unregister_attention",
    "use_longlab_attention",
    "ATTN_NAME",
    "ChunkRecorder",
    "replay_compression",
]

ATTN_NAME = "longlab"


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
    found = kwargs.pop(CACHE_KWARG, None)  # (cache, layer_idx), added by LonglabCache.update
    if found is not None:
        cache, layer_idx = found
        layer = cache.layers[layer_idx]
        if layer_idx == 0:
            cache.hook_calls += 1
        window = sliding_window_of(module, kwargs)
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
            sliding_window_of(module, kwargs),
            fallback_kv=(key, value, key_index),
        )
        recipe = None

    if recipe is not None:
        for policy in recipe.kv:
            if policy.needs_observe:
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
        out = layer_attention(ctx, softcap)
    ctx.attn_output = out

    if recipe is not None:
        _after_attention(ctx, recipe)
    return out.transpose(1, 2).contiguous(), None


def _kv_reader(recipe) -> Any:
    """The first KV policy that computes attention itself (defines ``attend(ctx)``), or None."""
    for policy in recipe.kv:
        if policy.reads_attention:
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


class ChunkRecorder(StandIn):
    """Stand-in KV policy that records, per layer, what the compression step of a prefill chunk sees
    (post-RoPE queries, attention output, positions, module) and keeps every entry.

    With :func:`replay_compression` this makes compression a pure function of the uncompressed cache
    plus the last chunk's record: the harness prefills a context once, forks the cache per recipe and
    replays only the compression, which gives the same cache as prefilling with that recipe and
    ``compress="end"``. (Attention of a chunk runs before that layer evicts, so the chunk's outputs and
    the next layers' inputs do not depend on the recipe's choice.)"""

    name = "chunk-recorder"

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
    """Register ``"longlab"`` with transformers' attention and mask interfaces (idempotent).

    :func:`longlab.load_model` calls this; for a model of your own use :func:`use_longlab_attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, longlab_attention)
    AttentionMaskInterface.register(ATTN_NAME, _longlab_mask)


def unregister_attention() -> None:
    """Undo :func:`register_attention` (a no-op when ``"longlab"`` is not registered)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(ATTN_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_NAME, None)


@contextlib.contextmanager
def use_longlab_attention(model: Any = None) -> Iterator[Any]:
    """Run ``model`` (a transformers model you loaded yourself) through the longlab hook inside the block::

        with use_longlab_attention(model):
            model.generate(ids, cache=LonglabCache("snapkv@0.5"), max_new_tokens=32)

    On exit the model's previous attention implementation is restored, and the ``"longlab"`` name is
    unregistered unless it was registered before the block (e.g. by :func:`longlab.load_model`)."""
    from transformers import AttentionInterface

    was_registered = ATTN_NAME in AttentionInterface._global_mapping
    register_attention()
    previous = None
    if model is not None:
        previous = getattr(model.config, "_attn_implementation", None)
        model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        if model is not None and previous is not None and previous != ATTN_NAME:
            model.set_attn_implementation(previous)
        if not was_registered:
            unregister_attention()
