"""Reuse methods composed with the KV recipes:
``generate(docs=..., reuse="cacheblend@0.15", recipe="snapkv@0.5")``.

**The shape.** A reuse method decides how the prompt's KV is *produced* (stored documents, which rows are
recomputed); a recipe's KV policies decide what the cache *keeps* once it is produced, and its decode policy
how decoding reads it. So the two compose in sequence on one :class:`~longlab.reuse.assemble.ReuseCache`:

1. the reuse method assembles the stored documents and runs its partial forwards (unchanged);
2. the recipe's KV policies compress the finished cache once, **query-aware and at the end of the prompt**
   (``compress="end"`` over ``[prefix][docs][question]``): each layer's compression step sees the last
   forward that wrote that layer (:func:`record_last_forward`), which always holds the question rows — the
   only rows every reuse method computes fresh through every layer — after the latest recomputed document
   rows. A policy's observation window (SnapKV's last ``W`` queries) is therefore the last ``W`` rows the
   reuse prefill computed: the question, then the recomputed document rows closest to it. For
   ``full-prefill`` (and any method at ratio 1) that forward is the whole prompt, so reuse + recipe is
   exactly a plain query-aware prefill + recipe with ``compress="end"`` (tested token for token);
3. decoding runs under the recipe (its KV policies' decode-time steps, its decode policy).

Before compressing, every layer's slots are put back in stream order (a partial forward appends the fresh
rows after the stale ones): policies that pool along the slot axis (SnapKV's clustering) assume it.

**What does not compose** (refused with a :class:`~longlab.recipe.LonglabError` before anything runs): a
prefill-attention policy (``prism``, ``xattention`` ...: with ``docs=`` the reuse method computes the
prefill), a context compressor, KV policies that observe every prefill query (``needs_observe``: H2O's
accumulated attention covers queries a reuse prefill never computes) or compute attention themselves while
the prompt is prefilled (``reads_attention``), and a decode policy together with ``ape`` (APE's attention
is the decode policy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..attention import LayerContext
from ..hook import ChunkRecorder, replay_compression
from ..recipe import LonglabError, Recipe, parse_recipe
from .assemble import ReuseJob

__all__ = ["reuse_recipe", "record_last_forward", "compress_assembled", "LastForwardRecorder"]


def reuse_recipe(recipe: Any, method: Any) -> Recipe | None:
    """The recipe that compresses the cache after the reuse method ``method`` (None: keep everything).
    Raises :class:`LonglabError` for recipe parts that cannot follow a reuse prefill (module docstring)."""
    parsed = parse_recipe(recipe)
    if parsed.is_empty:
        return None
    shown = parsed.name
    if parsed.prefill is not None:
        raise LonglabError(
            f"recipe {shown!r}: {parsed.prefill.name!r} is a prefill-attention policy; with docs= the "
            f"prefill is computed by the reuse method ({method.spec}), so only KV policies (eviction, "
            "quantization) and a decode policy compose with it"
        )
    if parsed.context is not None:
        raise LonglabError(
            f"recipe {shown!r}: {parsed.context.name!r} compresses the prompt text, which does not apply to "
            "stored documents (docs=)"
        )
    for policy in parsed.kv:
        if policy.needs_observe:
            raise LonglabError(
                f"recipe {shown!r}: {policy.name!r} accumulates attention over every prefill query, but a "
                f"reuse prefill ({method.spec}) computes queries only for the rows it recomputes; use a "
                "policy that scores from the last queries (snapkv, pyramidkv, adakv, tova, streaming, ...)"
            )
        if policy.reads_attention:
            raise LonglabError(
                f"recipe {shown!r}: {policy.name!r} computes attention itself while the prompt is prefilled, "
                "which a reuse prefill does not run through; it does not compose with docs= yet"
            )
    if parsed.decode is not None and method.parallel:
        raise LonglabError(
            f"recipe {shown!r}: {method.spec} decodes with its own attention (APE's temperature and scale), "
            f"so a decode policy ({parsed.decode.name!r}) cannot be added"
        )
    return parsed


class LastForwardRecorder(ChunkRecorder):
    """:class:`~longlab.hook.ChunkRecorder` that records every forward of a reuse prefill, a single-row one
    too (the hook calls it a decode step), as a prefill record: per layer, the last forward wins."""

    def select(self, ctx: LayerContext) -> None:
        super().select(ctx)
        rec = self.records[ctx.layer_idx]
        if rec.phase != "prefill":
            self.records[ctx.layer_idx] = dataclasses.replace(rec, phase="prefill")
        return None

    def select_decode(self, ctx: LayerContext) -> None:
        return self.select(ctx)


def record_last_forward(job: ReuseJob) -> LastForwardRecorder:
    """Make every later forward of ``job`` record what each layer's compression step would see (the
    recorder joins the cache's recipe; ``_with_probe`` keeps it beside the probe). Changes no output."""
    recorder = LastForwardRecorder()
    cache = job.cache
    cache.recipe = Recipe(
        prefill=cache.recipe.prefill, kv=[*cache.recipe.kv, recorder], decode=cache.recipe.decode
    )
    cache.compressing = True  # the hook calls KV policies' select only while compressing
    return recorder


def _stream_order(layer: Any) -> None:
    """Put a layer's slots in stream (position) order; slots a partial forward rewrote were appended last.
    keys/values ``[1, H_kv, T, D]``, index and extras ``[1, H_kv, T]``; heads share slots here."""
    pos = layer.index[0, 0]
    if bool((pos[1:] >= pos[:-1]).all()):
        return
    order = pos.argsort(stable=True)
    layer.keys = layer.keys[:, :, order]
    layer.values = layer.values[:, :, order]
    layer.index = layer.index[:, :, order]
    layer.extras = {k: v[:, :, order] for k, v in layer.extras.items()}
    layer.index_changed()


@torch.inference_mode()
def compress_assembled(job: ReuseJob, recipe: Recipe, recorder: LastForwardRecorder) -> None:
    """After ``job.finish()``: run ``recipe``'s compression step on every recorded layer of the assembled
    cache (stream order first), then leave ``recipe`` (with the method's own attention policies) as the
    cache's recipe for decoding."""
    cache = job.cache
    method_recipe = cache.recipe
    layers = enumerate(cache.layers)
    if any(layer.sliding_window is None and i not in recorder.records for i, layer in layers):
        raise LonglabError("internal: a layer's last reuse forward was not recorded; cannot compress it")
    if not job.parallel:
        for layer in cache.layers:
            _stream_order(layer)
    cache.recipe = Recipe(
        prefill=method_recipe.prefill,
        kv=list(recipe.kv),
        decode=recipe.decode if recipe.decode is not None else method_recipe.decode,
    )
    records = {i: r for i, r in recorder.records.items() if cache.layers[i].sliding_window is None}
    replay_compression(cache, records)
    cache.compressing = False  # later multi-token forwards (a forced answer) are not compressed again
