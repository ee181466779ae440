"""Exact cache rollback for speculation: snapshot a :class:`~longlab.cache.LonglabCache` before a draft or
verification forward, restore it after, and commit only the accepted tokens.

Why a snapshot and not a crop: a layer's state is more than its last slots. Quantized layers move entries
from the full-precision residual into packed stores, sliding-window layers trim, and a layer object can be
replaced in ``cache.layers`` (a quant policy's first call). Every one of these writes *new* tensors and
re-binds attributes; nothing writes into held slots in place (appends write past the held count of a
buffer, see :mod:`longlab.cache`). So a shallow copy of each layer's attribute dictionary (and of the
dictionaries and store objects it holds) is an exact, O(layers) snapshot: restoring it makes the layer
bit-identical to what it was, whatever ran in between, without copying the cache. The one tensor
updated in place, ``n_real`` (``[B]``), is cloned.

Committing: the verification forward appended ``n`` new slots per layer (K/V computed by the target on the
drafted tokens). :func:`commit` takes the first ``m`` of them from every layer, restores the snapshot and
appends those ``m`` with ``layer.update`` (so positions, ``n_seen`` and ``n_real`` advance exactly as a
forward of those tokens would), marks rows that accepted fewer as padding (empty slots, never attended)
and then runs the recipe's storage policies once (KIVI quantizes what a token-by-token run would have
quantized by now). Recipes that evict or observe at every decode step cannot be caught up this way and
are refused up front (:func:`check_target_recipe`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import LayerContext
from ..recipe import LonglabError, Recipe

__all__ = ["CacheSnapshot", "commit", "check_target_recipe", "new_slots"]


def _is_state_object(value: Any) -> bool:
    """Objects a layer holds whose attributes change in place (packed stores)."""
    return (
        hasattr(value, "__dict__") and type(value).__module__.startswith("longlab.") and not callable(value)
    )


class CacheSnapshot:
    """A restorable picture of a cache's layers (no tensor is copied)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.layers = list(cache.layers)
        self.states = [self._take(layer) for layer in self.layers]
        self.n_slots = [layer.index.shape[-1] if layer.is_initialized else 0 for layer in self.layers]

    @staticmethod
    def _take(layer: Any) -> tuple[dict, dict]:
        d = dict(layer.__dict__)
        d["extras"], d["state"] = dict(layer.extras), dict(layer.state)
        if isinstance(d.get("n_real"), torch.Tensor):  # updated in place by appends (``n_real += t``)
            d["n_real"] = d["n_real"].clone()
        subs = {k: dict(v.__dict__) for k, v in d.items() if _is_state_object(v)}
        return d, subs

    def restore(self) -> None:
        """Put every layer back as it was at the snapshot (the snapshot stays valid for another restore)."""
        self.cache.layers[:] = self.layers
        for layer, (d, subs) in zip(self.layers, self.states):
            layer.__dict__.clear()
            layer.__dict__.update(d)
            layer.extras, layer.state = dict(d["extras"]), dict(d["state"])
            if isinstance(d.get("n_real"), torch.Tensor):
                layer.n_real = d["n_real"].clone()
            for key, sd in subs.items():
                obj = d[key]
                obj.__dict__.clear()
                obj.__dict__.update(sd)

    def layer_state(self, layer_idx: int) -> tuple[dict, dict]:
        return self.states[layer_idx]


def new_slots(layer: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of the last ``n`` slots a forward appended: ``[B, H_kv, n, D]`` each (for a quantized layer
    the residual's tail, where appends go)."""
    return layer.keys[:, :, -n:], layer.values[:, :, -n:]


def check_target_recipe(recipe: Recipe) -> None:
    """Speculation verifies with the target's own cache: its reads must not depend on per-step decode
    actions that cannot be replayed (decode-time eviction, observers, a decode policy)."""
    bad = [m.name for m in recipe.kv if m.kind == "kv" and (m.acts_during_decode or m.needs_observe)]
    if recipe.decode is not None:
        bad.append(recipe.decode.name)
    if bad:
        raise LonglabError(
            f"speculative decoding needs a target recipe whose decode reads the held entries densely "
            f"(eviction at prefill, quantization); {', '.join(bad)} act at every decode step. Use such a "
            "policy as the draft instead, e.g. speculative='self:streaming:budget=256'"
        )


def commit(
    cache: Any, snapshot: CacheSnapshot, n_new: int, keep: torch.Tensor, module_of: Any = None
) -> None:
    """Keep, per row, the first ``keep[b]`` of the ``n_new`` slots the last forward appended.

    ``keep``: ``[B]`` long, ``1 <= keep[b] <= n_new``. Rows keeping fewer than ``max(keep)`` get empty
    slots for the rest (as left padding does). After this, every layer equals the snapshot plus those
    tokens appended, then the recipe's storage (quant) policies run once."""
    m = int(keep.max())
    fresh = [None if not layer.is_initialized else new_slots(layer, n_new) for layer in cache.layers]
    fresh = [None if f is None else (f[0][:, :, :m].clone(), f[1][:, :, :m].clone()) for f in fresh]
    snapshot.restore()
    valid = torch.arange(m, device=keep.device)[None, :] < keep[:, None]  # [B, m]
    ragged = not bool(valid.all())
    quant = [p for p in cache.recipe.kv if p.kind == "quant"]
    for idx, layer in enumerate(cache.layers):
        if fresh[idx] is None:
            continue
        layer.update(*fresh[idx])
        if ragged:
            layer.mark_padding(valid.to(layer.index.device))
        window = getattr(layer, "sliding_window", None)
        if window:
            layer.trim_to_window(window)
        elif quant:
            ctx = _storage_context(cache, idx, layer, module_of)
            for policy in quant:
                policy.apply(ctx)
                layer = ctx.layer


def _storage_context(cache: Any, idx: int, layer: Any, module_of: Any) -> LayerContext:
    """A decode-step context for storage policies (they read the layer, not the queries)."""
    B = layer.index.shape[0]
    q = torch.zeros(B, 1, 1, 1)
    qidx = (layer.n_real - 1).to(torch.int32)[:, None]
    module = module_of(idx) if module_of is not None else None
    return LayerContext(idx, len(cache.layers), module, "decode", q, 1.0, qidx, None, layer, cache)
