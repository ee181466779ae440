"""KV policies: what to keep in the cache. One file per method family.

:func:`kept_indices` runs any registered eviction policy on raw tensors, without a model, so a method
can be audited against a reference implementation on identical inputs. This module stays light: the
function imports what it needs when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..recipe import Recipe

__all__ = ["kept_indices"]


def kept_indices(
    recipe: str | Recipe,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer_idx: int = 0,
    num_layers: int = 1,
    queries: Any = None,
    scaling: float | None = None,
    module: Any = None,
) -> list[list[torch.Tensor]]:
    """The positions a recipe's KV eviction policies keep from one layer's raw tensors.

    ``q [B, H, T_q, D]`` post-RoPE queries (``T_q <= T``: by default the newest ``T_q`` tokens), ``k, v
    [B, H_kv, T, D]`` the layer's keys and values, every position ``0 .. T-1`` real. The tensors go into
    a fresh :class:`~longlab.cache.LonglabLayer` and a prefill :class:`~longlab.attention.LayerContext`
    (layer ``layer_idx`` of ``num_layers``, for per-layer budgets such as PyramidKV's), and the recipe's
    policies run as the hook runs them after a prefill chunk: every ``needs_observe`` policy observes
    (H2O accumulates over all ``T_q`` queries), then each policy selects in recipe order and the layer
    keeps what it selected.

    ``queries``: the stream positions of ``q``'s rows, ``[T_q]`` or ``[B, T_q]`` (default ``T - T_q ..
    T - 1``). ``scaling``: the attention scale (default ``D ** -0.5``). ``module``: the attention module,
    for policies that read weights (``restkv`` with ``use_wo=true`` reads ``module.o_proj``; ``indexmem``
    reads ``module.config`` to find its weights).

    Returns ``out[b][h]``: a sorted ``LongTensor`` of the positions kept by batch row ``b`` in KV head
    ``h`` of the layer after selection (so for a policy that selects per query head, such as ``restkv``'s
    default ``gqa=query``, ``h`` runs over the ``H`` query heads). A policy that keeps everything (budget
    larger than ``T``, ``full``) returns ``0 .. T-1``, and so do the decode-time policies (``decoding``,
    ``h2o-stream``, ``tova-stream``), which evict only at decode steps. Bad shapes, an unknown recipe,
    or a recipe with a prefill, decode or quantization policy raise :class:`~longlab.recipe.LonglabError`.

    Example::

        from longlab.kv import kept_indices
        kept = kept_indices("snapkv:budget=64,window_size=8", q, k, v)
        kept[0][1]  # positions batch row 0, KV head 1 keeps (64 of them)
    """
    import copy

    import torch

    from ..attention import LayerContext
    from ..cache import LonglabLayer
    from ..recipe import LonglabError, parse_recipe

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise LonglabError(f"kept_indices: {name} must be a 4-d floating-point tensor, got {got}")
    B, H, T_q, D = q.shape
    H_kv, T = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[-1] != D or v.shape[:3] != k.shape[:3]:
        raise LonglabError(
            "kept_indices: expected q [B, H, T_q, D], k [B, H_kv, T, D] and v [B, H_kv, T, D_v], got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if min(B, H, H_kv, T, T_q, D) < 1 or H % H_kv:
        raise LonglabError(
            f"kept_indices: need B, T, T_q, D >= 1 and H a multiple of H_kv, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if T_q > T:
        raise LonglabError(f"kept_indices: q has {T_q} query rows but k only {T} positions (need T_q <= T)")
    for name, value, low in (("num_layers", num_layers, 1), ("layer_idx", layer_idx, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LonglabError(f"kept_indices: {name} must be an integer >= {low}, got {value!r}")
    if layer_idx >= num_layers:
        raise LonglabError(f"kept_indices: layer_idx must be in [0, {num_layers - 1}], got {layer_idx}")
    if scaling is None:
        scaling = D**-0.5
    elif isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise LonglabError(f"kept_indices: scaling must be a positive number, got {scaling!r}")

    if queries is None:
        qidx = torch.arange(T - T_q, T, device=q.device).expand(B, T_q)
    else:
        qidx = torch.as_tensor(queries, device=q.device)
        if qidx.dim() == 1:
            qidx = qidx.expand(B, -1)
        if qidx.shape != (B, T_q) or qidx.is_floating_point() or bool(((qidx < 0) | (qidx >= T)).any()):
            raise LonglabError(
                f"kept_indices: queries must be integer positions in [0, {T - 1}] of shape [{T_q}] or "
                f"[{B}, {T_q}], got {tuple(qidx.shape)}"
            )
    qidx = qidx.to(torch.int32).contiguous()

    rec = parse_recipe(recipe)
    others = [m.name for m in (rec.prefill, rec.decode) if m is not None]
    others += [m.name for m in rec.kv if m.kind != "kv"]
    if others:
        raise LonglabError(
            f"kept_indices: recipe {rec.name!r} has {', '.join(others)}, which decide how entries are "
            "computed, stored or read, not which are kept; give eviction policies only (e.g. 'snapkv@0.5')"
        )
    policies = [copy.deepcopy(m) for m in rec.kv if m.name != "full"]

    layer = LonglabLayer()
    layer.update(k, v)  # [B, H_kv, T, D], positions 0 .. T-1
    ctx = LayerContext(layer_idx, num_layers, module, "prefill", q, float(scaling), qidx, None, layer)
    with torch.no_grad():
        for policy in policies:
            if policy.needs_observe:
                policy.observe(ctx)
        for policy in policies:
            try:
                keep = policy.select(ctx)
            except AttributeError as exc:  # a policy reading module weights without a module
                raise LonglabError(
                    f"kept_indices: {policy.name} needs the attention module ({exc}); pass module=... "
                    "(or a setting that does not need it, e.g. restkv:use_wo=false)"
                ) from None
            if keep is not None:
                ctx.layer.keep(keep)
    index = ctx.layer.index  # [B, H_kv (or H), T'], -1 = empty slot
    heads = range(index.shape[1])
    return [[index[b, h][index[b, h] >= 0].long().sort().values for h in heads] for b in range(B)]
