"""Small exact attention kernels the speculation code shares: attention over an explicit key set that
returns ``(out, lse)`` (and, when asked, the probabilities), and the log-sum-exp merge of two parts.

Shapes: ``q [B, H, t, D]``; ``k, v [B, H_kv, S, D]``; ``kpos [B, H_kv, S]`` token positions (-1 = empty);
``qpos [B, t]``. A key is visible when ``0 <= kpos <= qpos`` (and ``qpos - kpos < window``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import lse_merge

__all__ = ["attend_kv", "lse_merge", "kv_slot_bytes", "SlotView"]


def attend_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpos: torch.Tensor,
    qpos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    want_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Softmax attention of ``q`` over ``(k, v)`` in fp32.

    Returns ``(out [B, H, t, D], lse [B, H, t], probs [B, H, t, S] or None)``; a query that sees no key
    gets ``out = 0`` and ``lse = -inf`` (so an lse merge ignores that part)."""
    B, H, t, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    g = H // H_kv
    qg = q.float().reshape(B, H_kv, g * t, D)
    logits = (qg @ k.float().transpose(-1, -2)).reshape(B, H, t, S) * scaling  # [B, H, t, S]
    kp = kpos.repeat_interleave(g, dim=1)[:, :, None, :] if g > 1 else kpos[:, :, None, :]  # [B, H, 1, S]
    qp = qpos.to(kp.dtype)[:, None, :, None]  # [B, 1, t, 1]
    vis = (kp >= 0) & (kp <= qp)
    if window is not None:
        vis = vis & (kp > qp - window)
    logits = logits.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, t]
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])  # [B, H, t, S]
    vals = v.float().reshape(B, H_kv, 1, S, -1)
    out = (probs.reshape(B, H_kv, g, t, S) @ vals).reshape(B, H, t, -1)  # [B, H, t, D]
    return out, lse, (probs if want_probs else None)


def kv_slot_bytes(layer) -> float:
    """Bytes of K/V storage per held slot of a cache layer (packed codes and scales included for a
    quantized layer): what reading one slot of every head costs."""
    slots = layer.index.shape[-1] if layer.index is not None else 0
    if not slots:
        return 0.0
    tensors = [layer.keys, layer.values]
    for name in ("sink_keys", "sink_values"):
        t = getattr(layer, name, None)
        if t is not None:
            tensors.append(t)
    for store in (getattr(layer, "key_store", None), getattr(layer, "value_store", None)):
        if store is not None:
            tensors += store.tensors()
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) / slots


@dataclass
class SlotView:
    """A layer's selected slots below ``base``, gathered once (``k, v [B, H_kv, S, D]``, ``pos [B, H_kv, S]``,
    -1 = filler), read together with every slot written since (``>= base``): the sparse view a self-draft
    drafts over and Dustin verifies over. ``complete``: every held slot below ``base`` is selected (then
    ``k, v`` are left empty and the caller reads the layer itself)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    base: int
    complete: bool = False

    @classmethod
    def gather(cls, ctx, take: torch.Tensor, base: int, *, skip_kv: bool = False) -> SlotView:
        """The slots where ``take [B, H_kv, base]`` is True (valid ones only), in stream order, padded to
        the largest per-head count; ``skip_kv``: positions only."""
        idx = ctx.layer.index[..., :base]  # [B, H_kv, base]
        take = take & (idx >= 0)
        counts = take.sum(-1)
        S = int(counts.max()) if counts.numel() else 0
        order = ((~take).long() * base + torch.arange(base, device=idx.device)).argsort(-1)[..., :S]
        ok = torch.arange(S, device=idx.device) < counts[..., None]
        pos = torch.where(ok, idx.gather(2, order), torch.full_like(order, -1, dtype=idx.dtype))
        if skip_kv:
            return cls(torch.empty(0), torch.empty(0), pos, base, True)
        k_all, v_all = ctx.k[:, :, :base], ctx.v[:, :, :base]  # a quantized layer dequantises once here
        k = k_all.gather(2, order[..., None].expand(-1, -1, -1, k_all.shape[-1])).to(ctx.q.dtype)
        v = v_all.gather(2, order[..., None].expand(-1, -1, -1, v_all.shape[-1])).to(ctx.q.dtype)
        return cls(k, v, pos, base)

    def read(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, pos)``: the view followed by the layer's slots from ``base`` on."""
        T = layer.index.shape[-1]
        if hasattr(layer, "key_slice"):  # quantized storage
            k_tail, v_tail = layer.key_slice(self.base, T), layer.value_slice(self.base, T)
        else:
            k_tail, v_tail = layer.keys[:, :, self.base :], layer.values[:, :, self.base :]
        k = torch.cat([self.k, k_tail.to(self.k.dtype)], dim=2)
        v = torch.cat([self.v, v_tail.to(self.v.dtype)], dim=2)
        pos = torch.cat([self.pos, layer.index[..., self.base :]], dim=2)
        return k, v, pos
