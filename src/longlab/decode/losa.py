"""LoSA: locality-aware sparse attention for blocks of queries refined step by step over a cached prefix.

Tomar et al. (with Hooper, Keutzer, Gholami), "LoSA: Locality-aware Sparse Attention", arXiv:2604.12056,
ICML 2026 (no code found; reconstruction in ``specs/remaining-seeds.md`` §27). In block-wise diffusion LMs
(here: Jacobi decoding, :mod:`longlab.spec.jacobi`) every query of the current block of ``n`` attends the
cached prefix at every refinement step; per-query top-k pages give a large union of pages loaded. Between
steps few queries change much. Per layer, at step ``s``:

1. ``delta_i = mean((x_i^s - x_i^{s-1})^2)``; the active set ``A`` = the top ``ceil(rho n)`` by ``delta``.
   Here ``x`` is the query ``q_i`` (post-RoPE, a linear map of the normalised layer input at a fixed
   position), so ``delta_i = 0`` exactly when the layer input of ``i`` is unchanged;
2. attention splits into the prefix part and the in-block part, each ``(o, lse)``, merged by
   ``w = sigmoid(lse^P - lse^blk)``, ``o = w o^P + (1 - w) o^blk`` (:func:`merge_parts`);
3. the in-block part is dense (causal) for every query;
4. prefix part: stable queries reuse ``(o^P, lse^P)`` from step ``s - 1``; active queries attend the top
   ``k = budget // page_size`` prefix pages by Quest's bound ``U_p = sum_d max(q_d M_pd, q_d m_pd)`` (per
   query head; the prefix's last, partial page is always read). Only ``union_{i in A} pages(i)`` is loaded;
5. the cached prefix results of the active queries are refreshed. The first step runs every query.

``rho = 1`` is per-query Quest over the block (every query selects its own pages at every step); with
``rho = 1`` and every page in budget it is dense attention. :attr:`LoSA.trace` records, per layer and step,
the union of prefix pages loaded (mean over heads) and the active count, for comparison with Quest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import layer_attention, lse_merge
from ..recipe import Method, register
from ..registry import MAX_BLOCK, MAX_TOKENS, param

__all__ = ["LoSA", "merge_parts", "part_attention", "prefix_pages"]


def merge_parts(
    o_p: torch.Tensor, lse_p: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """``w = sigmoid(lse_p - lse_b)``, ``o = w o_p + (1 - w) o_b``: exact attention over the union of two
    disjoint key sets. o: [..., D], lse: [...]."""
    return lse_merge(o_p, lse_p, o_b, lse_b)[0]


def part_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, t, D], lse [B, H, t]) of q [B, H, t, D] over k, v [B, H_kv, S, D] where ``allowed``
    [B, H or 1, t, S]; a query that sees nothing gets out 0, lse -inf."""
    B, H, t, D = q.shape
    g = H // k.shape[1]
    kk = k.float().repeat_interleave(g, 1)
    logits = (q.float() @ kk.transpose(-1, -2)) * scaling  # [B, H, t, S]
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return p @ v.float().repeat_interleave(g, 1), lse


def prefix_pages(
    keys: torch.Tensor, valid: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest page summaries of the complete prefix pages: keys [B, H_kv, n*P(+tail), D], valid [B, H_kv, .]
    -> (center, radius) [B, H_kv, n, D]; an empty page gets radius 0 and center 0 (never chosen first)."""
    B, H_kv, T, D = keys.shape
    n = T // page_size
    k = keys[:, :, : n * page_size].float().reshape(B, H_kv, n, page_size, D)
    ok = valid[:, :, : n * page_size].reshape(B, H_kv, n, page_size, 1)
    hi = k.masked_fill(~ok, float("-inf")).amax(3)
    lo = k.masked_fill(~ok, float("inf")).amin(3)
    has = ok.any(3)
    hi, lo = torch.where(has, hi, 0.0), torch.where(has, lo, 0.0)
    return (hi + lo) / 2, (hi - lo) / 2


@register("losa")
@dataclass
class LoSA(Method):
    """LoSA (arXiv:2604.12056): active queries (top ``rho`` by input change) read Quest's top
    ``budget // page_size`` prefix pages; stable queries reuse their cached prefix (o, lse); lse merge
    with the dense in-block part. ``rho=1`` is per-query Quest."""

    kind: ClassVar[str] = "decode"
    paper: ClassVar[str] = "arXiv:2604.12056"
    budget: int = param(512, low=1, high=MAX_TOKENS, integer=True)
    page_size: int = param(16, low=1, high=MAX_BLOCK, integer=True)
    rho: float = param(0.25, low=0, high=1, low_open=True)  # share of queries that are active
    _prev: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    trace: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def k_pages(self) -> int:
        return max(1, self.budget // self.page_size)

    def decode_records(self) -> list[dict[str, Any]]:
        return self.trace

    def reset(self) -> None:
        """Forget the cached prefix results (a new block starts)."""
        self._prev = {}

    def attend(self, ctx) -> torch.Tensor:  # q [B, H, n, D] -> [B, H, n, D]
        layer = ctx.layer
        if layer is None or ctx.sliding_window is not None:
            return layer_attention(ctx, None)
        q = ctx.q
        n = q.shape[-2]
        T = ctx.key_index.shape[-1]
        return self.block_attention(
            ctx.layer_idx, q, ctx.k, ctx.v, ctx.key_index, ctx.query_index, ctx.scaling, T - n
        ).to(q.dtype)

    def block_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_index: torch.Tensor,
        query_index: torch.Tensor,
        scaling: float,
        n_prefix: int,
    ) -> torch.Tensor:
        """q [B, H, n, D]; k, v [B, H_kv, T, D] with the block in the last ``T - n_prefix`` slots;
        key_index [B, H_kv, T]; query_index [B, n]. Returns fp32 [B, H, n, D]."""
        B, H, n, D = q.shape
        H_kv = k.shape[1]
        g = H // H_kv
        P = self.page_size
        kpos = key_index[:, :, None, :]  # [B, H_kv, 1, T]
        qpos = query_index[:, None, :, None]  # [B, 1, n, 1]
        # in-block part: dense, causal by position
        blk_vis = ((kpos[..., n_prefix:] >= 0) & (kpos[..., n_prefix:] <= qpos)).repeat_interleave(g, 1)
        o_b, lse_b = part_attention(q, k[:, :, n_prefix:], v[:, :, n_prefix:], blk_vis, scaling)
        # prefix part
        prev = self._prev.get(layer_idx)
        if prev is None or prev["q"].shape != q.shape:
            active = torch.ones(B, n, dtype=torch.bool, device=q.device)
            o_p = torch.zeros(B, H, n, D, device=q.device)
            lse_p = torch.full((B, H, n), float("-inf"), device=q.device)
        else:
            delta = (q.float() - prev["q"].float()).pow(2).mean(dim=(1, 3))  # [B, n]
            n_act = math.ceil(self.rho * n)
            active = torch.zeros(B, n, dtype=torch.bool, device=q.device)
            active.scatter_(1, delta.topk(n_act, dim=-1).indices, True)
            o_p, lse_p = prev["o"].clone(), prev["lse"].clone()
        pre_valid = key_index[:, :, :n_prefix] >= 0  # [B, H_kv, Tp]
        n_full = n_prefix // P
        k_sel = min(self.k_pages, n_full)
        # Quest bound per (query head, query, page)
        center, radius = prefix_pages(k[:, :, :n_prefix], pre_valid, P)  # [B, H_kv, n_full, D]
        qf = q.float()
        c = center.repeat_interleave(g, 1)
        r = radius.repeat_interleave(g, 1)
        u = qf @ c.transpose(-1, -2) + qf.abs() @ r.transpose(-1, -2)  # [B, H, n, n_full]
        has = pre_valid[:, :, : n_full * P].reshape(B, H_kv, n_full, P).any(-1).repeat_interleave(g, 1)
        u = u.masked_fill(~has[:, :, None, :], float("-inf"))
        chosen = torch.zeros(B, H, n, n_full, dtype=torch.bool, device=q.device)
        if k_sel:
            chosen.scatter_(-1, u.topk(k_sel, dim=-1).indices, True)
        chosen &= active[:, None, :, None]
        # slots a query may read: its chosen pages plus the partial last page
        slot_ok = chosen.repeat_interleave(P, dim=-1)  # [B, H, n, n_full*P]
        tail = torch.ones(B, H, n, n_prefix - n_full * P, dtype=torch.bool, device=q.device)
        allowed = torch.cat([slot_ok, tail & active[:, None, :, None]], -1)
        allowed &= pre_valid.repeat_interleave(g, 1)[:, :, None, :]
        o_a, lse_a = part_attention(q, k[:, :, :n_prefix], v[:, :, :n_prefix], allowed, scaling)
        act = active[:, None, :]  # [B, 1, n]
        o_p = torch.where(act[..., None], o_a, o_p)
        lse_p = torch.where(act, lse_a, lse_p)
        self._prev[layer_idx] = {"q": q.detach().clone(), "o": o_p, "lse": lse_p}
        union = chosen.any(2).sum(-1).float()  # [B, H] pages loaded this step (over active queries)
        self.trace.append(
            {
                "layer": layer_idx,
                "pages": float(union.mean()),
                "active": int(active.sum()),
                "queries": B * n,
                "prefix_pages": n_full,
            }
        )
        return merge_parts(o_p, lse_p, o_b, lse_b)
