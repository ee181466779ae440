"""KIVI: tuning-free asymmetric 2-bit/4-bit KV-cache quantization.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", ICML 2024, arXiv:2402.02750.

Quantizer (asymmetric, round to nearest): ``s = (max - min) / (2^b - 1)``, ``q = round((x - min) / s)``,
``x_hat = q * s + min`` (see :mod:`longlab.quant.quantizer`).

- **Keys per channel**: ``min``/``max`` over groups of ``G`` consecutive tokens of one channel, because
  key outliers sit in fixed channels. Keys stay in a full-precision buffer of up to ``R`` tokens; when
  it holds ``R`` (or more, after a prefill chunk), the oldest multiple of ``R`` is quantized in one
  block (``R`` is a multiple of ``G``, so groups are whole).
- **Values per token**: ``min``/``max`` over groups of ``G`` channels of one token (value errors
  average out per token in the attention-weighted sum). Values keep a sliding full-precision window
  of exactly the last ``R`` tokens; the older ones are quantized at every step.

Defaults are the paper's: ``G = 32``, ``R = 128``; ``kivi2`` stores 2-bit codes, ``kivi4`` 4-bit.
``G`` is capped at ``head_dim`` for the value groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..recipe import LonglabError, register
from ..registry import MAX_BLOCK, MAX_TOKENS, param
from .base import QuantPolicy
from .storage import ChannelGroupStore, QuantizedLayer, TokenGroupStore

__all__ = ["KIVI", "KIVI2", "KIVI4"]


@dataclass
class KIVI(QuantPolicy):
    """KIVI at ``bits`` bits (a ClassVar: ``kivi2``, ``kivi4``). Fields: ``group_size`` G, ``residual`` R,
    ``sink`` (leading entries kept in full precision; KIVI uses none)."""

    paper: ClassVar[str] = "arXiv:2402.02750"
    bits: ClassVar[int] = 2

    group_size: int = param(32, low=1, high=MAX_BLOCK, integer=True)  # G: tokens (keys), channels (values)
    residual: int = param(128, low=1, high=MAX_TOKENS, integer=True)  # R, a multiple of G (checked below)
    sink: int = param(0, low=0, high=MAX_TOKENS, integer=True)
    chunk_tokens: int = param(4096, low=16, high=MAX_TOKENS, integer=True)  # dequantisation chunk

    def validate(self) -> None:
        super().validate()
        if self.residual % self.group_size:
            raise LonglabError(
                f"{self.name}: residual ({self.residual}) must be a multiple of "
                f"group_size ({self.group_size})"
            )

    def make_layer(self, ctx) -> QuantizedLayer | None:
        if ctx.layer.index.shape[-1] <= self.sink:
            return None
        keys = ChannelGroupStore(self.bits, self.group_size, self.scale_dtype)
        values = TokenGroupStore(self.bits, self.token_group(ctx, self.group_size), self.scale_dtype)
        return self.layer_from(ctx, keys, values)

    def step(self, ctx, layer: QuantizedLayer) -> bool:
        R = self.residual
        n_keys = layer.keys.shape[-2] // R * R  # the key buffer is flushed in whole blocks of R
        n_values = max(0, layer.values.shape[-2] - R)  # values: a sliding window of exactly R
        layer.quantize_keys(n_keys)
        layer.quantize_values(n_values)
        return bool(n_keys or n_values)


@register("kivi2")
@dataclass
class KIVI2(KIVI):
    """KIVI with 2-bit codes (keys per channel, values per token; G = 32, R = 128)."""

    bits: ClassVar[int] = 2


@register("kivi4")
@dataclass
class KIVI4(KIVI):
    """KIVI with 4-bit codes (keys per channel, values per token; G = 32, R = 128)."""

    bits: ClassVar[int] = 4
