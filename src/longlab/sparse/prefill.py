"""Sparse-prefill selectors as recipe prefill policies (``ashape``, ``vslash``, ``prism+snapkv@0.5``, ...).

Each selector of :data:`longlab.sparse.base.SELECTORS` is registered with the recipe registry as a
``kind = "prefill"`` method with the same fields. At every prefill chunk the hook calls
:meth:`SparsePrefill.attend`: the selector picks blocks from the chunk's post-RoPE ``q`` and the held
keys, and the block-sparse executor computes attention on those blocks only. Layers whose cache is no
longer the contiguous stream (after eviction, with padding, or sliding-window layers) fall back to
dense attention, since block masks are defined over contiguous positions.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..recipe import LonglabError, Method, register
from . import flexprefill, minference, prism, sale, xattention  # noqa: F401  (fill SELECTORS)
from .base import SELECTORS
from .executor import block_sparse_attention

PAPERS = {
    "ashape": "arXiv:2407.02490",
    "vslash": "arXiv:2407.02490",
    "blocktopk": "arXiv:2407.02490",
    "flexprefill": "arXiv:2502.20766",
    "xattention": "arXiv:2503.16428",
    "prism": "arXiv:2602.08426",
    "sale": "arXiv:2505.24179",
}


class SparsePrefill:
    """Mixin: run a block selector + the block-sparse executor as the prefill attention."""

    kind: ClassVar[str] = "prefill"
    backend: str = "auto"

    def validate(self) -> None:
        if self.backend not in ("auto", "flex", "gather", "dense"):
            raise LonglabError(
                f"{self.name}: backend must be auto, flex, gather or dense, got {self.backend!r}"
            )

    def attend(self, ctx) -> torch.Tensor:
        """ctx.q: [B, H, T_q, D]; held k, v: [B, H_kv, T, D] -> out [B, H, T_q, D]."""
        from ..hook import _layer_attention

        idx = ctx.key_index
        contiguous = (
            ctx.sliding_window is None
            and bool((idx >= 0).all())
            and idx.shape[-1] == ctx.n_seen
            and int(idx[0, 0, 0]) == 0
        )
        if not contiguous:
            return _layer_attention(ctx, None)
        mask = self.select(ctx.q, ctx.k, ctx.scaling)
        return block_sparse_attention(ctx.q, ctx.k, ctx.v, mask, ctx.scaling, backend=self.backend)


def _make(name: str, selector: type) -> type:
    namespace = {
        "__doc__": selector.__doc__,
        "__module__": __name__,
        "__annotations__": {"backend": str},
        "backend": "auto",
        "kind": "prefill",
        "paper": PAPERS.get(name, "see docstring"),
    }
    cls = type(f"{selector.__name__}Prefill", (SparsePrefill, selector, Method), namespace)
    cls = dataclasses.dataclass(cls)
    original = cls.__post_init__

    def __post_init__(self) -> None:
        try:
            original(self)
        except ValueError as exc:
            raise LonglabError(f"{name}: {exc}") from None
        SparsePrefill.validate(self)

    cls.__post_init__ = __post_init__
    return register(name)(cls)


PREFILL_POLICIES = {name: _make(name, sel) for name, sel in sorted(SELECTORS.items())}
