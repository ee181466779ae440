"""Sparse prefill: block masks, a block-sparse attention executor, and block selectors.

Contract (per layer, per prefill chunk): ``q [B, H, T_q, D]``, ``k, v [B, H_kv, T_k, D]`` post-RoPE, queries
are the last ``T_q`` of the ``T_k`` key positions::

    sel = make_selector("xattention", tau=0.9)
    mask = sel.select(q, k, scaling)                       # BlockSparseMask [B, H, n_qb, n_kb]
    out = block_sparse_attention(q, k, v, mask, scaling)   # [B, H, T_q, D]
    out, mask = sparse_prefill(q, k, v, sel, scaling)      # the same, in one call

Every selector is also a recipe prefill policy (``"xattention:tau=0.9"``), registered once with its paper
in the recipe registry; :data:`SELECTORS` is the registry's view of them.

``backend="auto"`` without autograd uses longlab's C++ block-sparse flash kernel on CPU in float32
(:mod:`longlab.ops.block_flash`, built once per machine, ~1 minute) and the grouped fused-SDPA backend
for other dtypes or where it cannot be built; with autograd, compiled flex_attention for ``T_q >= 2048``
(first call compiles, ~10-30 s on CPU) and the plain-PyTorch gather backend below that.
"""

from longlab.sparse.base import SELECTORS, BlockSelector, make_selector
from longlab.sparse.blockmask import (
    BlockSparseMask,
    causal_allowed,
    density,
    density_per_head,
    enforce_required,
    full_mask,
    required_blocks,
)
from longlab.sparse.executor import (
    block_sparse_attention,
    dense_causal_attention,
    quality_metrics,
    sparse_prefill,
)
from longlab.sparse.flexprefill import FlexPrefill
from longlab.sparse.minference import AShape, BlockTopK, VerticalSlash
from longlab.sparse.prefill import PrefillMetrics, SparsePrefill, collect_prefill_metrics
from longlab.sparse.prism import Prism, band_dims
from longlab.sparse.sale import SALE
from longlab.sparse.xattention import XAttention, antidiagonal_block_scores

__all__ = [
    "SELECTORS",
    "BlockSelector",
    "make_selector",
    "SparsePrefill",
    "PrefillMetrics",
    "collect_prefill_metrics",
    "BlockSparseMask",
    "causal_allowed",
    "density",
    "density_per_head",
    "enforce_required",
    "full_mask",
    "required_blocks",
    "block_sparse_attention",
    "sparse_prefill",
    "dense_causal_attention",
    "quality_metrics",
    "AShape",
    "VerticalSlash",
    "BlockTopK",
    "FlexPrefill",
    "XAttention",
    "antidiagonal_block_scores",
    "Prism",
    "band_dims",
    "SALE",
]
