"""longlab's block-sparse flash kernel for CPU (``block_flash.cpp``), built on first use.

Causal attention restricted to the selected blocks of a :class:`BlockSparseMask`, forward only, float32:
one work unit per (batch, head, q-block) keeps its ``bq`` query rows together for the whole pass, reads
its k-blocks in place from K and V (block ``j`` is rows ``j bk .. j bk + bk - 1``: no gather; adjacent
blocks go to one GEMM), and folds the causal / padding element mask of the blocks crossing the diagonal
into the same online softmax (Dao et al. 2022, FlashAttention, Alg. 1):

    S = scale Q K_t^T,  m' = max(m, rowmax S),  P = exp(S - m'),  l' = l e^(m - m') + rowsum P,
    O' = O e^(m - m') + P V_t,  output O / l  after the last key tile.

Why a kernel of its own: aten's fused CPU kernel tiles the queries of a call by 32 rows below 192 rows,
so the 128-row units of a per-head block mask cost it 1.10-1.52x a dense pair, and the diagonal squares
2.4x (``docs/results/attention-bench.md``). The GEMMs are the BLAS ``sgemm`` torch links (MKL on x86);
the exponentials ATen's vectorised ``exp_u20``. Units run in parallel over torch's intra-op threads.

The extension is compiled once per machine through :mod:`longlab.ops.build` (about 40 s; g++ and ninja
needed; a killed build, a stale lock or a truncated library are handled there). Without a compiler, with
``LONGLAB_BLOCK_FLASH=0`` or on another device / dtype / with autograd, :func:`available` is False and the
executor's ``auto`` backend uses ``grouped`` instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from longlab.ops import build
from longlab.sparse.blockmask import BlockSparseMask

__all__ = ["available", "unavailable_reason", "block_flash_attention", "KV_TILE", "KERNEL"]

KV_TILE = 512  # keys per online-softmax step (4 blocks of 128; 256 measured equal at 8k)
KERNEL = build.Kernel("block_flash", (Path(__file__).with_name("block_flash.cpp"),), "LONGLAB_BLOCK_FLASH",
                      ("block_flash_forward",), tuple(build.cpu_flags()))


def unavailable_reason(q: torch.Tensor | None = None) -> str | None:
    """Why :func:`block_flash_attention` cannot run on ``q`` here (None when it can)."""
    if q is not None:
        if q.device.type != "cpu":
            return f"CPU only (q is on {q.device.type})"
        if q.dtype != torch.float32:
            return f"float32 only (q is {q.dtype})"
    return build.reason(KERNEL)


def available(q: torch.Tensor | None = None) -> bool:
    """Whether the kernel can run on ``q`` (CPU, float32) on this machine; builds it on first call."""
    return unavailable_reason(q) is None


def block_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSparseMask,
                          scaling: float, kv_tile: int = KV_TILE) -> torch.Tensor:
    """Exact causal attention over the blocks of ``mask`` (required blocks already added by the caller).

    q: [B, H, T_q, D], k: [B, H_kv, T_k, D], v: [B, H_kv, T_k, Dv] (float32, CPU; queries are the last T_q
    positions), mask: [B or 1, H, n_qb, n_kb] -> [B, H, T_q, Dv]. Forward only (no autograd)."""
    reason = unavailable_reason(q)
    if reason is not None:
        raise RuntimeError(f"block_flash_attention: {reason}")
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    bq, bk, n_qb, n_kb = mask.bq, mask.bk, mask.n_qb, mask.n_kb

    def padded(x: torch.Tensor, rows: int) -> torch.Tensor:  # [.., T, D] -> [.., rows, D], contiguous
        return (F.pad(x, (0, 0, 0, rows - x.shape[2])) if rows > x.shape[2] else x).contiguous()

    sel = mask.mask.expand(B, H, n_qb, n_kb).reshape(B * H * n_qb, n_kb)  # one row per unit
    indptr = torch.zeros(sel.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(sel.sum(-1), 0, out=indptr[1:])
    indices = sel.nonzero()[:, 1].contiguous()  # row-major: ascending k-blocks within each unit
    with torch.no_grad():
        ext = build.load(KERNEL)
        out = ext.block_flash_forward(padded(q, n_qb * bq), padded(k, n_kb * bk), padded(v, n_kb * bk),
                                      indptr, indices, bq, bk, T_k - T_q, T_k, float(scaling), int(kv_tile))
    return out[:, :, :T_q]
