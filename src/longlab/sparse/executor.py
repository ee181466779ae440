"""Exact causal attention restricted to the blocks of a :class:`BlockSparseMask`.

Backends behind :func:`block_sparse_attention`:

* ``"flex"``: ``torch.nn.attention.flex_attention``, compiled once per process (the compiled function is
  cached; inductor caches one kernel per shape). Blocks fully below the diagonal are passed as "full" blocks
  (no element mask), the diagonal blocks as partial blocks with a causal ``mask_mod``.
* ``"gather"``: plain PyTorch. Loops over q-blocks; per q-block it gathers only the selected k-blocks of
  every head (padded to the largest count among heads) and runs SDPA with an element mask of shape
  ``[B, H, bq, n_sel * bk]``. Never materialises ``T_q x T_k``.
* ``"dense"``: the oracle, SDPA over all keys with an element causal mask (ignores the block mask).
* ``"auto"``: ``"flex"`` for ``T_q >= FLEX_MIN_Q_LEN`` where the compile cost pays off, else ``"gather"``
  (also if flex fails to compile, with one warning).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from longlab.sparse.blockmask import (
    BlockSparseMask,
    density_per_head,
    element_mask_rows,
    enforce_required,
    fully_visible,
)

__all__ = [
    "Backend",
    "FLEX_MIN_Q_LEN",
    "block_sparse_attention",
    "sparse_prefill",
    "dense_causal_attention",
    "to_flex_block_mask",
    "quality_metrics",
    "sample_rows",
]

Backend = Literal["auto", "flex", "gather", "dense"]
FLEX_MIN_Q_LEN = 2048
_FLEX_RECOMPILE_LIMIT = 64


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-d: q [B, H, T_q, D], k/v [B, H_kv, T_k, D]")
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H % H_kv:
        raise ValueError(f"H={H} must be a multiple of H_kv={H_kv}")
    if T_q > T_k:
        raise ValueError(f"T_q={T_q} > T_k={T_k}: queries must be the last T_q key positions")
    return B, H, H_kv, T_q, T_k


def _check_mask(mask: BlockSparseMask, B: int, H: int, T_q: int, T_k: int) -> None:
    if (mask.q_len, mask.k_len) != (T_q, T_k) or mask.mask.shape[0] != B or mask.mask.shape[1] != H:
        raise ValueError(f"mask for B={mask.mask.shape[0]}, H={mask.mask.shape[1]}, T_q={mask.q_len}, "
                         f"T_k={mask.k_len} does not match inputs B={B}, H={H}, T_q={T_q}, T_k={T_k}")


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Dense causal attention with the queries at the end of the keys (the oracle).

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D] -> [B, H, T_q, D]
    """
    _, _, _, T_q, T_k = _check_qkv(q, k, v)
    gqa = q.shape[1] != k.shape[1]
    if T_q == T_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    pos = torch.arange(T_q, device=q.device) + (T_k - T_q)
    causal = torch.arange(T_k, device=q.device)[None, :] <= pos[:, None]  # [T_q, T_k]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scaling, enable_gqa=gqa)


def _gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask, scaling: float
) -> torch.Tensor:
    # q: [B, H, T_q, D], k/v: [B, H_kv, T_k, D(v)] -> [B, H, T_q, Dv]
    B, H, T_q, _ = q.shape
    H_kv, T_k, D, Dv = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    bq, bk, n_kb = mask.bq, mask.bk, mask.n_kb
    pad = n_kb * bk - T_k
    kb = F.pad(k, (0, 0, 0, pad)).view(B, H_kv, n_kb, bk, D)
    vb = F.pad(v, (0, 0, 0, pad)).view(B, H_kv, n_kb, bk, Dv)
    sel = mask.mask
    counts = sel.sum(-1)  # [B, H, n_qb]
    order = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True)  # selected first
    b_idx = torch.arange(B, device=q.device)[:, None, None]
    h_idx = (torch.arange(H, device=q.device) // (H // H_kv))[None, :, None]
    arange_bk = torch.arange(bk, device=q.device)
    out = q.new_empty(B, H, T_q, Dv)
    for i in range(mask.n_qb):
        r0, r1 = i * bq, min((i + 1) * bq, T_q)
        n_sel = int(counts[:, :, i].max())
        idx = order[:, :, i, :n_sel]  # [B, H, n_sel]
        valid = torch.arange(n_sel, device=q.device) < counts[:, :, i, None]  # [B, H, n_sel]
        k_sel = kb[b_idx, h_idx, idx].flatten(2, 3)  # [B, H, n_sel * bk, D]
        v_sel = vb[b_idx, h_idx, idx].flatten(2, 3)  # [B, H, n_sel * bk, Dv]
        kpos = (idx[..., None] * bk + arange_bk).flatten(2)  # [B, H, n_sel * bk]
        ok = (valid[..., None].expand(-1, -1, -1, bk).flatten(2)) & (kpos < T_k)  # [B, H, n_sel * bk]
        qpos = torch.arange(r0, r1, device=q.device) + mask.q_offset  # [rows]
        causal = kpos[:, :, None, :] <= qpos[None, None, :, None]  # [B, H, rows, n_sel * bk]
        elem = ok[:, :, None, :] & causal
        out[:, :, r0:r1] = F.scaled_dot_product_attention(q[:, :, r0:r1], k_sel, v_sel, attn_mask=elem,
                                                          scale=scaling)
    return out


_FLEX_BROKEN = False


def _mark_flex_broken(exc: Exception) -> None:
    global _FLEX_BROKEN
    _FLEX_BROKEN = True
    warnings.warn(f"flex_attention unavailable ({type(exc).__name__}: {exc}); backend='auto' uses 'gather'",
                  RuntimeWarning, stacklevel=3)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _encode_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # sel: [B, H, n_qb, n_kb] bool -> num [B, H, n_qb] int32, idx [B, H, n_qb, n_kb] int32 (selected first)
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def to_flex_block_mask(mask: BlockSparseMask):  # -> torch.nn.attention.flex_attention.BlockMask
    """Convert to a flex ``BlockMask``: fully visible blocks as full blocks, others get a causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    full_vis = fully_visible(mask.q_len, mask.k_len, mask.bq, mask.bk, mask.mask.device)
    partial = mask.mask & ~full_vis
    full = mask.mask & full_vis
    num, idx = _encode_blocks(partial)
    fnum, fidx = _encode_blocks(full)
    # A tensor (not a Python int) in the closure, so a new offset does not force a recompile.
    offset = torch.tensor(mask.q_offset, device=mask.mask.device, dtype=torch.int64)

    def causal_mod(b, h, q_idx, kv_idx):  # flex mask_mod signature
        return kv_idx <= q_idx + offset

    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(mask.bq, mask.bk), mask_mod=causal_mod,
                                   seq_lengths=(mask.q_len, mask.k_len))


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask, scaling: float
) -> torch.Tensor:
    fn = _compiled_flex()
    block_mask = to_flex_block_mask(mask)
    with torch._dynamo.config.patch(recompile_limit=_FLEX_RECOMPILE_LIMIT):
        return fn(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockSparseMask,
    scaling: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Exact causal attention over the selected blocks (element causality inside diagonal blocks).

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D] (H a multiple of H_kv), mask: [B, H, n_qb, n_kb]
    -> [B, H, T_q, D]. The sink and diagonal blocks are always added (:func:`enforce_required`).
    """
    B, H, _, T_q, T_k = _check_qkv(q, k, v)
    _check_mask(mask, B, H, T_q, T_k)
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    if backend == "dense":
        return dense_causal_attention(q, k, v, scaling)
    mask = enforce_required(mask)
    if backend == "auto" and T_q >= FLEX_MIN_Q_LEN and not _FLEX_BROKEN:
        try:
            return _flex_attention(q, k, v, mask, scaling)
        except Exception as exc:  # e.g. no C++ compiler for inductor: fall back to gather, warn once
            _mark_flex_broken(exc)
    if backend in ("auto", "gather"):
        return _gather_attention(q, k, v, mask, scaling)
    if backend == "flex":
        return _flex_attention(q, k, v, mask, scaling)
    raise ValueError(f"backend must be one of 'auto', 'flex', 'gather', 'dense'; got {backend!r}")


class _Selector(Protocol):
    def select(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> BlockSparseMask: ...


def sparse_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selector: _Selector,
    scaling: float | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, BlockSparseMask]:
    """The prefill-attention contract in one call: select blocks, then attend over them.

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D] post-RoPE -> (out [B, H, T_q, D], mask [B, H, n_qb, n_kb])
    """
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    mask = selector.select(q, k, scaling)
    return block_sparse_attention(q, k, v, mask, scaling, backend), mask


def sample_rows(T_q: int, n: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """``min(n, T_q)`` distinct query rows, sorted, always including the last row. -> [R] int64"""
    if n >= T_q:
        return torch.arange(T_q, device=device)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(T_q - 1, generator=g)[: n - 1]
    return torch.cat([rows, torch.tensor([T_q - 1])]).sort().values.to(device)


def quality_metrics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockSparseMask,
    scaling: float | None = None,
    n_sample_rows: int = 64,
    out: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, float | list[float]]:
    """Density, attention recall and output error of a block mask, on sampled query rows.

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D]; ``out`` [B, H, T_q, D] is an optional sparse output to check
    (else the sparse output of the sampled rows is computed exactly from the mask).

    * recall_h = mean over sampled rows (and batch) of the true softmax mass inside the mask;
    * rel_error_h = ||O_sparse - O_dense||_F / ||O_dense||_F over sampled rows (and batch).
    Costs ``O(R * T_k)`` per head.
    """
    B, H, H_kv, T_q, T_k = _check_qkv(q, k, v)
    _check_mask(mask, B, H, T_q, T_k)
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    mask = enforce_required(mask)
    rows = sample_rows(T_q, n_sample_rows, seed, q.device)  # [R]
    g = H // H_kv
    kr = k.repeat_interleave(g, dim=1).float()  # [B, H, T_k, D]
    vr = v.repeat_interleave(g, dim=1).float()  # [B, H, T_k, Dv]
    logits = (q[:, :, rows].float() @ kr.transpose(-1, -2)) * scaling  # [B, H, R, T_k]
    pos = rows + (T_k - T_q)
    causal = torch.arange(T_k, device=q.device)[None, :] <= pos[:, None]  # [R, T_k]
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [B, H, R, T_k]
    elem = element_mask_rows(mask, rows)  # [B, H, R, T_k]
    recall = (probs * elem).sum(-1).mean(dim=(0, 2))  # [H]
    dense_out = probs @ vr  # [B, H, R, Dv]
    if out is None:
        sparse_out = torch.softmax(logits.masked_fill(~elem, float("-inf")), dim=-1) @ vr
    else:
        sparse_out = out[:, :, rows].float()
    err = (sparse_out - dense_out).pow(2).sum(dim=(0, 2, 3)).sqrt()  # [H]
    ref = dense_out.pow(2).sum(dim=(0, 2, 3)).sqrt().clamp_min(1e-30)
    rel = err / ref
    dens = density_per_head(mask)
    return {
        "density": float(dens.mean()),
        "recall": float(recall.mean()),
        "min_head_recall": float(recall.min()),
        "rel_error": float(rel.mean()),
        "max_head_rel_error": float(rel.max()),
        "density_per_head": dens.tolist(),
        "recall_per_head": recall.tolist(),
        "rel_error_per_head": rel.tolist(),
        "n_sample_rows": int(rows.numel()),
    }
