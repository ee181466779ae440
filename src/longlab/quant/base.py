"""Base class of quantization policies (``kind = "quant"``): they convert a layer's storage.

The hook calls :meth:`QuantPolicy.apply` after attention, after every prefill chunk while the cache
is compressing and after every decode step (recipes list quantization after eviction). The first
call swaps the layer for a :class:`~longlab.quant.storage.QuantizedLayer`; later calls move entries
from the full-precision residual into packed storage and may lower bit widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..recipe import LonglabError, Method
from ..registry import param
from .quantizer import SCALE_DTYPES
from .storage import QuantizedLayer

if TYPE_CHECKING:
    from ..attention import LayerContext

__all__ = ["QuantPolicy", "FP_DTYPES", "resolve_fp_dtype"]

FP_DTYPES = {
    "model": None,  # the model's own dtype
    "16bit": "16bit",  # the model's dtype if it has 16 bits, else float16 (PM-KVQ's 16-bit sink and window)
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def resolve_fp_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of full-precision sink/residual entries for ``fp_dtype`` ``name`` (None: the model's)."""
    dtype = FP_DTYPES[name]
    if dtype == "16bit":
        return model_dtype if model_dtype.itemsize == 2 else torch.float16
    return dtype


@dataclass
class QuantPolicy(Method):
    """A storage policy. Subclasses implement :meth:`make_layer` and :meth:`step`.

    ``scale_dtype``: dtype of stored scales and offsets; ``fp_dtype``: dtype of the full-precision
    sink and residual (``"model"``: the model's own dtype; ``"16bit"``: the model's dtype if 16-bit, else
    float16); ``fused``: decode steps read the packed codes with the fused kernel
    (:func:`longlab.ops.qdecode.quant_decode`) where it runs, else (``false``, or no compiler) the
    chunked dequantise-and-attend PyTorch path."""

    kind: ClassVar[str] = "quant"
    acts_during_decode: ClassVar[bool] = True  # new entries are quantized as decoding proceeds
    batch_select_safe: ClassVar[bool] = True  # its state is the QuantizedLayer's (rows selected with it)

    scale_dtype: str = param("float16", choices=tuple(SCALE_DTYPES))
    fp_dtype: str = param("model", choices=tuple(FP_DTYPES))
    fused: bool = param(True, choices=(True, False))

    def make_layer(self, ctx: LayerContext) -> QuantizedLayer | None:
        """A QuantizedLayer taking over ``ctx.layer`` (None: not yet, e.g. fewer entries than sinks)."""
        raise NotImplementedError

    def token_group(self, ctx: LayerContext, group_size: int) -> int:
        """Channels per per-token group: ``min(group_size, D)``, which must divide the head dim ``D``."""
        D = ctx.layer.values.shape[-1]
        group = min(group_size, D)
        if D % group:
            raise LonglabError(f"{self.name}: head_dim {D} is not a multiple of group_size {group}")
        return group

    def layer_from(self, ctx: LayerContext, key_store, value_store) -> QuantizedLayer:
        """``ctx.layer`` moved into the two stores, keeping this policy's ``sink`` entries and
        ``chunk_tokens`` dequantisation chunk."""
        return QuantizedLayer.from_layer(
            ctx.layer,
            key_store,
            value_store,
            sink=self.sink,
            fp_dtype=resolve_fp_dtype(self.fp_dtype, ctx.layer.keys.dtype),
            chunk_tokens=self.chunk_tokens,
            fused=self.fused,
        )

    def step(self, ctx: LayerContext, layer: QuantizedLayer) -> bool:
        """Move entries into packed storage / lower widths; True when something changed."""
        raise NotImplementedError

    def apply(self, ctx: LayerContext) -> bool:
        layer = ctx.layer
        converted = False
        if not isinstance(layer, QuantizedLayer):
            layer = self.make_layer(ctx)
            if layer is None:
                return False
            layer.policy_name = self.name
            ctx.cache.layers[ctx.layer_idx] = layer
            ctx.layer = layer
            converted = True
        elif getattr(layer, "policy_name", self.name) != self.name:
            raise LonglabError(
                f"layer {ctx.layer_idx} is already quantized by {layer.policy_name}; "
                "a recipe holds one quant policy"
            )
        return self.step(ctx, layer) or converted
