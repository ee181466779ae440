"""Capture every layer's post-RoPE ``q, k, v`` during a forward pass (offline tools: calibration, training).

::

    with capture_attention(model) as capture:
        model(input_ids=ids, use_cache=False)
    module, q, k, v, scaling = capture.records[0]   # q: [B, H, T, D], k, v: [B, H_kv, T, D]

Inside the block the model's attention is a temporary function registered with
``transformers.AttentionInterface`` under a name of its own: it records each layer's inputs and returns
plain causal SDPA (every layer global and causal, no padding mask, as the tools use it: full sequences
without a cache). On exit, normally or by an exception, the model's previous attention implementation
is restored and the name is removed from transformers' attention and mask registries.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Captured", "AttentionCapture", "capture_attention"]

_COUNTER = itertools.count()


class Captured(NamedTuple):
    """One layer's attention inputs. q: [B, H, T, D]; k, v: [B, H_kv, T, D]; ``scaling`` the softmax
    scale the model passed (``D ** -0.5`` when it passed none)."""

    module: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float


class AttentionCapture:
    """The attention function: records :class:`Captured` per ``layer_idx`` into :attr:`records` (later
    forwards overwrite; ``records.clear()`` between them). With ``keep_grad`` the keys and values keep
    their gradients (``k.grad``, ``v.grad`` after ``backward()``)."""

    def __init__(self) -> None:
        self.records: dict[int, Captured] = {}
        self.keep_grad = False

    def __call__(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # query: [B, H, T, D], key/value: [B, H_kv, T, D] -> ([B, T, H, D], None)
        if self.keep_grad and key.requires_grad:
            key.retain_grad()
            value.retain_grad()
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        self.records[module.layer_idx] = Captured(module, query, key, value, scale)
        groups = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=groups > 1
        )
        return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the capture applies causality itself (is_causal=True)


@contextlib.contextmanager
def capture_attention(model: Any) -> Iterator[AttentionCapture]:
    """Run ``model`` through an :class:`AttentionCapture` inside the block (see the module docstring)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"longlab_capture_{next(_COUNTER)}"
    capture = AttentionCapture()
    previous = model.config._attn_implementation
    AttentionInterface.register(name, capture)
    AttentionMaskInterface.register(name, _no_mask)
    try:
        model.set_attn_implementation(name)
        yield capture
    finally:
        try:
            if model.config._attn_implementation != previous:
                model.set_attn_implementation(previous)
        finally:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
