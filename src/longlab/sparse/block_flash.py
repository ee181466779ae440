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

The extension is compiled once per machine with ``torch.utils.cpp_extension`` (about 40 s; g++ and
ninja needed) into ``cache_dir() / "torch_extensions"``. Without a compiler, with ``LONGLAB_BLOCK_FLASH=0``
or on another device / dtype / with autograd, :func:`available` is False and the executor's ``auto``
backend uses ``grouped`` instead.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from longlab.paths import cache_dir
from longlab.sparse.blockmask import BlockSparseMask

__all__ = ["available", "unavailable_reason", "block_flash_attention", "KV_TILE"]

KV_TILE = 512  # keys per online-softmax step (4 blocks of 128; 256 measured equal at 8k)
_SOURCE = Path(__file__).with_name("block_flash.cpp")
_STALE_LOCK_S = 900  # a build takes about a minute; a lock this old belongs to a killed build
_EXT: Any = None
_REASON: str | None = None  # why the kernel cannot be used in this process (None: not tried or fine)


def _flags() -> list[str]:
    cap = torch.backends.cpu.get_cpu_capability()  # what ATen's own kernels run here: AVX512, AVX2, ...
    if cap == "AVX512":
        return ["-O3", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw",
                "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
    if cap == "AVX2":
        return ["-O3", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return ["-O3"]


def _load() -> Any:
    """The compiled extension, building it on first use; None (with :data:`_REASON`) when it cannot."""
    global _EXT, _REASON
    if _EXT is not None or _REASON is not None:
        return _EXT
    if os.environ.get("LONGLAB_BLOCK_FLASH", "1") == "0":
        _REASON = "disabled by LONGLAB_BLOCK_FLASH=0"
        return None
    try:
        from torch.utils.cpp_extension import load

        cap = torch.backends.cpu.get_cpu_capability()
        build = cache_dir() / "torch_extensions" / f"block_flash-{torch.__version__}-{cap}"
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # torch's build baton; one left by a build killed midway would block forever
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            print(f"longlab: building the CPU block-sparse kernel once into {build} (about a minute)",
                  file=sys.stderr, flush=True)
        _EXT = load(f"longlab_block_flash_{cap.lower()}", [str(_SOURCE)], extra_cflags=_flags(),
                    build_directory=str(build), verbose=False)
    except Exception as exc:  # no compiler / ninja / BLAS symbol: the executor falls back to grouped
        _REASON = f"could not build longlab/sparse/block_flash.cpp ({type(exc).__name__}: {exc})"
        warnings.warn(f"{_REASON}; backend='auto' uses 'grouped'", RuntimeWarning, stacklevel=3)
    return _EXT


def unavailable_reason(q: torch.Tensor | None = None) -> str | None:
    """Why :func:`block_flash_attention` cannot run on ``q`` here (None when it can)."""
    if q is not None:
        if q.device.type != "cpu":
            return f"CPU only (q is on {q.device.type})"
        if q.dtype != torch.float32:
            return f"float32 only (q is {q.dtype})"
    _load()
    return _REASON


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
        out = _EXT.block_flash_forward(padded(q, n_qb * bq), padded(k, n_kb * bk), padded(v, n_kb * bk),
                                       indptr, indices, bq, bk, T_k - T_q, T_k, float(scaling), int(kv_tile))
    return out[:, :, :T_q]
