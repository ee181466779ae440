"""Per-head causal block masks for sparse prefill.

Vocabulary: ``B`` batch, ``H`` query heads, ``T_q`` query length, ``T_k`` key length, ``bq``/``bk`` the
query/key block sizes, ``n_qb = ceil(T_q / bq)``, ``n_kb = ceil(T_k / bk)``.

Queries are the *last* ``T_q`` positions of the ``T_k`` keys: query ``i`` sits at key position
``T_k - T_q + i``. With ``T_q == T_k`` this is ordinary causal prefill; with ``T_q < T_k`` it is one chunk of
a chunked prefill whose earlier keys are cached.

Block coordinates: q-block ``i`` holds query rows ``[i*bq, min((i+1)*bq, T_q))``, i.e. key positions
``[q_first[i], q_last[i]]``; k-block ``j`` holds keys ``[k_first[j], k_last[j]]``. A block is

* *causally allowed* when ``k_first[j] <= q_last[i]`` (some query in it may see some key);
* *fully visible* when ``k_last[j] <= q_first[i]`` (every query sees every key: no element mask needed);
* *diagonal* when the two position ranges intersect (it holds the query's own key for some row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "encode_blocks",
    "BlockSparseMask",
    "BlockGeometry",
    "block_geometry",
    "causal_allowed",
    "diagonal_blocks",
    "fully_visible",
    "required_blocks",
    "enforce_required",
    "density",
    "density_per_head",
    "full_mask",
    "element_mask_rows",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockGeometry:
    """Key positions spanned by each q-block and k-block (all ``int64``)."""

    q_first: torch.Tensor  # [n_qb]
    q_last: torch.Tensor  # [n_qb]
    k_first: torch.Tensor  # [n_kb]
    k_last: torch.Tensor  # [n_kb]


def block_geometry(
    q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> BlockGeometry:
    """Positions (in key coordinates) of the first/last query of each q-block and key of each k-block."""
    if not 0 < q_len <= k_len:
        raise ValueError(f"need 0 < q_len <= k_len, got q_len={q_len}, k_len={k_len}")
    offset = k_len - q_len
    qs = torch.arange(_cdiv(q_len, bq), device=device) * bq
    ks = torch.arange(_cdiv(k_len, bk), device=device) * bk
    return BlockGeometry(
        q_first=qs + offset,
        q_last=torch.clamp(qs + bq, max=q_len) - 1 + offset,
        k_first=ks,
        k_last=torch.clamp(ks + bk, max=k_len) - 1,
    )


def causal_allowed(
    q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Blocks where at least one (query, key) pair is causally visible. -> [n_qb, n_kb] bool"""
    g = block_geometry(q_len, k_len, bq, bk, device)
    return g.k_first[None, :] <= g.q_last[:, None]


def fully_visible(
    q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Blocks where every query sees every key (no element-level causal mask). -> [n_qb, n_kb] bool"""
    g = block_geometry(q_len, k_len, bq, bk, device)
    return g.k_last[None, :] <= g.q_first[:, None]


def diagonal_blocks(
    q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """k-blocks whose key range intersects the q-block's own positions. -> [n_qb, n_kb] bool"""
    g = block_geometry(q_len, k_len, bq, bk, device)
    return (g.k_first[None, :] <= g.q_last[:, None]) & (g.k_last[None, :] >= g.q_first[:, None])


def required_blocks(
    q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The blocks every mask carries: the sink column (k-block 0) and the diagonal. -> [n_qb, n_kb] bool"""
    req = diagonal_blocks(q_len, k_len, bq, bk, device)
    req[:, 0] = True
    return req


@dataclass
class BlockSparseMask:
    """A per-head causal block mask.

    Attributes
    ----------
    mask : bool tensor ``[B, H, n_qb, n_kb]``; ``mask[b, h, i, j]``: q-block ``i`` attends to k-block ``j``.
    bq, bk : query / key block sizes.
    q_len, k_len : ``T_q`` and ``T_k``; queries are the last ``T_q`` of the ``T_k`` key positions.
    """

    mask: torch.Tensor  # [B, H, n_qb, n_kb] bool
    bq: int
    bk: int
    q_len: int
    k_len: int

    def __post_init__(self) -> None:
        if self.bq <= 0 or self.bk <= 0:
            raise ValueError(f"block sizes must be positive, got bq={self.bq}, bk={self.bk}")
        if not 0 < self.q_len <= self.k_len:
            raise ValueError(f"need 0 < q_len <= k_len, got q_len={self.q_len}, k_len={self.k_len}")
        if self.mask.dtype != torch.bool or self.mask.dim() != 4:
            raise ValueError(f"mask must be a 4-d bool tensor [B, H, n_qb, n_kb], got {self.mask.dtype} "
                             f"{tuple(self.mask.shape)}")
        want = (_cdiv(self.q_len, self.bq), _cdiv(self.k_len, self.bk))
        if tuple(self.mask.shape[-2:]) != want:
            raise ValueError(f"mask blocks {tuple(self.mask.shape[-2:])} do not match "
                             f"(ceil(q_len/bq), ceil(k_len/bk)) = {want}")

    @property
    def n_qb(self) -> int:
        return self.mask.shape[-2]

    @property
    def n_kb(self) -> int:
        return self.mask.shape[-1]

    @property
    def q_offset(self) -> int:
        """Key position of query row 0 (``T_k - T_q``)."""
        return self.k_len - self.q_len

    def geometry(self) -> BlockGeometry:
        return block_geometry(self.q_len, self.k_len, self.bq, self.bk, self.mask.device)

    def with_mask(self, mask: torch.Tensor) -> BlockSparseMask:
        return BlockSparseMask(mask, self.bq, self.bk, self.q_len, self.k_len)

    def to_element_mask(self) -> torch.Tensor:
        """Element-level mask including causality. Materialises ``[B, H, T_q, T_k]``: small inputs only."""
        return element_mask_rows(self, torch.arange(self.q_len, device=self.mask.device))


def full_mask(
    B: int, H: int, q_len: int, k_len: int, bq: int, bk: int, device: torch.device | str | None = None
) -> BlockSparseMask:
    """Every causally allowed block selected (exact dense causal attention)."""
    allowed = causal_allowed(q_len, k_len, bq, bk, device)
    return BlockSparseMask(allowed.expand(B, H, -1, -1).clone(), bq, bk, q_len, k_len)


def enforce_required(mask: BlockSparseMask) -> BlockSparseMask:
    """Add the sink column and the diagonal blocks, and clear blocks entirely above the causal diagonal.

    This is the single place that guarantees every query row has at least its own key and the sink, so
    no row of the softmax is empty, whatever a selector returned.
    """
    args = (mask.q_len, mask.k_len, mask.bq, mask.bk, mask.mask.device)
    out = (mask.mask | required_blocks(*args)) & causal_allowed(*args)
    return mask.with_mask(out)


def density_per_head(mask: BlockSparseMask) -> torch.Tensor:
    """Fraction of causally allowed blocks that are computed, per head (mean over batch). -> [H] float"""
    allowed = causal_allowed(mask.q_len, mask.k_len, mask.bq, mask.bk, mask.mask.device)
    kept = (mask.mask & allowed).sum(dim=(-1, -2)).float()  # [B, H]
    return (kept / allowed.sum().float()).mean(0)


def density(mask: BlockSparseMask) -> float:
    """Fraction of causally allowed blocks that are computed, over all batches and heads."""
    return float(density_per_head(mask).mean())


def element_mask_rows(mask: BlockSparseMask, rows: torch.Tensor) -> torch.Tensor:
    """Element-level mask (block selection and causality) for some query rows. -> [B, H, R, T_k] bool

    rows: [R] int64 query-row indices in ``[0, T_q)``.
    """
    rows = rows.to(mask.mask.device)
    blk = mask.mask[:, :, rows // mask.bq, :]  # [B, H, R, n_kb]
    elem = blk.repeat_interleave(mask.bk, dim=-1)[..., : mask.k_len]  # [B, H, R, T_k]
    pos = rows + mask.q_offset  # [R]
    causal = torch.arange(mask.k_len, device=rows.device)[None, :] <= pos[:, None]  # [R, T_k]
    return elem & causal


def encode_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block selection ``sel [..., n_qb, n_kb]`` (bool) as the tables flex attention and the block-sparse
    kernels read: ``num [..., n_qb]`` (int32, blocks per query block) and ``idx [..., n_qb, n_kb]`` (int32,
    the selected blocks first, in ascending order, then the others)."""
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()
