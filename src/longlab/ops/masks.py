"""Attention masks as (q_range, k_range, type) slices, and converters to every kernel's mask format.

LongCA-bench (Bu et al., "LongCA-bench: a unified benchmark for long-context attention", arXiv 2510.17896,
ICLR 2026) encodes every mask as a list of slices in the MagiAttention format: a slice covers the
rectangle ``q in [q_start, q_end)`` x ``k in [k_start, k_end)`` with one of four shapes. In slice-local
coordinates ``a = q - q_start``, ``b = k - k_start``, ``L_q = q_end - q_start``, ``L_k = k_end - k_start``:

* ``full``:       every pair of the rectangle;
* ``causal``:     ``b <= a + (L_k - L_q)`` (lower triangle aligned at the bottom-right corner);
* ``inv-causal``: ``b >= a`` (upper triangle aligned at the top-left corner);
* ``bi-causal``:  both (a band: row ``a`` sees ``b in [a, a + L_k - L_q]``).

So every slice gives each of its query rows one contiguous key interval, and a mask is a union of
per-row intervals; slices of one mask must not overlap (the generators here never overlap them, and
:meth:`SliceMask.area` counts each slice's pairs once). Converters:

* :meth:`SliceMask.to_sdpa_mask` -> ``[T_q, T_k]`` bool (True = attend), for SDPA / naive attention;
* :meth:`SliceMask.to_block_layout` -> :class:`BlockLayout`: per ``bq x bk`` block "full" / "partial" /
  empty, plus per-row interval tables for the partial blocks (what flex and longlab's gather kernel run);
* :meth:`SliceMask.to_flex_block_mask` -> ``torch.nn.attention.flex_attention.BlockMask``;
* :meth:`SliceMask.to_block_sparse` -> :class:`longlab.sparse.blockmask.BlockSparseMask` (the layout of
  longlab's sparse-prefill executor: selected blocks intersected with causality, sink and diagonal always
  on). Only masks of that form convert; others raise :class:`LonglabError` saying why.

Mask generators (:data:`MASKS`, :func:`make_mask`) cover the 12 static masks of LongCA-bench plus random
block-sparse masks. Document lengths come from :func:`sample_document_lengths`: parametric stand-ins
(log-normal with a short or long median), not the Pile / ProLong length histograms of the paper.

Vocabulary: ``T_q`` query length, ``T_k`` key length, ``bq, bk`` block sizes, ``n_qb = ceil(T_q / bq)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from longlab.recipe import LonglabError
from longlab.sparse.blockmask import BlockSparseMask, causal_allowed, encode_blocks, required_blocks

__all__ = [
    "TYPES",
    "SliceMask",
    "BlockLayout",
    "MASKS",
    "make_mask",
    "sample_document_lengths",
    "band_slices",
    "mask_from_dense",
]

TYPES = ("full", "causal", "inv-causal", "bi-causal")
_FULL, _CAUSAL, _INV, _BI = range(4)
_MAX_DENSE_ELEMS = 2**31  # the biggest [T_q, T_k] bool mask to_sdpa_mask will build (2 GiB)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockLayout:
    """A mask at block granularity, with what is needed inside the partial blocks.

    full, partial: ``[n_qb, n_kb]`` bool (disjoint): every pair of the block is visible / some are.
    lo, hi: ``[T_q, M]`` int64: row ``q`` sees key ``k`` inside a partial block iff
    ``lo[q, m] <= k < hi[q, m]`` for some ``m`` (intervals touching no partial block are left out;
    ``lo = hi = 0`` pads).
    row_any: ``[T_q]`` bool, the row sees at least one key. counts: ``[n_qb, n_kb]`` visible pairs per block.
    """

    full: torch.Tensor
    partial: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    row_any: torch.Tensor
    counts: torch.Tensor
    bq: int
    bk: int
    q_len: int
    k_len: int

    @property
    def selected(self) -> torch.Tensor:  # [n_qb, n_kb] bool
        return self.full | self.partial

    def element_mask(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Visibility of ``rows [R] x cols [C]`` (int64 positions) from the layout alone. -> [R, C] bool"""
        blk_full = self.full[rows // self.bq][:, cols // self.bk]
        blk_part = self.partial[rows // self.bq][:, cols // self.bk]
        lo, hi = self.lo[rows], self.hi[rows]  # [R, M]
        inside = ((cols[None, :, None] >= lo[:, None, :]) & (cols[None, :, None] < hi[:, None, :])).any(-1)
        return blk_full | (blk_part & inside)


class SliceMask:
    """A mask as non-overlapping ``(q_range, k_range, type)`` slices over ``T_q x T_k``.

    q_ranges, k_ranges: ``[n, 2]`` int64 half-open ranges; types: ``[n]`` int64 indices into :data:`TYPES`.
    """

    def __init__(
        self,
        q_ranges: torch.Tensor | Sequence[Sequence[int]],
        k_ranges: torch.Tensor | Sequence[Sequence[int]],
        types: torch.Tensor | Sequence[str | int],
        q_len: int,
        k_len: int,
        name: str = "custom",
    ) -> None:
        self.q_ranges = torch.as_tensor(q_ranges, dtype=torch.int64).reshape(-1, 2)
        self.k_ranges = torch.as_tensor(k_ranges, dtype=torch.int64).reshape(-1, 2)
        codes = [TYPES.index(t) if isinstance(t, str) and t in TYPES else t for t in types]
        for t in codes:
            if isinstance(t, str):
                raise LonglabError(f"slice type must be one of {TYPES}, got {t!r}")
        self.types = torch.as_tensor(codes, dtype=torch.int64).reshape(-1)
        self.q_len, self.k_len, self.name = int(q_len), int(k_len), name
        self._validate()

    def _validate(self) -> None:
        n = self.q_ranges.shape[0]
        if self.k_ranges.shape[0] != n or self.types.shape[0] != n:
            raise LonglabError(f"q_ranges, k_ranges, types need one row per slice, got {n}, "
                               f"{self.k_ranges.shape[0]}, {self.types.shape[0]}")
        if self.q_len <= 0 or self.k_len <= 0:
            raise LonglabError(f"q_len and k_len must be positive, got {self.q_len}, {self.k_len}")
        if n == 0:
            return
        qs, qe = self.q_ranges.unbind(1)
        ks, ke = self.k_ranges.unbind(1)
        if bool((qs < 0).any() | (qe > self.q_len).any() | (qs >= qe).any()):
            raise LonglabError(f"q_ranges must satisfy 0 <= start < end <= q_len={self.q_len}")
        if bool((ks < 0).any() | (ke > self.k_len).any() | (ks >= ke).any()):
            raise LonglabError(f"k_ranges must satisfy 0 <= start < end <= k_len={self.k_len}")
        if bool(((self.types < 0) | (self.types > 3)).any()):
            raise LonglabError(f"slice type codes must be in 0..3 ({TYPES})")

    def __len__(self) -> int:
        return self.q_ranges.shape[0]

    def __repr__(self) -> str:
        return f"SliceMask({self.name!r}, T_q={self.q_len}, T_k={self.k_len}, slices={len(self)})"

    def slices(self) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
        """The slices as Python tuples ``((q_start, q_end), (k_start, k_end), type)``."""
        return [((int(a), int(b)), (int(c), int(d)), TYPES[int(t)])
                for (a, b), (c, d), t in zip(self.q_ranges, self.k_ranges, self.types)]

    # ---- per-row intervals: the one primitive every converter uses ------------------------------------
    def row_intervals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slice row's visible key interval: ``(row [m], lo [m], hi [m])``, ``k in [lo, hi)``.

        Empty intervals (a causal slice with ``L_k < L_q`` has rows that see nothing) are dropped.
        """
        if len(self) == 0:
            z = torch.zeros(0, dtype=torch.int64)
            return z, z, z
        qs, qe = self.q_ranges.unbind(1)
        ks, ke = self.k_ranges.unbind(1)
        lq = qe - qs
        sl = torch.repeat_interleave(torch.arange(len(self)), lq)  # [m] slice of each row
        starts = torch.cumsum(lq, 0) - lq
        a = torch.arange(int(lq.sum())) - starts[sl]  # [m] slice-local row
        row = qs[sl] + a
        t = self.types[sl]
        c = (ke - ks - lq)[sl]
        lo = torch.where((t == _INV) | (t == _BI), ks[sl] + a, ks[sl])
        hi = torch.where((t == _CAUSAL) | (t == _BI), ks[sl] + a + c + 1, ke[sl])
        lo = lo.clamp(min=ks[sl], max=ke[sl])
        hi = torch.minimum(hi, ke[sl])
        keep = hi > lo
        return row[keep], lo[keep], hi[keep]

    def area(self) -> int:
        """Number of visible (q, k) pairs (slices must not overlap)."""
        _, lo, hi = self.row_intervals()
        return int((hi - lo).sum())

    def density(self) -> float:
        """Visible pairs over ``T_q * T_k``."""
        return self.area() / (self.q_len * self.k_len)

    # ---- converters -----------------------------------------------------------------------------------
    def to_sdpa_mask(self, device: torch.device | str | None = None, rows: int = 2048) -> torch.Tensor:
        """Element mask ``[T_q, T_k]`` bool, True = attend (SDPA's boolean ``attn_mask`` convention).

        Built from the row intervals with a +1/-1 difference array and a cumulative sum, ``rows`` query rows
        at a time. Refuses sizes above 2**31 elements (use the block layout or flex instead)."""
        if self.q_len * self.k_len > _MAX_DENSE_ELEMS:
            raise LonglabError(f"to_sdpa_mask: T_q*T_k={self.q_len * self.k_len} exceeds {_MAX_DENSE_ELEMS} "
                               "elements; use to_block_layout() / to_flex_block_mask() at this length")
        row, lo, hi = self.row_intervals()
        out = torch.zeros(self.q_len, self.k_len, dtype=torch.bool, device=device)
        order = torch.argsort(row, stable=True)
        row, lo, hi = row[order], lo[order], hi[order]
        bounds = torch.searchsorted(row, torch.arange(0, self.q_len + rows, rows))
        for i, r0 in enumerate(range(0, self.q_len, rows)):
            a, b = int(bounds[i]), int(bounds[i + 1])
            if a == b:
                continue
            r1 = min(r0 + rows, self.q_len)
            diff = torch.zeros(r1 - r0, self.k_len + 1, dtype=torch.int32)
            rr = row[a:b] - r0
            diff.index_put_((rr, lo[a:b]), torch.ones(b - a, dtype=torch.int32), accumulate=True)
            diff.index_put_((rr, hi[a:b]), torch.full((b - a,), -1, dtype=torch.int32), accumulate=True)
            out[r0:r1] = (diff.cumsum(1)[:, : self.k_len] > 0).to(out.device)
        return out

    def block_counts(self, bq: int, bk: int) -> torch.Tensor:
        """Visible pairs per ``bq x bk`` block. -> [n_qb, n_kb] int64 (O(number of row intervals))."""
        _check_blocks(bq, bk)
        row, lo, hi = self.row_intervals()
        n_qb, n_kb = _cdiv(self.q_len, bq), _cdiv(self.k_len, bk)
        qb = row // bq
        jl, jh = lo // bk, (hi - 1) // bk
        flat = torch.zeros(n_qb * (n_kb + 1), dtype=torch.int64)
        same = jl == jh
        base = qb * (n_kb + 1)
        # an interval inside one block
        flat.index_add_(0, (base + jl)[same], (hi - lo)[same])
        d = ~same
        # first and last (partial) blocks of longer intervals, +bk on the blocks between (difference array)
        flat.index_add_(0, (base + jl)[d], ((jl + 1) * bk - lo)[d])
        flat.index_add_(0, (base + jh)[d], (hi - jh * bk)[d])
        inner = torch.zeros_like(flat)
        inner.index_add_(0, (base + jl + 1)[d], torch.full_like(jl[d], bk))
        inner.index_add_(0, (base + jh)[d], torch.full_like(jl[d], -bk))
        inner = inner.view(n_qb, n_kb + 1).cumsum(1)
        return (flat.view(n_qb, n_kb + 1) + inner)[:, :n_kb]

    def block_area(self, bq: int, bk: int) -> torch.Tensor:
        """Pairs in each block (edge blocks are smaller). -> [n_qb, n_kb] int64"""
        rq = (torch.clamp(torch.arange(1, _cdiv(self.q_len, bq) + 1) * bq, max=self.q_len)
              - torch.arange(_cdiv(self.q_len, bq)) * bq)
        rk = (torch.clamp(torch.arange(1, _cdiv(self.k_len, bk) + 1) * bk, max=self.k_len)
              - torch.arange(_cdiv(self.k_len, bk)) * bk)
        return rq[:, None] * rk[None, :]

    def to_block_layout(self, bq: int = 128, bk: int = 128) -> BlockLayout:
        """Full / partial blocks and the interval tables of the partial blocks' rows (see BlockLayout)."""
        counts = self.block_counts(bq, bk)
        full = counts == self.block_area(bq, bk)
        partial = (counts > 0) & ~full
        row, lo, hi = _merge_adjacent(*self.row_intervals())
        # keep the intervals that touch a partial block of their row
        pcum = torch.cat([torch.zeros(partial.shape[0], 1, dtype=torch.int64), partial.long().cumsum(1)], 1)
        qb = row // bq
        touches = pcum[qb, (hi - 1) // bk + 1] - pcum[qb, lo // bk] > 0
        row, lo, hi = row[touches], lo[touches], hi[touches]
        per_row = torch.bincount(row, minlength=self.q_len)
        M = int(per_row.max()) if row.numel() else 0
        lo_t = torch.zeros(self.q_len, M, dtype=torch.int64)
        hi_t = torch.zeros(self.q_len, M, dtype=torch.int64)
        if M:
            order = torch.argsort(row, stable=True)
            row, lo, hi = row[order], lo[order], hi[order]
            first = torch.cumsum(per_row, 0) - per_row
            slot = torch.arange(row.numel()) - first[row]
            lo_t[row, slot], hi_t[row, slot] = lo, hi
        all_rows = self.row_intervals()[0]
        row_any = torch.zeros(self.q_len, dtype=torch.bool)
        row_any[all_rows] = True
        return BlockLayout(full, partial, lo_t, hi_t, row_any, counts, bq, bk, self.q_len, self.k_len)

    def to_flex_block_mask(self, bq: int = 128, bk: int = 128, device: torch.device | str | None = None,
                           layout: BlockLayout | None = None):  # -> flex_attention.BlockMask
        """A flex ``BlockMask``: full blocks skip the ``mask_mod``; partial blocks use the interval table.

        ``mask_mod(b, h, q, k) = full[q // bq, k // bk] OR_m lo[q, m] <= k < hi[q, m]`` over the ``M``
        intervals kept per row (unrolled; ``M`` is 1 or 2 for the structured masks)."""
        from torch.nn.attention.flex_attention import BlockMask

        lay = layout if layout is not None else self.to_block_layout(bq, bk)
        num, idx = encode_blocks(lay.partial)
        fnum, fidx = encode_blocks(lay.full)
        lo_t, hi_t = lay.lo.to(device), lay.hi.to(device)
        full_t = lay.full.to(device)
        bq_, bk_ = lay.bq, lay.bk
        M = lo_t.shape[1]

        def mask_mod(b, h, q_idx, kv_idx):
            # full blocks are in the table too, so the mask_mod alone is the whole mask (eager flex and
            # create_mask evaluate it everywhere; the compiled kernel only inside partial blocks)
            ok = full_t[q_idx // bq_, kv_idx // bk_]
            for m in range(M):
                ok = ok | ((lo_t[q_idx, m] <= kv_idx) & (kv_idx < hi_t[q_idx, m]))
            return ok

        return BlockMask.from_kv_blocks(
            num[None, None].to(device), idx[None, None].to(device), fnum[None, None].to(device),
            fidx[None, None].to(device), BLOCK_SIZE=(lay.bq, lay.bk), mask_mod=mask_mod,
            seq_lengths=(self.q_len, self.k_len),
        )

    def to_block_sparse(self, bq: int = 128, bk: int = 128, B: int = 1, H: int = 1) -> BlockSparseMask:
        """longlab's sparse-prefill layout: the mask must equal (selected blocks) AND causal, with the sink
        column and the diagonal blocks selected (the executor always adds them). Else LonglabError."""
        q_off = self.k_len - self.q_len
        if q_off < 0:
            raise LonglabError("to_block_sparse: the executor's layout needs T_q <= T_k (queries last)")
        row, lo, hi = self.row_intervals()
        if bool((hi > row + q_off + 1).any()):
            raise LonglabError(f"to_block_sparse: mask {self.name!r} has pairs above the causal diagonal; "
                               "longlab's block-sparse executor is causal only")
        counts = self.block_counts(bq, bk)
        causal = SliceMask([[0, self.q_len]], [[0, self.k_len]], ["causal"], self.q_len, self.k_len)
        ccounts = causal.block_counts(bq, bk)
        sel = counts > 0
        if bool((sel & (counts != ccounts)).any()):
            raise LonglabError(f"to_block_sparse: mask {self.name!r} cuts through blocks of {bq}x{bk} (a "
                               "block holds some but not all of its causal pairs); use to_block_layout()")
        req = required_blocks(self.q_len, self.k_len, bq, bk) & causal_allowed(self.q_len, self.k_len, bq, bk)
        if bool((req & ~sel).any()):
            raise LonglabError(f"to_block_sparse: mask {self.name!r} leaves out a sink or diagonal block, "
                               "which the executor always computes")
        return BlockSparseMask(sel.expand(B, H, -1, -1).clone(), bq, bk, self.q_len, self.k_len)


def _check_blocks(bq: int, bk: int) -> None:
    if not (isinstance(bq, int) and isinstance(bk, int)) or bq <= 0 or bk <= 0:
        raise LonglabError(f"block sizes bq, bk must be positive integers, got {bq!r}, {bk!r}")


def _merge_adjacent(row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Merge intervals of one row that touch (``hi == next lo``). -> (row, lo, hi)"""
    if row.numel() == 0:
        return row, lo, hi
    key = row * (int(hi.max()) + 1) + lo
    order = torch.argsort(key)
    row, lo, hi = row[order], lo[order], hi[order]
    start = torch.ones_like(row, dtype=torch.bool)
    start[1:] = (row[1:] != row[:-1]) | (lo[1:] != hi[:-1])
    gid = torch.cumsum(start.long(), 0) - 1
    n = int(gid[-1]) + 1
    new_hi = torch.zeros(n, dtype=torch.int64).scatter_reduce(0, gid, hi, reduce="amax", include_self=False)
    return row[start], lo[start], new_hi


def mask_from_dense(dense: torch.Tensor, name: str = "dense") -> SliceMask:
    """One ``full`` slice per visible run of each row of a ``[T_q, T_k]`` bool mask (small masks, tests)."""
    d = dense.to(torch.int8)
    T_q, T_k = d.shape
    pad = torch.nn.functional.pad(d, (1, 1))
    edge = pad[:, 1:] - pad[:, :-1]  # [T_q, T_k + 1]: +1 at a run's start, -1 after its end
    r_s, c_s = (edge == 1).nonzero(as_tuple=True)
    _, c_e = (edge == -1).nonzero(as_tuple=True)
    q = torch.stack([r_s, r_s + 1], 1)
    k = torch.stack([c_s, c_e], 1)
    return SliceMask(q, k, torch.zeros(len(r_s), dtype=torch.int64), T_q, T_k, name)


# ---- generators -----------------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.q: list[tuple[int, int]] = []
        self.k: list[tuple[int, int]] = []
        self.t: list[int] = []

    def add(self, q0: int, q1: int, k0: int, k1: int, kind: str) -> None:
        if q1 > q0 and k1 > k0:
            self.q.append((q0, q1))
            self.k.append((k0, k1))
            self.t.append(TYPES.index(kind))

    def build(self, T_q: int, T_k: int, name: str) -> SliceMask:
        return SliceMask(self.q, self.k, self.t, T_q, T_k, name)


def band_slices(b: _Builder, q0: int, q1: int, k0: int, k1: int, left: int, right: int) -> None:
    """Add slices for the band ``k - k0 in [(q - q0) - left, (q - q0) + right]`` clipped to ``[k0, k1)``,
    for rows ``q in [q0, q1)`` (query and key offsets aligned: row ``q0`` sits at key ``k0``)."""
    n_k = k1 - k0
    # rows (local) whose lower edge is clipped: a < left; whose upper edge is clipped: a + right + 1 > n_k
    cuts = sorted({0, q1 - q0, min(max(left, 0), q1 - q0), min(max(n_k - right, 0), q1 - q0)})
    for r0, r1 in zip(cuts, cuts[1:]):
        if r1 <= r0:
            continue
        lo_clip, hi_clip = r0 < left, r0 + right + 1 > n_k
        if lo_clip and hi_clip:
            b.add(q0 + r0, q0 + r1, k0, k1, "full")
        elif lo_clip:  # rows see [k0, k0 + a + right + 1): causal, bottom-right aligned
            b.add(q0 + r0, q0 + r1, k0, k0 + r1 + right, "causal")
        elif hi_clip:  # rows see [k0 + a - left, k1): inv-causal, top-left aligned
            b.add(q0 + r0, q0 + r1, k0 + r0 - left, k1, "inv-causal")
        else:
            b.add(q0 + r0, q0 + r1, k0 + r0 - left, k0 + r1 + right, "bi-causal")


_DOC_MEDIANS = {"short": 1024.0, "long": 8192.0}


def sample_document_lengths(total: int, distribution: str | Sequence[int] = "short", seed: int = 0,
                            min_len: int = 32) -> list[int]:
    """Document lengths summing to ``total``: drawn until the sequence is full, the last one cut to fit.

    ``distribution``: ``"short"`` (log-normal, median 1024, sigma 1: a stand-in for Pile-like corpora),
    ``"long"`` (median 8192: a stand-in for ProLong-64K-like data), ``"uniform"`` (uniform in
    ``[min_len, total // 2]``), or a list of lengths to cycle through."""
    if total <= 0:
        raise LonglabError(f"total must be positive, got {total}")
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    i = 0
    while sum(out) < total:
        if not isinstance(distribution, str):
            if not distribution or min(distribution) <= 0:
                raise LonglabError("distribution as a list must hold positive lengths")
            n = int(distribution[i % len(distribution)])
        elif distribution in _DOC_MEDIANS:
            z = float(torch.randn(1, generator=g))
            n = int(_DOC_MEDIANS[distribution] * math.exp(z))
        elif distribution == "uniform":
            n = int(torch.randint(min_len, max(min_len + 1, total // 2), (1,), generator=g))
        else:
            raise LonglabError(f"distribution must be 'short', 'long', 'uniform' or a list of lengths, "
                               f"got {distribution!r}")
        out.append(max(min_len, n))
        i += 1
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return list(zip(starts, starts[1:]))


def _full(T: int) -> SliceMask:
    return SliceMask([[0, T]], [[0, T]], ["full"], T, T, "FULL")


def _causal(T: int) -> SliceMask:
    return SliceMask([[0, T]], [[0, T]], ["causal"], T, T, "CAUSAL")


def _document(T: int, causal: bool, lengths: Sequence[int] | None = None, distribution="short",
              seed: int = 0) -> SliceMask:
    lengths = lengths or sample_document_lengths(T, distribution, seed)
    _check_total(lengths, T)
    b = _Builder()
    for s, e in _bounds(lengths):
        b.add(s, e, s, e, "causal" if causal else "full")
    return b.build(T, T, "CAUSAL_DOCUMENT" if causal else "FULL_DOCUMENT")


def _check_total(lengths: Sequence[int], T: int) -> None:
    if sum(lengths) != T or min(lengths) <= 0:
        raise LonglabError(f"document lengths must be positive and sum to T={T}, got sum {sum(lengths)}")


def _window(T: int) -> int:
    return max(1, min(1024, T // 4))


def _sliding_window(T: int, window: int | None = None, causal: bool = False) -> SliceMask:
    """Query ``q`` sees ``k`` with ``q - window < k < q + window`` (``k <= q`` when causal)."""
    w = window or _window(T)
    if w <= 0:
        raise LonglabError(f"window must be positive, got {w}")
    b = _Builder()
    band_slices(b, 0, T, 0, T, w - 1, 0 if causal else w - 1)
    return b.build(T, T, "SLIDING_WINDOW_CAUSAL" if causal else "SLIDING_WINDOW")


def _share_question(T: int, question: int | None = None, answers: Sequence[int] | None = None,
                    seed: int = 0) -> SliceMask:
    """A causal question of ``question`` tokens, then answers: each sees the question and itself (causal)."""
    q_len = question or max(1, T // 4)
    answers = answers or sample_document_lengths(T - q_len, "uniform", seed, min_len=max(1, T // 32))
    _check_total([q_len, *answers], T)
    b = _Builder()
    b.add(0, q_len, 0, q_len, "causal")
    for s, e in _bounds(answers):
        b.add(q_len + s, q_len + e, 0, q_len, "full")
        b.add(q_len + s, q_len + e, q_len + s, q_len + e, "causal")
    return b.build(T, T, "SHARE_QUESTION")


def _causal_blockwise(T: int, block: int | None = None) -> SliceMask:
    """Blocks of ``block`` tokens, each causal within itself; the last block sees every earlier token."""
    blk = block or max(1, min(2048, T // 4))
    bounds = [(s, min(s + blk, T)) for s in range(0, T, blk)]
    b = _Builder()
    for s, e in bounds[:-1]:
        b.add(s, e, s, e, "causal")
    s, e = bounds[-1]
    b.add(s, e, 0, s, "full")
    b.add(s, e, s, e, "causal")
    return b.build(T, T, "CAUSAL_BLOCKWISE")


def _prefix_lm_causal(T: int, prefix: int | None = None) -> SliceMask:
    """The first ``prefix`` tokens see each other fully; the rest see the prefix and earlier tokens."""
    p = prefix if prefix is not None else T // 2
    if not 0 < p <= T:
        raise LonglabError(f"prefix must be in [1, T={T}], got {p}")
    b = _Builder()
    b.add(0, T, 0, p, "full")
    b.add(p, T, p, T, "causal")
    return b.build(T, T, "PREFIX_LM_CAUSAL")


def _prefix_lm_document(T: int, lengths: Sequence[int] | None = None, prefix_frac: float = 0.5,
                        distribution="short", seed: int = 0) -> SliceMask:
    """Documents; inside each, a prefix-LM mask with a prefix of ``prefix_frac`` of its length."""
    lengths = lengths or sample_document_lengths(T, distribution, seed)
    _check_total(lengths, T)
    b = _Builder()
    for s, e in _bounds(lengths):
        p = max(1, int((e - s) * prefix_frac))
        b.add(s, e, s, s + p, "full")
        b.add(s + p, e, s + p, e, "causal")
    return b.build(T, T, "PREFIX_LM_DOCUMENT")


def _global_sliding_window(T: int, n_global: int | None = None, window: int | None = None) -> SliceMask:
    """``n_global`` leading tokens see and are seen by every token; the others see a symmetric window."""
    g = n_global if n_global is not None else max(1, min(128, T // 16))
    w = window or _window(T)
    b = _Builder()
    b.add(0, g, 0, T, "full")
    b.add(g, T, 0, g, "full")
    band_slices(b, g, T, g, T, w - 1, w - 1)
    return b.build(T, T, "GLOBAL_SLIDING_WINDOW")


def _block_causal_document(T: int, lengths: Sequence[int] | None = None, block: int = 256,
                           distribution="short", seed: int = 0) -> SliceMask:
    """Documents; inside each, chunks of ``block`` tokens see their own and earlier chunks fully."""
    lengths = lengths or sample_document_lengths(T, distribution, seed)
    _check_total(lengths, T)
    b = _Builder()
    for s, e in _bounds(lengths):
        for c in range(s, e, block):
            b.add(c, min(c + block, e), s, min(c + block, e), "full")
    return b.build(T, T, "BLOCK_CAUSAL_DOCUMENT")


def _random_block(T: int, sparsity: float = 0.5, block: int = 128, seed: int = 0) -> SliceMask:
    """Causal block-sparse: each causally allowed ``block x block`` tile off the sink column and the diagonal
    is dropped with probability ``sparsity``; diagonal tiles are causal inside (sparse-prefill layout)."""
    if not 0.0 <= sparsity < 1.0:
        raise LonglabError(f"sparsity must be in [0, 1), got {sparsity}")
    n = _cdiv(T, block)
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, n, generator=g) >= sparsity
    keep[:, 0] = True
    keep = torch.tril(keep, diagonal=-1)
    b = _Builder()
    for i in range(n):
        q0, q1 = i * block, min((i + 1) * block, T)
        row = keep[i].tolist()
        j = 0
        while j < i:  # runs of kept tiles left of the diagonal -> one full slice each
            if row[j]:
                j1 = j
                while j1 < i and row[j1]:
                    j1 += 1
                b.add(q0, q1, j * block, j1 * block, "full")
                j = j1
            else:
                j += 1
        b.add(q0, q1, q0, q1, "causal")
    return b.build(T, T, f"RANDOM_BLOCK_{sparsity:g}")


MASKS: dict[str, Callable[..., SliceMask]] = {
    "FULL": _full,
    "CAUSAL": _causal,
    "FULL_DOCUMENT": lambda T, **kw: _document(T, False, **kw),
    "CAUSAL_DOCUMENT": lambda T, **kw: _document(T, True, **kw),
    "SLIDING_WINDOW": lambda T, **kw: _sliding_window(T, causal=False, **kw),
    "SLIDING_WINDOW_CAUSAL": lambda T, **kw: _sliding_window(T, causal=True, **kw),
    "SHARE_QUESTION": _share_question,
    "CAUSAL_BLOCKWISE": _causal_blockwise,
    "PREFIX_LM_CAUSAL": _prefix_lm_causal,
    "PREFIX_LM_DOCUMENT": _prefix_lm_document,
    "GLOBAL_SLIDING_WINDOW": _global_sliding_window,
    "BLOCK_CAUSAL_DOCUMENT": _block_causal_document,
    "RANDOM_BLOCK_0.2": lambda T, **kw: _random_block(T, 0.2, **kw),
    "RANDOM_BLOCK_0.5": lambda T, **kw: _random_block(T, 0.5, **kw),
    "RANDOM_BLOCK_0.8": lambda T, **kw: _random_block(T, 0.8, **kw),
}


def make_mask(name: str, T: int, **kwargs) -> SliceMask:
    """The mask ``name`` (a key of :data:`MASKS`) over ``T`` query and key tokens; ``kwargs`` go to its
    generator (``window``, ``lengths``, ``distribution``, ``seed``, ``block``, ``prefix``, ...)."""
    if name not in MASKS:
        raise LonglabError(f"mask must be one of {', '.join(MASKS)}; got {name!r}")
    if not isinstance(T, int) or T <= 0:
        raise LonglabError(f"T must be a positive integer, got {T!r}")
    try:
        mask = MASKS[name](T, **kwargs)
    except TypeError as exc:
        raise LonglabError(f"make_mask({name!r}): {exc}") from None
    return mask
