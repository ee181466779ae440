"""Attention kernels behind one call, for any :class:`~longlab.ops.masks.SliceMask` (LongCA-bench's kernel
axis).

Bu et al., "LongCA-bench", arXiv 2510.17896 (ICLR 2026) compare dense and sparse attention kernels on the
same masks. Here every kernel computes

    O = softmax(Q K^T * scaling + log M) V,   M[q, k] in {0, 1} from the slice mask,

with ``q [B, H, T_q, D]``, ``k, v [B, H_kv, T_k, D]`` (GQA: query head ``h`` reads KV head
``h // (H / H_kv)``); a query row that sees no key outputs zeros. Kernels (:data:`KERNELS`):

* ``naive``: materialised logits, masked softmax in fp32, matmul (the reference; O(T_q T_k) memory);
* ``sdpa-math``: ``F.scaled_dot_product_attention`` forced to the math backend, boolean mask;
* ``sdpa``: SDPA's default dispatch (on CPU the fused flash kernel): no mask for FULL, ``is_causal`` for
  CAUSAL, else the boolean mask;
* ``flex``: ``flex_attention`` compiled with inductor (``torch.compile``), mask as a precomputed
  ``BlockMask`` (:meth:`SliceMask.to_flex_block_mask`); ``flex-eager`` is the uncompiled reference;
* ``gather``: longlab's block kernel for head-shared masks: per query tile, without autograd (CPU), one
  mask-free fused SDPA call over the tile's full blocks (a view of k/v when they are contiguous) and one
  over its partial blocks with their element mask, merged by log-sum-exp, GQA packed as query rows; with
  autograd, one SDPA call over all selected blocks with an element mask where a partial block needs one;
* ``grouped``: longlab's batched block kernel for head-shared masks (forward only, no compile): the
  q-blocks that select the same number of full k-blocks form one group, gathered into ``[G, H_kv, n, D]``
  and run as **one** mask-free fused SDPA call; likewise the partial blocks, with their element mask as an
  additive mask; GQA packed as query rows; the two parts merged by log-sum-exp. The plan (groups, key
  indices, masks) is the mask construction, built by :func:`prepare` for a given ``gqa``;
* ``executor-grouped``: the executor's grouped backend (:func:`grouped_block_sparse_attention`);
* ``executor-flash``: the executor's ``flash`` backend, longlab's C++ block-sparse flash kernel
  (:mod:`longlab.ops.block_flash`; CPU, float32, forward only; skipped with the reason where it cannot
  be built);
* ``executor-split``: the same per-head causal block layout, run as one fused-SDPA call per query tile for
  the (head-shared) diagonal blocks with their causal mask, plus one mask-free call per head over that
  head's gathered fully-visible blocks, merged by log-sum-exp (:func:`split_block_sparse_attention`);
* ``executor-gather`` / ``executor-flex``: longlab's sparse-prefill executor
  (:func:`longlab.sparse.executor.block_sparse_attention`) on :meth:`SliceMask.to_block_sparse`; only
  masks of its causal block form (CAUSAL, RANDOM_BLOCK_*), others are refused with the reason;
* ``flash-attn``, ``flashinfer``: the CUDA libraries when installed on a GPU machine, else skipped with
  the reason (FULL / CAUSAL / document masks through their varlen interfaces).

Mask construction is separate (:func:`prepare`, timed by the benchmark) from execution (:func:`run`);
:func:`attention` does both in one call.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from longlab.attention import compiled_flex, merge_by_lse
from longlab.ops.masks import BlockLayout, SliceMask
from longlab.recipe import LonglabError
from longlab.sparse.executor import (
    block_sparse_attention,
    sdpa_with_lse,
    split_block_sparse_attention,
)

__all__ = ["KERNELS", "Prepared", "unavailable_reason", "backward_unsupported_reason", "prepare", "run",
           "attention", "flops", "split_block_sparse_attention"]

KERNELS = ("naive", "sdpa-math", "sdpa", "flex", "flex-eager", "gather", "grouped", "executor-gather",
           "executor-flex", "executor-split", "executor-grouped", "executor-flash", "flash-attn",
           "flashinfer")
_RECOMPILE_LIMIT = 256


@dataclass
class Prepared:
    """A mask converted for one kernel: ``payload`` is what the kernel reads (dense mask, BlockMask, ...)."""

    kernel: str
    mask: SliceMask
    payload: Any
    block: int


def flops(mask: SliceMask, H: int, D: int, backward: bool = False) -> float:
    """LongCA-bench's FLOP count: ``4 * area * H * D`` forward (two matmuls), backward 2.5x that."""
    f = 4.0 * mask.area() * H * D
    return 2.5 * f if backward else f


def backward_unsupported_reason(kernel: str, device: torch.device | str = "cpu") -> str | None:
    """Why ``kernel`` has no backward here (None: autograd works). torch 2.13's flex_attention raises
    ``NotImplementedError`` for backward on CPU."""
    if kernel in ("flex", "flex-eager", "executor-flex") and torch.device(device).type == "cpu":
        return "flex_attention has no backward on CPU (torch NotImplementedError)"
    if kernel in ("executor-split", "grouped", "executor-grouped"):
        return (f"{kernel} is forward only (it merges parts by the log-sum-exp of aten's CPU flash op, "
                "which has no gradient)")
    if kernel == "executor-flash":
        return "executor-flash is forward only (longlab's C++ kernel has no backward)"
    if kernel == "flashinfer":
        return "flashinfer is an inference library (no backward)"
    return None


def unavailable_reason(kernel: str, mask: SliceMask | None = None, device: torch.device | str = "cpu",
                       block: int = 128) -> str | None:
    """Why ``kernel`` cannot run here (None: it can). Cheap: no mask conversion beyond a block test."""
    if kernel not in KERNELS:
        raise LonglabError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    dev = torch.device(device)
    if kernel in ("flash-attn", "flashinfer"):
        module = "flash_attn" if kernel == "flash-attn" else "flashinfer"
        if dev.type != "cuda":
            return f"{kernel} needs a CUDA device (device is {dev.type})"
        if importlib.util.find_spec(module) is None:
            return f"{kernel}: package {module!r} is not installed"
        if mask is not None and _varlen_docs(mask) is None:
            return f"{kernel}: mask {mask.name} is not FULL/CAUSAL/document (the varlen interface's forms)"
    if kernel == "executor-flash":
        from longlab.ops.block_flash import unavailable_reason as flash_unavailable

        reason = flash_unavailable(torch.empty(0, device=dev))
        if reason is not None:
            return f"executor-flash: {reason}"
    if kernel.startswith("executor") and mask is not None:
        try:
            mask.to_block_sparse(block, block)
        except LonglabError as exc:
            return str(exc)
    return None


def prepare(kernel: str, mask: SliceMask, device: torch.device | str = "cpu", block: int = 128,
            gqa: int = 1) -> Prepared:
    """Convert ``mask`` to what ``kernel`` reads (the mask-construction step, timed apart). ``gqa``: query
    heads per KV head (``grouped`` packs them as query rows, so its element masks are built for it)."""
    reason = unavailable_reason(kernel, mask, device, block)
    if reason is not None:
        raise LonglabError(reason)
    if kernel in ("naive", "sdpa-math"):
        payload: Any = mask.to_sdpa_mask(device)
    elif kernel == "sdpa":
        payload = _sdpa_form(mask)
        if payload is None:
            payload = mask.to_sdpa_mask(device)
    elif kernel in ("flex", "flex-eager"):
        payload = mask.to_flex_block_mask(block, block, device)
    elif kernel == "gather":
        payload = _gather_plan(mask.to_block_layout(block, block), device)
    elif kernel == "grouped":
        payload = _grouped_plan(mask.to_block_layout(block, block), gqa, device)
    elif kernel.startswith("executor"):
        payload = mask.to_block_sparse(block, block)
    else:
        payload = _varlen_docs(mask)
    return Prepared(kernel, mask, payload, block)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: Prepared,
        scaling: float | None = None) -> torch.Tensor:
    """Execute a prepared kernel. q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D] -> [B, H, T_q, D]."""
    m = prepared.mask
    _check(q, k, v, m)
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    gqa = q.shape[1] != k.shape[1]
    kernel, payload = prepared.kernel, prepared.payload
    if kernel == "naive":
        return _naive(q, k, v, payload, scaling)
    if kernel == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return _rows_zeroed(F.scaled_dot_product_attention(q, k, v, attn_mask=payload, scale=scaling,
                                                               enable_gqa=gqa), payload)
    if kernel == "sdpa":
        if payload == "full":
            return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
        if payload == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return _rows_zeroed(F.scaled_dot_product_attention(q, k, v, attn_mask=payload, scale=scaling,
                                                           enable_gqa=gqa), payload)
    if kernel in ("flex", "flex-eager"):
        from torch.nn.attention.flex_attention import flex_attention

        fn = compiled_flex() if kernel == "flex" else flex_attention
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return fn(q, k, v, block_mask=payload, scale=scaling, enable_gqa=gqa)
    if kernel == "gather":
        return _gather(q, k, v, payload, scaling)
    if kernel == "grouped":
        if payload.g != q.shape[1] // k.shape[1]:
            raise LonglabError(f"grouped: prepared with gqa={payload.g}, inputs have H/H_kv = "
                               f"{q.shape[1] // k.shape[1]} (pass gqa= to prepare)")
        return _grouped(q, k, v, payload, scaling)
    if kernel == "executor-split":
        B, H = q.shape[:2]
        return split_block_sparse_attention(q, k, v, payload.with_mask(payload.mask.expand(B, H, -1, -1)),
                                            scaling)
    if kernel.startswith("executor"):
        B, H = q.shape[:2]
        bs = payload.with_mask(payload.mask.expand(B, H, -1, -1))
        return block_sparse_attention(q, k, v, bs, scaling, backend=kernel.split("-", 1)[1])
    return _varlen_cuda(kernel, q, k, v, payload, scaling)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SliceMask, kernel: str = "sdpa",
              scaling: float | None = None, block: int = 128) -> torch.Tensor:
    """One call: prepare ``mask`` for ``kernel`` and run it. q: [B, H, T_q, D], k, v: [B, H_kv, T_k, D]."""
    return run(q, k, v, prepare(kernel, mask, q.device, block, q.shape[1] // k.shape[1]), scaling)


# ---- helpers ----------------------------------------------------------------------------------------------
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: SliceMask) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise LonglabError("q, k, v must be 4-d: q [B, H, T_q, D], k/v [B, H_kv, T_k, D]")
    if k.shape != v.shape[:3] + k.shape[3:] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise LonglabError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise LonglabError(f"H={q.shape[1]} must be a multiple of H_kv={k.shape[1]}")
    if (q.shape[2], k.shape[2]) != (m.q_len, m.k_len):
        raise LonglabError(f"mask is {m.q_len}x{m.k_len}, inputs are T_q={q.shape[2]}, T_k={k.shape[2]}")


def _sdpa_form(mask: SliceMask) -> str | None:
    if len(mask) != 1 or mask.q_ranges[0].tolist() != [0, mask.q_len] or \
            mask.k_ranges[0].tolist() != [0, mask.k_len]:
        return None
    t = int(mask.types[0])
    if t == 0:
        return "full"
    if t == 1 and mask.q_len == mask.k_len:
        return "causal"
    return None


def _rows_zeroed(out: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    # rows that see no key: SDPA gives NaN or a uniform average; the definition here is zero
    empty = ~dense.any(-1)
    if bool(empty.any()):
        out = out.masked_fill(empty[:, None], 0.0)
    return out


def _naive(q, k, v, dense, scaling):
    # q: [B, H, T_q, D], k/v: [B, H_kv, T_k, D], dense: [T_q, T_k] bool -> [B, H, T_q, D]
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    logits = torch.matmul(q, kr.transpose(-1, -2)).float() * scaling  # [B, H, T_q, T_k]
    logits = logits.masked_fill(~dense, float("-inf"))
    probs = torch.softmax(logits, -1)
    probs = torch.where(dense.any(-1, keepdim=True), probs, torch.zeros((), dtype=probs.dtype))
    return torch.matmul(probs.to(v.dtype), vr)


@dataclass(frozen=True)
class _Tile:
    r0: int
    r1: int
    cols: tuple[int, int] | torch.Tensor  # every selected key: a contiguous range, or key indices [n]
    elem: torch.Tensor | None  # [rows, n] bool over ``cols``, None = every selected key visible
    full_cols: tuple[int, int] | torch.Tensor | None  # keys of the full blocks (range or indices), or None
    part_cols: torch.Tensor | None  # keys of the partial blocks [n_p], or None
    part_elem: torch.Tensor | None  # [rows, n_p] bool


def _cols(js: torch.Tensor, bk: int, k_len: int, device) -> tuple[Any, torch.Tensor]:
    """Key columns of blocks ``js``: a (start, end) range when contiguous, else indices. -> (cols, indices)"""
    if int(js[-1] - js[0]) + 1 == js.numel():
        c0, c1 = int(js[0]) * bk, min((int(js[-1]) + 1) * bk, k_len)
        return (c0, c1), torch.arange(c0, c1)
    idx = (js[:, None] * bk + torch.arange(bk)).flatten()
    idx = idx[idx < k_len]
    return idx.to(device), idx


def _gather_plan(lay: BlockLayout, device) -> list[_Tile]:
    """Per query tile: which keys to gather and the element mask (only where a partial block needs it)."""
    tiles: list[_Tile] = []
    bk = lay.bk
    sel = lay.selected
    for i in range(sel.shape[0]):
        r0, r1 = i * lay.bq, min((i + 1) * lay.bq, lay.q_len)
        js = sel[i].nonzero().flatten()
        if js.numel() == 0:
            continue
        rows = torch.arange(r0, r1)
        cols, idx = _cols(js, bk, lay.k_len, device)
        elem = lay.element_mask(rows, idx).to(device) if bool(lay.partial[i].any()) else None
        jf, jp = lay.full[i].nonzero().flatten(), lay.partial[i].nonzero().flatten()
        full_cols = _cols(jf, bk, lay.k_len, device)[0] if jf.numel() else None
        part_cols = part_elem = None
        if jp.numel():
            _, pidx = _cols(jp, bk, lay.k_len, device)
            part_cols = pidx.to(device)
            part_elem = lay.element_mask(rows, pidx).to(device)
        tiles.append(_Tile(r0, r1, cols, elem, full_cols, part_cols, part_elem))
    return tiles


def _take(x: torch.Tensor, cols) -> torch.Tensor:
    return x[:, :, cols[0]: cols[1]] if isinstance(cols, tuple) else x.index_select(2, cols)


def _gather(q, k, v, tiles: list[_Tile], scaling: float) -> torch.Tensor:
    # q: [B, H, T_q, D], k/v: [B, H_kv, T_k, D] -> [B, H, T_q, D]
    if q.device.type == "cpu" and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                     or v.requires_grad)):
        return _gather_split(q, k, v, tiles, scaling)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    covered = 0
    for t in tiles:
        if t.r0 > covered:
            outs.append(q.new_zeros(*q.shape[:2], t.r0 - covered, v.shape[-1]))
        o = F.scaled_dot_product_attention(q[:, :, t.r0: t.r1], _take(k, t.cols), _take(v, t.cols),
                                           attn_mask=t.elem, scale=scaling, enable_gqa=gqa)
        if t.elem is not None:
            o = _rows_zeroed(o, t.elem)
        outs.append(o)
        covered = t.r1
    if covered < q.shape[2]:
        outs.append(q.new_zeros(*q.shape[:2], q.shape[2] - covered, v.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _gather_split(q, k, v, tiles: list[_Tile], scaling: float) -> torch.Tensor:
    """Inference path of ``gather``: per tile one mask-free fused call over the full blocks (a view when
    contiguous) and one over the partial blocks with an additive mask, merged by log-sum-exp; GQA packed."""
    B, H, T_q, D = q.shape
    H_kv = k.shape[1]
    g = H // H_kv
    out = q.new_zeros(B, H, T_q, v.shape[-1])
    for t in tiles:
        n = t.r1 - t.r0
        qp = q[:, :, t.r0: t.r1].reshape(B, H_kv, g * n, D)  # [B, H_kv, g * rows, D]
        parts = []
        if t.full_cols is not None:
            o, lse = sdpa_with_lse(qp, _take(k, t.full_cols), _take(v, t.full_cols), scaling)
            parts.append((o, lse))
        if t.part_cols is not None:
            add = torch.zeros(t.part_elem.shape, dtype=q.dtype, device=q.device)
            add.masked_fill_(~t.part_elem, float("-inf"))
            kp, vp = k.index_select(2, t.part_cols), v.index_select(2, t.part_cols)
            o, lse = sdpa_with_lse(qp, kp, vp, scaling, add.repeat(g, 1))
            parts.append((o, lse))
        out[:, :, t.r0: t.r1] = merge_by_lse(parts).reshape(B, H, n, -1)
    return out


def _varlen_docs(mask: SliceMask) -> tuple[list[int], bool] | None:
    """``(cu_seqlens, causal)`` when the mask is FULL/CAUSAL or documents (all full or all causal)."""
    if mask.q_len != mask.k_len or len(mask) == 0:
        return None
    q, kr, t = mask.q_ranges, mask.k_ranges, mask.types
    order = torch.argsort(q[:, 0])
    q, kr, t = q[order], kr[order], t[order]
    if not torch.equal(q, kr) or int(q[0, 0]) != 0 or int(q[-1, 1]) != mask.q_len:
        return None
    if not torch.equal(q[1:, 0], q[:-1, 1]) or not bool((t == t[0]).all()) or int(t[0]) not in (0, 1):
        return None
    return [0, *q[:, 1].tolist()], int(t[0]) == 1


def _varlen_cuda(kernel: str, q, k, v, payload, scaling):  # pragma: no cover - needs a GPU machine
    cu, causal = payload
    B, H, T, D = q.shape
    if B != 1:
        raise LonglabError(f"{kernel}: B must be 1 for the varlen path, got {B}")
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # [T, H, D]
    max_len = max(b - a for a, b in zip(cu, cu[1:]))
    if kernel == "flash-attn":
        from flash_attn import flash_attn_varlen_func

        o = flash_attn_varlen_func(qt, kt, vt, cu_t, cu_t, max_len, max_len, softmax_scale=scaling,
                                   causal=causal)
    else:
        import flashinfer

        o = flashinfer.single_prefill_with_kv_cache(qt, kt, vt, causal=causal, sm_scale=scaling) \
            if len(cu) == 2 else _flashinfer_ragged(flashinfer, qt, kt, vt, cu_t, causal, scaling)
    return o.transpose(0, 1)[None]


def _flashinfer_ragged(flashinfer, qt, kt, vt, cu_t, causal, scaling):  # pragma: no cover - GPU only
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=qt.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(cu_t, cu_t, qt.shape[1], kt.shape[1], qt.shape[2], causal=causal, sm_scale=scaling)
    return w.run(qt, kt, vt)


@dataclass(frozen=True)
class _Group:
    qb: torch.Tensor  # [G] q-block indices
    cols: torch.Tensor  # [G, n] key indices (clamped to T_k - 1)
    add: torch.Tensor | None  # [G, 1, g * bq, n] additive mask (0 / -inf), None = every key visible
    empty: torch.Tensor | None  # [G, bq] rows that see no key of this group


@dataclass(frozen=True)
class _GroupedPlan:
    full: list[_Group]
    part: list[_Group]
    bq: int
    g: int


_GROUP_ELEMS = 32 * 2**20  # gathered key rows x D per grouped call (bounds the copies)


def _grouped_plan(lay: BlockLayout, g: int, device) -> _GroupedPlan:
    """Group the q-blocks of a head-shared layout by how many full / partial k-blocks they select: each
    group becomes one batched fused-SDPA call (mask-free for full blocks, an additive element mask for
    partial ones). A clipped last k-block (``T_k % bk``) always goes with the partial blocks."""
    bq, bk, T_q, T_k = lay.bq, lay.bk, lay.q_len, lay.k_len
    full, part = lay.full.clone(), lay.partial.clone()
    if T_k % bk:
        part[:, -1] |= full[:, -1]
        full[:, -1] = False
    offs = torch.arange(bk)

    def groups(sel: torch.Tensor, masked: bool) -> list[_Group]:
        out = []
        cnt = sel.sum(-1)  # [n_qb]
        order = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True)
        for c in cnt.unique().tolist():
            if c == 0:
                continue
            qb = (cnt == c).nonzero().flatten()
            cols = (order[qb, :c, None] * bk + offs).flatten(1)  # [G, c * bk]
            add = empty = None
            if masked:
                rows = (qb[:, None] * bq + torch.arange(bq)).clamp(max=T_q - 1)  # [G, bq]
                vis = torch.stack([lay.element_mask(r, k) for r, k in zip(rows, cols)])  # [G, bq, n]
                vis &= (cols < T_k)[:, None, :]
                empty = ~vis.any(-1)
                add = torch.zeros(vis.shape).masked_fill_(~vis, float("-inf"))
                add = add.repeat(1, g, 1)[:, None].to(device)  # rows packed as (head in group, row)
                empty = empty.to(device) if bool(empty.any()) else None
            out.append(_Group(qb.to(device), cols.clamp(max=T_k - 1).to(device), add, empty))
        return out

    return _GroupedPlan(groups(full, False), groups(part, True), bq, g)


def _gather_rows(xt: torch.Tensor, idx: torch.Tensor, ws: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``xt[:, idx]`` into a reused workspace. xt: [B, T, H_kv, D], idx: [n] -> [B, n, H_kv, D]"""
    n = idx.numel() * xt.shape[0] * xt.shape[2] * xt.shape[3]
    if name not in ws or ws[name].numel() < n:
        ws[name] = xt.new_empty(n)
    out = ws[name][:n].view(xt.shape[0], idx.numel(), *xt.shape[2:])
    return torch.index_select(xt, 1, idx, out=out)


def _grouped(q, k, v, plan: _GroupedPlan, scaling: float) -> torch.Tensor:
    """Run a grouped plan: per group one fused call, batch ``B x G``, GQA packed as ``g x bq`` query rows,
    K/V gathered once per group; the full and partial parts merge by log-sum-exp.
    q: [B, H, T_q, D], k/v: [B, H_kv, T_k, D] -> [B, H, T_q, Dv]"""
    B, H, T_q, D = q.shape
    H_kv, Dv, bq, g = k.shape[1], v.shape[-1], plan.bq, plan.g
    n_qb = -(-T_q // bq)
    q6 = F.pad(q, (0, 0, 0, n_qb * bq - T_q)).view(B, H_kv, g, n_qb, bq, D)
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, T_k, H_kv, D]: rows gather
    ws: dict[str, torch.Tensor] = {}  # gather workspaces reused by every group (fresh buffers page-fault)
    parts = []
    for groups in (plan.full, plan.part):
        if not groups:
            continue
        o6 = q.new_zeros(B, H_kv, g, n_qb, bq, Dv)
        l6 = torch.full((B, H_kv, g, n_qb, bq), float("-inf"), device=q.device)
        for grp in groups:
            n = grp.cols.shape[1]
            step = max(1, _GROUP_ELEMS // (n * (D + Dv) * H_kv * B))
            for s in range(0, grp.qb.numel(), step):
                qb, cols = grp.qb[s: s + step], grp.cols[s: s + step]
                G = qb.numel()
                qs = q6[:, :, :, qb].permute(0, 3, 1, 2, 4, 5).reshape(B * G, H_kv, g * bq, D)
                flat = cols.flatten()
                ks = _gather_rows(kt, flat, ws, "k").view(B * G, n, H_kv, D).transpose(1, 2)  # strided view
                vs = _gather_rows(vt, flat, ws, "v").view(B * G, n, H_kv, Dv).transpose(1, 2)
                add = None if grp.add is None else grp.add[s: s + step].to(q.dtype).repeat(B, 1, 1, 1)
                if q.device.type == "cpu":
                    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        qs, ks, vs, 0.0, False, attn_mask=add, scale=scaling)
                else:
                    s_ = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scaling
                    s_ = s_ if add is None else s_ + add.float()
                    lse = torch.logsumexp(s_, -1)
                    o = torch.matmul(torch.softmax(s_, -1).nan_to_num(0.0), vs.float()).to(q.dtype)
                o = o.view(B, G, H_kv, g, bq, Dv).permute(0, 2, 3, 1, 4, 5)
                lse = lse.float().view(B, G, H_kv, g, bq).permute(0, 2, 3, 1, 4)
                if grp.empty is not None:
                    e = grp.empty[s: s + step][None, None, None]  # [1, 1, 1, G, bq]
                    lse = lse.masked_fill(e, float("-inf"))
                    o = o.masked_fill(e[..., None], 0.0)
                o6[:, :, :, qb] = o
                l6[:, :, :, qb] = lse
        parts.append((o6, l6))
    if not parts:
        return q.new_zeros(B, H, T_q, Dv)
    return merge_by_lse(parts).reshape(B, H, n_qb * bq, Dv)[:, :, :T_q]
