"""Exact causal attention restricted to the blocks of a :class:`BlockSparseMask`.

Backends behind :func:`block_sparse_attention`:

* ``"flex"``: ``torch.nn.attention.flex_attention``, compiled once per process (the compiled function is
  cached; inductor caches one kernel per shape). Blocks fully below the diagonal are passed as "full" blocks
  (no element mask), the diagonal blocks as partial blocks with a causal ``mask_mod``.
* ``"gather"``: plain PyTorch. Loops over q-blocks; per q-block it gathers only the selected k-blocks of
  every head (padded to the largest count among heads) and runs SDPA with an element mask of shape
  ``[B, H, bq, n_sel * bk]``. Never materialises ``T_q x T_k``.
* ``"split"``: per q-block, one fused CPU SDPA call over the diagonal blocks (shared by all heads, additive
  causal mask, a view of k/v) and mask-free calls over each head's fully visible blocks (one call for all
  heads when they share them), merged by log-sum-exp; GQA packed as query rows. Forward only.
* ``"grouped"``: :func:`grouped_block_sparse_attention`: q-blocks (per head, or per KV head when its query
  heads select alike) with equal block counts batched into mask-free fused-SDPA calls over cache-sized
  gathers, the diagonal blocks of every q-block in one ``is_causal`` call (aligned blocks) or one masked
  call, merged by log-sum-exp. Forward only; no compile.
* ``"flash"``: longlab's own block-sparse flash kernel (:mod:`longlab.ops.block_flash`, C++ built on
  first use): one 128-row tile per (head, q-block) for the whole pass, k-blocks read in place, the
  diagonal blocks' element mask inside the same online softmax. CPU, float32, forward only. Efficiency
  (ideal ``density x dense`` time / time) 0.84-1.01 in one-shot and 1.17-1.41 in chunked prefill at
  8k-32k, 1.13-1.54x faster than ``grouped`` (``docs/results/attention-bench.md``, wave 6).
* ``"dense"``: the oracle, SDPA over all keys with an element causal mask (ignores the block mask).
* ``"auto"``: without autograd, ``"flash"`` where it runs (CPU, float32, the kernel built); else on CPU
  without autograd ``"grouped"`` (no compile; efficiency = ideal ``density x dense`` time / time:
  0.9-1.3 in chunked prefill at 8k-32k, 0.64-0.87 in one-shot prefill at 8k-16k against ``is_causal``
  SDPA, below 0.8 on per-head masks at keep 0.2 / 0.5, where ``flash`` reaches it;
  ``docs/results/attention-bench.md``);
  otherwise ``"flex"`` for ``T_q >= FLEX_MIN_Q_LEN`` where the compile cost pays off, else ``"gather"``
  (also if flex fails to compile, with one warning).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from longlab.attention import compiled_flex, merge_by_lse
from longlab.ops.block_flash import available as flash_available
from longlab.ops.block_flash import block_flash_attention
from longlab.sparse.blockmask import (
    BlockSparseMask,
    density_per_head,
    element_mask_rows,
    encode_blocks,
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
    "split_block_sparse_attention",
    "grouped_block_sparse_attention",
    "sdpa_with_lse",
]

Backend = Literal["auto", "flash", "flex", "gather", "split", "grouped", "dense"]
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


def to_flex_block_mask(mask: BlockSparseMask, compute_q_blocks: bool = True):  # -> flex BlockMask
    """Convert to a flex ``BlockMask``: fully visible blocks as full blocks, others get a causal mask_mod.

    ``compute_q_blocks=False`` skips the transposed (per k-block) tables that only flex's backward reads."""
    from torch.nn.attention.flex_attention import BlockMask

    full_vis = fully_visible(mask.q_len, mask.k_len, mask.bq, mask.bk, mask.mask.device)
    partial = mask.mask & ~full_vis
    full = mask.mask & full_vis
    num, idx = encode_blocks(partial)
    fnum, fidx = encode_blocks(full)
    # A tensor (not a Python int) in the closure, so a new offset does not force a recompile.
    offset = torch.tensor(mask.q_offset, device=mask.mask.device, dtype=torch.int64)

    def causal_mod(b, h, q_idx, kv_idx):  # flex mask_mod signature
        return kv_idx <= q_idx + offset

    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(mask.bq, mask.bk), mask_mod=causal_mod,
                                   seq_lengths=(mask.q_len, mask.k_len), compute_q_blocks=compute_q_blocks)


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask, scaling: float
) -> torch.Tensor:
    fn = compiled_flex()
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    block_mask = to_flex_block_mask(mask, compute_q_blocks=grad)
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
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if backend == "flash" or (backend == "auto" and not grad and flash_available(q)):
        if grad:
            raise ValueError("backend='flash' is forward only; use 'gather' or 'flex' with autograd")
        return block_flash_attention(q, k, v, mask, scaling)
    if backend == "auto" and q.device.type == "cpu" and not grad:
        return grouped_block_sparse_attention(q, k, v, mask, scaling)
    if backend == "auto" and T_q >= FLEX_MIN_Q_LEN and not _FLEX_BROKEN:
        try:
            return _flex_attention(q, k, v, mask, scaling)
        except Exception as exc:  # e.g. no C++ compiler for inductor: fall back to gather, warn once
            _mark_flex_broken(exc)
    if backend in ("auto", "gather"):
        return _gather_attention(q, k, v, mask, scaling)
    if backend == "flex":
        return _flex_attention(q, k, v, mask, scaling)
    if backend == "split":
        return split_block_sparse_attention(q, k, v, mask, scaling)
    if backend == "grouped":
        return grouped_block_sparse_attention(q, k, v, mask, scaling)
    raise ValueError("backend must be one of 'auto', 'flash', 'flex', 'gather', 'split', 'grouped', 'dense'; "
                     f"got {backend!r}")


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the row log-sum-exp. q: [B, H, t, D], k/v: [B, H, s, D] (same H),
    mask: additive float [t, s] (0 or -inf) or None -> (out [B, H, t, D], lse [B, H, t] fp32; a row whose
    keys are all masked gets lse -inf and out 0). CPU: aten's fused flash kernel (it reports lse 0 for such
    rows, fixed here); elsewhere a plain fp32 computation."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                             attn_mask=mask, scale=scaling)
        lse = lse.float()
    else:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
        if mask is not None:
            s = s + mask.float()
        lse = torch.logsumexp(s, -1)
        out = torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), v.float()).to(q.dtype)
    if mask is not None:
        empty = torch.isinf(mask).all(-1)  # [t]
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[:, None], 0.0)
    return out, lse


def split_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scaling: float
                                 ) -> torch.Tensor:
    """Causal block-sparse attention in two kinds of dense calls per query tile, merged by log-sum-exp.

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D], mask: :class:`~longlab.sparse.blockmask.BlockSparseMask`
    ``[B, H, n_qb, n_kb]`` (sink and diagonal blocks added as the executor does). For q-tile ``i``:

    * the blocks that are not fully visible (the diagonal ones, the same for every head) form one key range
      ``[c0, c1)``: one fused SDPA call over all heads, a view of k/v, an additive causal mask;
    * the selected fully-visible blocks: one mask-free call over all heads when the heads share them (a view
      of k/v when they are contiguous), else one mask-free call per head over its gathered blocks;
    * GQA by packing: the ``g`` query heads of a KV head are ``g x rows`` query rows of one call;
    * ``O = sum_p O_p * exp(lse_p - logaddexp_p lse_p)``.

    Exact: the two key sets are disjoint and together are the tile's selected keys."""
    mask = enforce_required(mask)
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    g = H // H_kv
    bq, bk = mask.bq, mask.bk
    full_vis = fully_visible(T_q, T_k, bq, bk, mask.mask.device)  # [n_qb, n_kb]
    sel = mask.mask  # [B, H, n_qb, n_kb]
    pad = mask.n_kb * bk - T_k
    kb = F.pad(k, (0, 0, 0, pad)).view(B, H_kv, mask.n_kb, bk, D)
    vb = F.pad(v, (0, 0, 0, pad)).view(B, H_kv, mask.n_kb, bk, v.shape[-1])
    out = q.new_empty(B, H, T_q, v.shape[-1])
    kv_pos = torch.arange(T_k, device=q.device)
    for i in range(mask.n_qb):
        r0, r1 = i * bq, min((i + 1) * bq, T_q)
        qi = q[:, :, r0:r1]
        diag = (sel[:, :, i] & ~full_vis[i]).any(0).any(0).nonzero().flatten()  # [n_d] partial blocks
        parts = []
        t = r1 - r0
        qp = qi.reshape(B, H_kv, g * t, D)  # pack GQA: the g query heads of a KV head become g x t rows
        if diag.numel():
            c0, c1 = int(diag[0]) * bk, min((int(diag[-1]) + 1) * bk, T_k)
            qpos = torch.arange(r0, r1, device=q.device) + (T_k - T_q)
            vis = kv_pos[None, c0:c1] <= qpos[:, None]  # [rows, c1 - c0]
            add = torch.zeros(vis.shape, dtype=q.dtype, device=q.device).masked_fill_(~vis, float("-inf"))
            o, lse = sdpa_with_lse(qp, k[:, :, c0:c1], v[:, :, c0:c1], scaling, add.repeat(g, 1))
            parts.append((o.reshape(B, H, t, -1), lse.reshape(B, H, t)))
        full_sel = sel[:, :, i] & full_vis[i]  # [B, H, n_kb]
        if bool(full_sel.any()) and bool((full_sel == full_sel[:, :1]).all()):  # heads share the blocks
            o_f = q.new_empty(B, H, t, v.shape[-1])
            l_f = torch.empty(B, H, t, device=q.device)
            for b in range(B):
                js = full_sel[b, 0].nonzero().flatten()
                if js.numel() == 0:
                    o_f[b], l_f[b] = 0.0, float("-inf")
                    continue
                j0, j1 = int(js[0]), int(js[-1])
                if j1 - j0 + 1 == js.numel():  # one contiguous run: a view, no copy
                    ks = k[b: b + 1, :, j0 * bk: min((j1 + 1) * bk, T_k)]
                    vs = v[b: b + 1, :, j0 * bk: min((j1 + 1) * bk, T_k)]
                else:
                    ks = kb[b: b + 1, :, js].reshape(1, H_kv, -1, D)
                    vs = vb[b: b + 1, :, js].reshape(1, H_kv, -1, v.shape[-1])
                o, lse = sdpa_with_lse(qp[b: b + 1], ks, vs, scaling)
                o_f[b], l_f[b] = o.reshape(H, t, -1), lse.reshape(H, t)
            parts.append((o_f, l_f))
        elif bool(full_sel.any()):
            o_f = torch.zeros_like(qi)
            l_f = torch.full(qi.shape[:3], float("-inf"), device=q.device)
            for b in range(B):
                for h in range(H):
                    js = full_sel[b, h].nonzero().flatten()
                    if js.numel() == 0:
                        continue
                    ks = kb[b: b + 1, h // g, js].reshape(1, 1, -1, D)
                    vs = vb[b: b + 1, h // g, js].reshape(1, 1, -1, v.shape[-1])
                    o, lse = sdpa_with_lse(qi[b: b + 1, h: h + 1], ks, vs, scaling)
                    o_f[b, h], l_f[b, h] = o[0, 0], lse[0, 0]
            parts.append((o_f, l_f))
        out[:, :, r0:r1] = merge_by_lse(parts)
    return out


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


def _block_kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask, scaling: float | None
) -> tuple[tuple[int, int, int, int, int], float, BlockSparseMask]:
    """The checks every block kernel starts with: shapes ``(B, H, H_kv, T_q, T_k)`` of ``q: [B, H, T_q, D]``,
    ``k, v: [B, H_kv, T_k, D]``, the mask against them, the softmax scale (``1/sqrt(D)`` by default) and the
    mask with its required blocks (:func:`enforce_required`)."""
    shape = _check_qkv(q, k, v)
    B, H, _, T_q, T_k = shape
    _check_mask(mask, B, H, T_q, T_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    return shape, scale, enforce_required(mask)


def _fp32_with_lse(q, k, v, scaling, add):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling + add.float()
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), v.float()).to(q.dtype), lse


_WS_BYTES = 8 * 2**20  # gathered K + V per grouped call: stays in the last-level cache
# grouped: pack the blocks all g heads of a KV head select when they share at least this many (0: only when
# the heads select alike). 2: 0.79 -> 0.84 efficiency at 8k one-shot keep 0.8, 0.76 -> 0.81 at 16k, equal
# within noise on the other cells (docs/results/attention-bench.md, this round).
SPLIT_COMMON = 2


def grouped_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask,
                                   scaling: float | None = None, split_common: int = SPLIT_COMMON
                                   ) -> torch.Tensor:
    """Causal block-sparse attention as a few batched fused-SDPA calls, merged by log-sum-exp (forward only).

    q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D], mask: ``[B, H, n_qb, n_kb]`` -> [B, H, T_q, Dv]. With the
    sink and diagonal blocks added (:func:`enforce_required`), the selected blocks of q-block ``i`` split
    into two disjoint key sets:

    * the selected *fully visible* blocks: no element mask. Units are (b, KV head, q-block) when the ``g``
      query heads of the KV head select the same blocks (packed as ``g x bq`` rows), else (b, head,
      q-block); units with equal block count and row count form one class, whose queries are gathered once;
      its K/V blocks are gathered (``index_select``) into a workspace of at most ``_WS_BYTES`` (8 MiB: it
      stays in the last-level cache between the copy and the fused call that reads it) and each batch runs
      as **one** mask-free fused call, so the number of calls is about (gathered bytes / 8 MiB) plus the
      number of distinct counts, not ``H x n_qb``. With ``split_common = m > 0`` (default
      :data:`SPLIT_COMMON`), a (b, KV head, q-block)
      whose ``g`` heads select differently but share at least ``m`` blocks runs those common blocks as one
      packed ``g x bq``-row unit and each head's other blocks as its own unit, merged by log-sum-exp (the
      fused kernel tiles 384 rows by 64, 128 rows by 32: ~13% less per pair here);
    * the *diagonal* blocks (not fully visible, hence required, hence the same for every head). When
      ``bq == bk`` and the queries start on a block boundary (one-shot prefill, aligned chunks), q-block
      ``i`` against k-block ``i + q_offset / bk`` is a square causal problem: **one** ``is_causal`` fused
      call over all q-blocks (batch ``B n_qb``, GQA native, no mask tensor). Otherwise one masked call:
      keys gathered to a common width ``W``, an additive causal mask ``[B n_qb, 1, g bq, W]``.

    ``O = sum_p O_p exp(lse_p - logaddexp_p lse_p)``, in place on the first part's output; exact because
    the two key sets are disjoint and together are the selected keys. The per-block work is aten's fused
    CPU flash kernel, the same as dense SDPA's, but on 128-row units it tiles the queries by 32 rows (dense
    causal prefill: by 256), which costs ~10-15% per pair here (docs/results/attention-bench.md)."""
    (B, H, H_kv, T_q, T_k), scaling, mask = _block_kernel_inputs(q, k, v, mask, scaling)
    g = H // H_kv
    bq, bk, n_qb, n_kb = mask.bq, mask.bk, mask.n_qb, mask.n_kb
    D, Dv = q.shape[-1], v.shape[-1]
    dev = q.device
    off = T_k - T_q
    aligned = dev.type == "cpu" and bq == bk and off % bk == 0  # q-block i's diagonal is k-block i + off/bk
    fv = fully_visible(T_q, T_k, bq, bk, dev)  # [n_qb, n_kb]
    if T_k % bk:
        fv[:, -1] = False  # a padded k-block always goes through the masked (diagonal) call
    sel = mask.mask
    full = sel & fv  # [B, H, n_qb, n_kb] per head
    qpad = F.pad(q, (0, 0, 0, n_qb * bq - T_q))  # [B, H, n_qb * bq, D]
    q6 = qpad.view(B, H_kv, g, n_qb, bq, D)
    out6 = q.new_zeros(B, H_kv, g, n_qb, bq, Dv)
    lse6 = torch.full((B, H_kv, g, n_qb, bq), float("-inf"), device=dev)
    kp = F.pad(k, (0, 0, 0, n_kb * bk - T_k))  # [B, H_kv, n_kb * bk, D]
    vp = F.pad(v, (0, 0, 0, n_kb * bk - T_k))
    kb, vb = kp.reshape(B * H_kv * n_kb, bk * D), vp.reshape(B * H_kv * n_kb, bk * Dv)  # one row per k-block
    ws: dict[str, torch.Tensor] = {}  # gather workspaces, reused by every group (fresh buffers fault pages)

    def buf(name: str, n: int, like: torch.Tensor) -> torch.Tensor:
        t = ws.get(name)
        if t is None or t.numel() < n:
            t = ws[name] = like.new_empty(n)
        return t[:n]

    # 1. fully visible blocks: units with equal (count, packing) in cache-sized batches of one fused call
    f5 = full.view(B, H_kv, g, n_qb, n_kb)
    shared = (f5 == f5[:, :, :1]).all(-1).all(2)  # [B, H_kv, n_qb]: the g heads select the same blocks
    packed_sel = f5[:, :, 0] & shared[..., None]  # [B, H_kv, n_qb, n_kb]: run as g x bq packed rows
    if split_common and g > 1:  # the blocks all g heads select run packed when there are enough of them
        common = f5.all(2)  # [B, H_kv, n_qb, n_kb]
        use = shared | (common.sum(-1) >= split_common)  # [B, H_kv, n_qb]
        packed_sel = common & use[..., None] | packed_sel
    rest = f5 & ~packed_sel[:, :, None]  # [B, H_kv, g, n_qb, n_kb]: per head
    has_packed = packed_sel.any(-1) & ~shared  # [B, H_kv, n_qb]: a packed part, then per-head rest
    for packed, src in ((True, packed_sel[:, :, None]), (False, rest)):
        counts = src.sum(-1)  # [B, H_kv, g or 1, n_qb]
        order = torch.argsort(src.to(torch.int8), dim=-1, descending=True, stable=True)  # selected first
        b_all, h_all, j_all, i_all = (counts > 0).nonzero(as_tuple=True)
        rows = g * bq if packed else bq
        # class key: count, and whether the rows already hold a packed part (then merged, not written)
        c_all = counts[b_all, h_all, j_all, i_all] * 2 + (0 if packed else has_packed[b_all, h_all, i_all])
        for key in c_all.unique().tolist():
            c, merge = divmod(key, 2)
            pick = (c_all == key).nonzero().flatten()
            b, h, j, i = b_all[pick], h_all[pick], j_all[pick], i_all[pick]
            ridx = ((b * H_kv + h)[:, None] * n_kb + order[b, h, j, i, :c])  # [N, c] rows of kb / vb
            qsel = (q6[b, h, :, i] if packed else q6[b, h, j, i]).reshape(-1, 1, rows, D)  # [N, 1, rows, D]
            osel = q.new_empty(qsel.shape[0], 1, rows, Dv)
            lsel = torch.empty(qsel.shape[0], 1, rows, device=dev)
            step = max(1, _WS_BYTES // (c * bk * (D + Dv) * k.element_size()))
            for s in range(0, pick.numel(), step):
                e = min(s + step, pick.numel())
                rid = ridx[s:e].flatten()
                n = rid.numel()
                ks = torch.index_select(kb, 0, rid, out=buf("k", n * bk * D, kb).view(n, -1))
                vs = torch.index_select(vb, 0, rid, out=buf("v", n * bk * Dv, vb).view(n, -1))
                ks, vs = ks.view(e - s, 1, -1, D), vs.view(e - s, 1, -1, Dv)
                o, lse = sdpa_with_lse(qsel[s:e], ks, vs, scaling)
                osel[s:e], lsel[s:e] = o, lse
            if packed:
                out6[b, h, :, i] = osel.view(-1, g, bq, Dv)
                lse6[b, h, :, i] = lsel.view(-1, g, bq)
            elif merge:  # O = O_1 exp(l_1 - l) + O_2 exp(l_2 - l), l = logaddexp(l_1, l_2); l_2 is finite
                l1, l2 = lse6[b, h, j, i], lsel.view(-1, bq)
                new = torch.logaddexp(l1, l2)
                o1 = out6[b, h, j, i].mul_(torch.exp(l1 - new)[..., None].to(out6.dtype))
                w2 = torch.exp(l2 - new)[..., None].to(o1.dtype)
                out6[b, h, j, i] = o1.addcmul_(osel.view(-1, bq, Dv), w2)
                lse6[b, h, j, i] = new
            else:
                out6[b, h, j, i] = osel.view(-1, bq, Dv)
                lse6[b, h, j, i] = lsel.view(-1, bq)

    # 2. the diagonal blocks
    if aligned:  # one is_causal call over all q-blocks: block i against k-block i + off / bk, GQA native
        o0 = off // bk
        qd = qpad.view(B, H, n_qb, bq, D).transpose(1, 2).reshape(B * n_qb, H, bq, D)
        kd = kp.view(B, H_kv, n_kb, bk, D)[:, :, o0:].transpose(1, 2).reshape(B * n_qb, H_kv, bk, D)
        vd = vp.view(B, H_kv, n_kb, bk, Dv)[:, :, o0:].transpose(1, 2).reshape(B * n_qb, H_kv, bk, Dv)
        od, ld = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, True,
                                                                           scale=scaling)
        od = od.view(B, n_qb, H_kv, g, bq, Dv).permute(0, 2, 3, 1, 4, 5)  # [B, H_kv, g, n_qb, bq, Dv]
        ld = ld.float().view(B, n_qb, H_kv, g, bq).permute(0, 2, 3, 1, 4)
        new = torch.logaddexp(lse6, ld)  # every real row sees its own key here: finite
        w1 = torch.exp(lse6 - new)[..., None].to(out6.dtype)
        w2 = torch.exp(ld - new)[..., None].to(out6.dtype)
        out6.mul_(w1).addcmul_(od, w2)
        return out6.reshape(B, H, n_qb * bq, Dv)[:, :, :T_q]
    part = (sel & ~fv).any(0).any(0)  # [n_qb, n_kb]: diagonal blocks, shared by all heads
    js = torch.arange(n_kb, device=dev)
    first = torch.where(part, js, n_kb).amin(-1)  # [n_qb]
    last = torch.where(part, js, -1).amax(-1)
    c0 = first * bk
    c1 = torch.clamp((last + 1) * bk, max=T_k)
    W = int((c1 - c0).max())
    kidx = c0[:, None] + torch.arange(W, device=dev)  # [n_qb, W]
    qpos = torch.arange(n_qb * bq, device=dev).view(n_qb, bq) + off  # [n_qb, bq]
    vis = (kidx[:, None, :] <= qpos[:, :, None]) & (kidx < c1[:, None])[:, None, :]  # [n_qb, bq, W]
    kidx = kidx.clamp(max=T_k - 1)
    add = torch.zeros(vis.shape, dtype=q.dtype, device=dev).masked_fill_(~vis, float("-inf"))
    add = add.repeat(1, g, 1)[:, None].repeat(B, 1, 1, 1)  # [B n_qb, 1, g bq, W]
    kd = k[:, :, kidx.flatten()].view(B, H_kv, n_qb, W, D).transpose(1, 2).reshape(B * n_qb, H_kv, W, D)
    vd = v[:, :, kidx.flatten()].view(B, H_kv, n_qb, W, Dv).transpose(1, 2).reshape(B * n_qb, H_kv, W, Dv)
    qd = q6.permute(0, 3, 1, 2, 4, 5).reshape(B * n_qb, H_kv, g * bq, D)
    od, ld = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, False, attn_mask=add,
                                                                       scale=scaling) \
        if dev.type == "cpu" else _fp32_with_lse(qd, kd, vd, scaling, add)
    empty = ~vis.any(-1)  # [n_qb, bq]: rows whose own key sits in a fully visible block (bq != bk)
    ld = ld.float().view(B, n_qb, H_kv, g, bq).permute(0, 2, 3, 1, 4)  # [B, H_kv, g, n_qb, bq]
    od = od.view(B, n_qb, H_kv, g, bq, Dv).permute(0, 2, 3, 1, 4, 5)
    if bool(empty.any()):
        ld = ld.masked_fill(empty, float("-inf"))
        od = od.masked_fill(empty[..., None], 0.0)
    out = merge_by_lse([(out6, lse6), (od, ld)])  # [B, H_kv, g, n_qb, bq, Dv]
    return out.reshape(B, H, n_qb * bq, Dv)[:, :, :T_q]
