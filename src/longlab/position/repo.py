"""RePo: context re-positioning (Li, Zhao, Cai, Sproat 2025, arXiv 2512.14391; code SakanaAI/repo).

From layer ``start`` on, each token gets one learned real-valued position per KV head,
``z_i = i + δ_i`` with ``δ_i = W_f(SiLU(W_g h_i) ⊙ W_c h_i) ∈ R^{H_kv}`` (``h_i``: the attention input,
``W_g, W_c: D_model -> D_model/8``, ``W_f: D_model/8 -> H_kv``, no bias; ``W_g, W_c ~ N(0, 0.02)``
truncated at 3σ). RoPE is evaluated at ``z_i`` for both ``q_i`` and ``k_i`` of the head; everything else
is unchanged. ``W_f`` starts at zero (the spec's [recon] choice for short fine-tunes of pretrained
models: ``δ = 0``, so the untrained module reproduces the base model exactly; the paper starts near
``z ≈ 0``). Query heads of one GQA group share their KV head's position.

How it reaches the model, without patching a class: RoPE rotations of one pair compose,
``R(i)·R(δ) = R(i + δ)``, so a forward hook rotates the projected ``q`` and ``k`` of the layer by ``δ``
before the model's own RoPE rotates them by ``i`` (for Gemma 3 after its per-head ``q_norm``/``k_norm``,
which do not commute with a rotation). ``δ`` depends only on the token's own hidden state, so cached
keys stay valid: each key is rotated once, when written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..recipe import LonglabError
from ..registry import MAX_LAYERS, param
from .base import LayerRope, find_rotary, register_position
from .variants import _Trainable, attention_modules

__all__ = ["RePo", "RePoModule", "rotate_by"]


class RePoModule(nn.Module):
    """``δ = W_f(SiLU(W_g h) ⊙ W_c h)``: ``h [B, T, D_model] -> δ [B, T, H_kv]``."""

    def __init__(self, d_model: int, n_kv: int, hidden: int = 0) -> None:
        super().__init__()
        hidden = hidden or max(1, d_model // 8)
        self.w_g = nn.Linear(d_model, hidden, bias=False)
        self.w_c = nn.Linear(d_model, hidden, bias=False)
        self.w_f = nn.Linear(hidden, n_kv, bias=False)
        for lin in (self.w_g, self.w_c):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
        nn.init.zeros_(self.w_f.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w_f(nn.functional.silu(self.w_g(h)) * self.w_c(h))  # [B, T, H_kv]


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` (rotate-half layout) by angle ``δ·θ_i`` in pair ``i``; ``delta [B, T, H]``,
    ``inv_freq [D/2]``. ``δ = 0`` returns ``x`` exactly (cos 1, sin 0)."""
    ang = delta.float()[..., None] * inv_freq.float()  # [B, T, H, D/2]
    ang = torch.cat((ang, ang), dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * ang.cos().to(x.dtype) + rot * ang.sin().to(x.dtype)


@register_position("repo")
@dataclass
class RePo(_Trainable):
    """RePo (arXiv 2512.14391): learned per-KV-head positions ``z = i + δ(h)`` from layer ``start`` on
    (default 5, as the official OLMo-2 model); ``hidden`` the width of ``W_g``/``W_c`` (0: D_model/8);
    ``weights=DIR`` loads a fine-tune (``longlab train repo``). Untrained (``δ = 0``) it is the base model."""

    paper = "arXiv 2512.14391"
    start: int = param(5, low=0, high=MAX_LAYERS, integer=True)  # first layer with a RePo module
    hidden: int = param(0, low=0, high=1 << 16, integer=True)  # 0: the paper's size
    weights: str = ""
    qk_norm: bool = param(False, choices=(True, False))  # not RePo's (refused); for the shared variant loader

    def validate(self) -> None:
        if self.qk_norm:
            raise LonglabError("repo: qk_norm is a DroPE/RoPE-ID option, not RePo's")

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        return LayerRope(dict(params))  # the model's own RoPE, shifted per token by the hooks

    def attach(self, model: Any, base_model: str | None) -> None:
        self._hooks = []
        attns = attention_modules(model)
        if self.start >= len(attns):
            raise LonglabError(
                f"repo: start={self.start} but the model has {len(attns)} layers (0-{len(attns) - 1})"
            )
        _, _, rotary = find_rotary(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n_kv = config.num_key_value_heads
        group = config.num_attention_heads // n_kv
        layer_types = getattr(config, "layer_types", None)
        param = next(model.parameters())
        for idx, attn in enumerate(attns):
            if idx < self.start:
                continue
            module = RePoModule(config.hidden_size, n_kv, self.hidden).to(param.device, param.dtype)
            attn.add_module("longlab_repo", module)
            lt = layer_types[idx] if layer_types and hasattr(rotary, f"{layer_types[idx]}_inv_freq") else None
            buffer = f"{lt}_inv_freq" if lt else "inv_freq"
            state: dict[str, torch.Tensor] = {}

            def pre(mod: Any, args: Any, kwargs: Any, module=module, state=state) -> None:
                h = kwargs.get("hidden_states", args[0] if args else None)
                state["delta"] = module(h)  # [B, T, H_kv]

            def make(heads_per_pos: int, after_norm: bool, state=state, buffer=buffer):
                def hook(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
                    delta = state["delta"].repeat_interleave(heads_per_pos, dim=-1)  # [B, T, H or H_kv]
                    inv = getattr(rotary, buffer)
                    if after_norm:  # [B, H, T, D]
                        return rotate_by(out.transpose(1, 2), delta, inv).transpose(1, 2)
                    b, t, width = out.shape  # [B, T, H*D]
                    x = out.view(b, t, delta.shape[-1], width // delta.shape[-1])
                    return rotate_by(x, delta, inv).reshape(b, t, width)

                return hook

            self._hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
            normed = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
            q_mod = attn.q_norm if normed else attn.q_proj
            k_mod = attn.k_norm if normed else attn.k_proj
            self._hooks.append(q_mod.register_forward_hook(make(group, normed)))
            self._hooks.append(k_mod.register_forward_hook(make(1, normed)))
        if self.weights:
            self._load(model, base_model)

    def detach(self, model: Any) -> None:
        super().detach(model)
        for attn in attention_modules(model):
            if hasattr(attn, "longlab_repo"):
                delattr(attn, "longlab_repo")
