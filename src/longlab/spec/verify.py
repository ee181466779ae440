"""Verification: how the target reads its own cache for the ``L + 1`` tokens of one speculation step.

``full``: exact. For a full-precision layer the ``L + 1`` queries attend every held slot plus the new
tokens causally, which is what ``L + 1`` one-token decode steps would compute. A quantized layer is
different: decoding token by token, the storage policy runs after every step (KIVI moves the value that
leaves its R-token window, and flushes a block of keys when R accumulate), so query ``i`` of the block sees
some entries quantized that a one-shot forward would still read in full precision.
:func:`sequential_quant_attention` reproduces that exactly: it replays the storage steps on a shallow
copy of the layer and, for every query, reads the part that no step can change (sink + packed main
region, when the policy only appends to it) once for all queries, and the small changing tail per
query, merging the two by log-sum-exp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import layer_attention
from ..quant.storage import ChannelGroupStore
from .base import Verifier, register_verifier
from .rollback import new_slots
from .slot_attention import attend_kv, kv_slot_bytes, lse_merge

__all__ = ["FullVerify", "sequential_quant_attention", "clone_layer", "exact_attention"]

_CHUNK = 4096


def clone_layer(layer: Any, state: tuple[dict, dict]) -> Any:
    """A new layer object holding ``state`` (a :class:`~longlab.spec.rollback.CacheSnapshot` layer
    state), with its own store objects; its first append re-allocates, so ``layer`` is never written."""
    d, subs = state
    sim = object.__new__(type(layer))
    sim.__dict__.update(d)
    sim.extras, sim.state = dict(d["extras"]), dict(d["state"])
    if isinstance(d.get("n_real"), torch.Tensor):
        sim.n_real = d["n_real"].clone()
    for key, sd in subs.items():
        obj = object.__new__(type(d[key]))
        obj.__dict__.update(sd)
        sim.__dict__[key] = obj
    return sim


def _stable_prefix(sim: Any, policies: list) -> int:
    """Slots ``[0, c)`` whose dequantised K and V no later storage step changes: sink + the shorter packed
    region, when the policies only append to their stores (KIVI with whole key groups). 0 otherwise."""
    if not policies or not all(type(p).__name__.startswith("KIVI") for p in policies):
        return 0
    ks = sim.key_store
    if isinstance(ks, ChannelGroupStore) and ks.n % ks.group:
        return 0  # a short last key group is re-quantized with the next tokens
    return sim.n_sink + min(sim.key_store.n, sim.value_store.n)


def _attend_slots_range(
    sim: Any, q: torch.Tensor, qpos: torch.Tensor, a: int, b: int, scaling: float, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q [B, H, t, D] over the layer's slots a..b, dequantised chunk by chunk."""
    o = lse = None
    for s in range(a, b, _CHUNK):
        e = min(b, s + _CHUNK)
        k, v = sim.key_slice(s, e), sim.value_slice(s, e)
        oc, lc, _ = attend_kv(q, k, v, sim.index[..., s:e], qpos, scaling, window)
        o, lse = (oc, lc) if o is None else lse_merge(o, lse, oc, lc)
    return o, lse


def sequential_quant_attention(
    ctx: Any, state: tuple[dict, dict], policies: list
) -> tuple[torch.Tensor, float]:
    """Attention of the ``t`` new queries of a quantized layer as ``t`` one-token decode steps would see
    it (see the module docstring). ``state``: the layer before the forward. Returns ``(out [B, H, t, D],
    slots read)``."""
    layer, q, qpos = ctx.layer, ctx.q, ctx.query_index
    t = q.shape[-2]
    k_new, v_new = new_slots(layer, t)
    sim = clone_layer(layer, state)
    c = _stable_prefix(sim, policies)
    if c:
        o_c, lse_c = _attend_slots_range(sim, q, qpos, 0, c, ctx.scaling, ctx.sliding_window)
    outs, read = [], float(c)
    for i in range(t):
        sim.update(k_new[:, :, i : i + 1], v_new[:, :, i : i + 1])
        ctx_i = dataclasses.replace(
            ctx, q=q[:, :, i : i + 1], query_index=qpos[:, i : i + 1], layer=sim, phase="decode"
        )
        T = sim.index.shape[-1]
        if c:
            o, lse = _attend_slots_range(
                sim, ctx_i.q, ctx_i.query_index, c, T, ctx.scaling, ctx.sliding_window
            )
            o, _ = lse_merge(o_c[:, :, i : i + 1], lse_c[:, :, i : i + 1], o, lse)
            read += T - c
        else:
            o = sim.attend(ctx_i).float()
            read += T
        outs.append(o)
        for policy in policies:
            policy.step(ctx_i, sim)
    return torch.cat(outs, dim=2).to(q.dtype), read


def exact_attention(ctx: Any, state: tuple[dict, dict] | None, policies: list) -> tuple[torch.Tensor, float]:
    """What token-by-token decoding would compute for ``ctx.q`` (any number of new queries), and the
    slots it read."""
    layer = ctx.layer
    T = layer.index.shape[-1]
    if getattr(layer, "key_store", None) is not None:
        if ctx.q.shape[-2] > 1 and state is not None:
            return sequential_quant_attention(ctx, state, policies)
        return layer.attend(ctx), float(T)
    return layer_attention(ctx, None), float(T)


@register_verifier("full")
@dataclass
class FullVerify(Verifier):
    """Exact verification: the target reads its whole cache (a quantized one as decoding would)."""

    paper = "Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318"

    def start(self, sc: Any) -> None:
        self._policies = [p for p in sc.cache.recipe.kv if p.kind == "quant"]
        self._snapshot = None
        self._stats = sc.stats

    def begin(self, sc: Any, snapshot: Any, proposal: Any) -> None:
        self._snapshot = snapshot

    def attend(self, ctx: Any) -> torch.Tensor:
        state = self._snapshot.layer_state(ctx.layer_idx) if self._snapshot is not None else None
        out, read = exact_attention(ctx, state, self._policies)
        self._stats.target_kv_bytes += read * kv_slot_bytes(ctx.layer)
        return out
