"""KV-cache quantization: packed integer storage and the policies that fill it.

- :mod:`~longlab.quant.quantizer`: asymmetric quantizer, bit packing, PM-KVQ's equivalent right shift;
- :mod:`~longlab.quant.storage`: :class:`QuantizedLayer` (sink | packed main | full-precision residual),
  chunked attention that dequantises on the fly;
- :mod:`~longlab.quant.kivi`: ``kivi2``, ``kivi4`` (Liu et al. 2024, arXiv:2402.02750);
- :mod:`~longlab.quant.pmkvq`: ``pmkvq`` (ICLR 2026), budgets and progressive bit lowering;
- :mod:`~longlab.quant.calibrate`: ``longlab calibrate pmkvq`` (sensitivity, MILP allocation, smoothing).

Recipes put quantization after eviction: ``snapkv@0.5+kivi2``, ``pmkvq:budget_mb=8``.
"""

from .base import QuantPolicy
from .kivi import KIVI, KIVI2, KIVI4
from .pmkvq import PMKVQ, layer_bytes, load_allocation
from .storage import ChannelGroupStore, QuantizedLayer, TokenGroupStore, chunked_attention

__all__ = [
    "QuantPolicy",
    "KIVI",
    "KIVI2",
    "KIVI4",
    "PMKVQ",
    "layer_bytes",
    "load_allocation",
    "QuantizedLayer",
    "TokenGroupStore",
    "ChannelGroupStore",
    "chunked_attention",
]
