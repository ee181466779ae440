"""Selector base class, the selector view of the registry, and the small tensor helpers selectors share.

A selector is a ``@dataclass`` whose fields are its hyper-parameters (checked in ``validate()``) and
whose ``select(q, k, scaling)`` returns a :class:`~longlab.sparse.blockmask.BlockSparseMask`:

    q: [B, H, T_q, D] and k: [B, H_kv, T_k, D], post-RoPE, queries the last T_q key positions
    -> mask [B, H, ceil(T_q / bq), ceil(T_k / bk)]

Every returned mask has passed through :func:`~longlab.sparse.blockmask.enforce_required` (sink column,
diagonal, nothing above the causal diagonal). A selector is a recipe prefill policy
(:class:`~longlab.sparse.prefill.SparsePrefill`), registered once with ``@register("name")`` and its
``paper``; :data:`SELECTORS` and :func:`make_selector` read the one recipe registry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from longlab.recipe import RECIPE_METHODS, LiveView, LonglabError
from longlab.registry import MAX_BLOCK, param
from longlab.sparse.blockmask import BlockSparseMask, enforce_required
from longlab.sparse.prefill import SparsePrefill

__all__ = [
    "BlockSelector",
    "SELECTORS",
    "make_selector",
    "repeat_kv",
    "mean_pool",
    "keep_by_cumulative_mass",
    "last_rows_attention",
    "slash_sums",
]


@dataclass
class BlockSelector(SparsePrefill):
    """Base class: subclasses are registered with ``@register("name")``, set ``paper`` and implement
    :meth:`_select` (raw mask, any bool blocks)."""

    # block sizes (query rows, keys): the selectors pool and pad to whole blocks, so a block is memory
    bq: int = param(64, low=1, high=MAX_BLOCK, integer=True)
    bk: int = param(64, low=1, high=MAX_BLOCK, integer=True)

    def field_label(self, field: str) -> str:
        """Errors name the class too: ``xattention: XAttention.tau must be in [0, 1], got 1.1``."""
        return f"{self.name}: {type(self).__name__}.{field}"

    def select(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> BlockSparseMask:
        """q: [B, H, T_q, D], k: [B, H_kv, T_k, D] -> BlockSparseMask [B, H, n_qb, n_kb]."""
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"need q [B, H, T_q, D] and k [B, H_kv, T_k, D], got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"H={q.shape[1]} must be a multiple of H_kv={k.shape[1]}")
        if q.shape[2] > k.shape[2]:
            raise ValueError(f"T_q={q.shape[2]} > T_k={k.shape[2]}")
        scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
        with torch.no_grad():
            raw = self._select(q, k, scaling)
        return enforce_required(BlockSparseMask(raw, self.bq, self.bk, q.shape[2], k.shape[2]))

    def _select(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
        # q: [B, H, T_q, D], k: [B, H_kv, T_k, D] -> [B, H, n_qb, n_kb] bool
        raise NotImplementedError


SELECTORS: Mapping[str, type[BlockSelector]] = LiveView(
    "SELECTORS",
    lambda: {n: c for n, c in RECIPE_METHODS.items() if issubclass(c, BlockSelector)},
)
"""Read-only, live view ``name -> class`` of the block selectors in the recipe registry."""


def make_selector(name: str, **kwargs: Any) -> BlockSelector:
    """Build a registered selector by name, e.g. ``make_selector("xattention", tau=0.95)``."""
    if name not in SELECTORS:
        raise LonglabError(f"unknown selector {name!r}; valid names: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name](**kwargs)


def repeat_kv(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H, T, D] (GQA: each kv head serves H / H_kv consecutive q heads)."""
    g = H // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def mean_pool(x: torch.Tensor, b: int) -> torch.Tensor:
    """Mean over consecutive blocks of ``b`` tokens (the last block averages only its real tokens).

    x: [B, H, T, D] -> [B, H, ceil(T / b), D]
    """
    T = x.shape[2]
    n = -(-T // b)
    pad = n * b - T
    summed = F.pad(x.float(), (0, 0, 0, pad)).view(*x.shape[:2], n, b, x.shape[3]).sum(3)
    counts = torch.full((n,), float(b), device=x.device)
    counts[-1] = b - pad
    return summed / counts[:, None]


def keep_by_cumulative_mass(
    values: torch.Tensor, target: torch.Tensor | float, start: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Keep the largest entries along the last dim while the mass *before* adding each is below ``target``.

    values: [..., N] (non-negative), target/start: broadcastable to [..., 1]. Entry j (in descending order) is
    kept iff ``start + sum of larger entries < target``; this is the smallest top set whose mass reaches
    ``target`` (top-p / cumulative-threshold selection). -> [..., N] bool in the original order
    """
    vals, idx = torch.sort(values, dim=-1, descending=True)
    before = torch.cumsum(vals, dim=-1) - vals + start
    keep_sorted = before < target
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)


def last_rows_attention(
    q_last: torch.Tensor, k: torch.Tensor, scaling: float, k_len: int
) -> torch.Tensor:
    """Causal softmax of the last ``L`` queries against all keys.

    q_last: [B, H, L, D] (key positions k_len-L .. k_len-1), k: [B, H_kv, T_k, D] -> [B, H, L, T_k] float
    """
    L = q_last.shape[2]
    logits = (q_last.float() @ repeat_kv(k, q_last.shape[1]).float().transpose(-1, -2)) * scaling
    pos = torch.arange(L, device=q_last.device) + (k_len - L)
    causal = torch.arange(k_len, device=q_last.device)[None, :] <= pos[:, None]  # [L, T_k]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def slash_sums(a: torch.Tensor, k_len: int) -> torch.Tensor:
    """Sum attention along diagonals: ``out[o] = sum_i a[i, pos_i - o]`` for offset ``o = pos_i - j >= 0``.

    a: [B, H, L, T_k] (rows at key positions k_len-L .. k_len-1, zero above the causal diagonal)
    -> [B, H, T_k] (index = offset o)
    """
    B, H, L, T = a.shape
    # reversed row i holds offset o at column (L - 1 - i) + o; a strided view with row stride W - 1 aligns
    # all rows on o (the zero padding catches offsets beyond a row's first key).
    W = T + L
    flat = torch.nn.functional.pad(a.flip(-1), (0, L)).reshape(B * H, L * W)
    skew = flat.as_strided((B * H, L, T), (L * W, W - 1, 1), storage_offset=L - 1)
    return skew.sum(1).view(B, H, T)[..., :k_len]
