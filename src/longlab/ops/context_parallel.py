"""Context-parallel attention over ``torch.distributed``: Ulysses, Ring-P2P, Ring-AllGather and USP.

The four mechanisms LongCA-bench (Bu et al., arXiv 2510.17896, ICLR 2026) compares, forward and backward,
for any :class:`longlab.ops.masks.SliceMask` (the paper's distributed runs use FULL, CAUSAL and DOCUMENT):

* **Ulysses** (Jacobs et al., DeepSpeed-Ulysses, arXiv 2309.14509): an all-to-all turns the sequence shard
  of every head into all tokens of ``H / N`` heads; attention runs locally; a second all-to-all turns it back.
* **Ring-P2P** (Liu et al., Ring Attention, arXiv 2310.01889): K/V shards travel round a ring of ``N``
  ranks by send/recv, the next shard's transfer overlapping the current block; partial outputs merge by
  their log-sum-exp (online softmax). Backward sends K/V round again with the dK/dV accumulators, which
  come home after ``N`` hops.
* **Ring-AllGather** (as in Llama 3's context parallelism): one all-gather of K/V, local attention over all
  keys; backward reduce-scatters dK/dV to their owners.
* **USP** (Fang & Zhao, arXiv 2405.07719): Ulysses inside groups of ``u`` ranks (split heads first), Ring-P2P
  across the ``N / u`` groups.

Shapes: the full sequence is ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``; rank ``r`` holds the tokens
``layout.positions(r)`` (``t = T / N`` of them). :class:`Layout` with ``balanced=True`` is the head/tail
rearrangement of TransformerEngine: ``2N`` chunks, rank ``r`` holds chunks ``r`` and ``2N - 1 - r``, so every
rank has the same causal work.

Per block, with the final row log-sum-exp ``L``: ``P = exp(S - L)`` (``S = Q K^T * scaling``, masked),
``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K * scaling``, ``dK = dS^T Q * scaling``
(FlashAttention-2's backward), all in fp32; GQA sums ``dK, dV`` over the query heads of a KV head.

Heads: Ulysses needs ``u | H`` and either ``u | H_kv`` or ``H_kv | u`` (then KV heads are replicated, and
their gradients summed back). Otherwise :class:`LonglabError`, or with ``head_fallback="pad"``: KV heads
expanded to ``H`` and all heads zero-padded to a multiple of ``u`` (extra compute and traffic, counted).

Communication is counted per rank in :class:`CommStats` (bytes this rank sends: a point-to-point send is its
tensor, an all-to-all ``(n-1)/n`` of its input, an all-gather ``(n-1)`` times its shard, a reduce-scatter
``(n-1)/n`` of its input); :func:`theoretical_bytes` gives the paper's volume formulas.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from longlab.attention import MAX_SCORE_BYTES, lse_merge
from longlab.ops.masks import SliceMask
from longlab.recipe import LonglabError

__all__ = [
    "STRATEGIES",
    "Layout",
    "CommStats",
    "MaskTable",
    "Mesh",
    "context_parallel_attention",
    "theoretical_bytes",
    "spawn",
]

STRATEGIES = ("ulysses", "ring-p2p", "ring-allgather", "usp")


@dataclass(frozen=True)
class Layout:
    """Which global token positions each rank holds. ``balanced``: head/tail chunks (TransformerEngine)."""

    T: int
    world: int
    balanced: bool = True

    def __post_init__(self) -> None:
        parts = 2 * self.world if self.balanced else self.world
        if self.world < 1 or self.T % parts:
            raise LonglabError(f"T={self.T} must be a multiple of {parts} ({'2 x ' if self.balanced else ''}"
                               f"world size {self.world}) for this layout")

    def positions(self, rank: int) -> torch.Tensor:  # [T / world] int64
        if not self.balanced:
            t = self.T // self.world
            return torch.arange(rank * t, (rank + 1) * t)
        c = self.T // (2 * self.world)
        tail = 2 * self.world - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
        return x.index_select(dim, self.positions(rank).to(x.device)).contiguous()


@dataclass
class CommStats:
    """Bytes this rank sent, by operation (``"fwd/ring-p2p"``, ...), and the number of calls."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, n: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + int(n)
        self.calls[key] = self.calls.get(key, 0) + 1

    def total(self, prefix: str = "") -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith(prefix))


class MaskTable:
    """A slice mask evaluated at any positions: row ``p`` sees ``k`` iff ``lo[p, m] <= k < hi[p, m]``."""

    def __init__(self, mask: SliceMask) -> None:
        lay = mask.to_block_layout(mask.q_len, mask.k_len)  # one block: every interval is "partial"
        if bool(lay.full.all()):  # FULL: one full block, no intervals kept
            self.lo = torch.zeros(mask.q_len, 1, dtype=torch.int64)
            self.hi = torch.full((mask.q_len, 1), mask.k_len, dtype=torch.int64)
        else:
            self.lo, self.hi = lay.lo, lay.hi
        self.T = mask.q_len

    def block(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Visibility of ``qpos [tq] x kpos [tk]``. -> [tq, tk] bool"""
        lo, hi = self.lo[qpos][:, None, :], self.hi[qpos][:, None, :]  # [tq, 1, M]
        k = kpos[None, :, None]
        return ((k >= lo) & (k < hi)).any(-1)

    def any(self, qpos: torch.Tensor, kpos: torch.Tensor) -> bool:
        """Whether any pair of ``qpos x kpos`` is visible (O(tq * M * log tk), no tq x tk mask)."""
        ks = kpos.sort().values
        lo, hi = self.lo[qpos], self.hi[qpos]  # [tq, M]
        # keys in [lo, hi): count = #(ks < hi) - #(ks < lo)
        n = torch.searchsorted(ks, hi) - torch.searchsorted(ks, lo)
        return bool((n > 0).any())

    def rows_fn(self, qpos: torch.Tensor, kpos: torch.Tensor, device) -> Callable[[slice], torch.Tensor]:
        """``rows -> [len(rows), tk]`` bool visibility of ``qpos[rows] x kpos``, built per row chunk."""
        return lambda rows: self.block(qpos[rows], kpos).to(device)


@dataclass(frozen=True)
class Mesh:
    """USP's 2-D mesh: ``rank = ring_index * u + ulysses_index``; Ulysses groups are consecutive ranks."""

    world: int
    u: int
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]
    ulysses_group: Any
    ring_group: Any

    @staticmethod
    def build(u: int, world: int | None = None) -> Mesh:
        """Create the process groups (every rank must call this, in the same order)."""
        world = dist.get_world_size() if world is None else world
        if u < 1 or world % u:
            raise LonglabError(f"ulysses_size must divide the world size {world}, got {u}")
        rank = dist.get_rank()
        r = world // u
        my_u, my_r = None, None
        u_ranks = r_ranks = ()
        for i in range(r):  # every rank creates every group, same order
            ranks = tuple(i * u + j for j in range(u))
            grp = dist.new_group(list(ranks)) if u > 1 else None
            if rank in ranks:
                my_u, u_ranks = grp, ranks
        for j in range(u):
            ranks = tuple(i * u + j for i in range(r))
            grp = dist.new_group(list(ranks)) if r > 1 else None
            if rank in ranks:
                my_r, r_ranks = grp, ranks
        return Mesh(world, u, u_ranks, r_ranks, my_u, my_r)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ---- one block of attention with its log-sum-exp, and its backward -------------------------------------
def _expand(x: torch.Tensor, g: int) -> torch.Tensor:
    return x if g == 1 else x.repeat_interleave(g, 1)




def _row_chunks(q: torch.Tensor, tk: int) -> list[slice]:
    B, H, tq, _ = q.shape
    step = max(1, min(tq, MAX_SCORE_BYTES // max(1, B * H * tk * 4)))
    return [slice(i, min(i + step, tq)) for i in range(0, tq, step)]


def _block_forward(q, k, v, mrows, scaling):
    # q: [B, H, tq, D] fp32, k/v: [B, H_kv, tk, D] fp32, mrows(rows) -> [rows, tk] bool visibility
    # -> o [B, H, tq, D] (softmax-normalised over this block's keys), lse [B, H, tq] (-inf: no key)
    g = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, g), _expand(v, g)
    outs, lses = [], []
    for rows in _row_chunks(q, k.shape[2]):
        m = mrows(rows)
        if not bool(m.any()):  # nothing visible in this chunk (causal / document blocks): skip the math
            n = rows.stop - rows.start
            outs.append(q.new_zeros(q.shape[0], q.shape[1], n, v.shape[-1]))
            lses.append(torch.full((q.shape[0], q.shape[1], n), float("-inf"), device=q.device))
            continue
        if q.device.type == "cpu":  # aten's fused CPU flash kernel, which also returns the log-sum-exp
            o, lse = _fused_block(q[:, :, rows], k, v, m, scaling)
            outs.append(o)
            lses.append(lse)
            continue
        s = torch.matmul(q[:, :, rows], ke.transpose(-1, -2)) * scaling
        s = s.masked_fill(~m, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.matmul(p, ve))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _fused_block(q, k, v, m, scaling):
    # q: [B, H, r, D] fp32, k/v: [B, H_kv, tk, D], m: [r, tk] bool -> o [B, H, r, D], lse [B, H, r]
    # GQA packed: the g query heads of a KV head are g x r rows of one call (mask tiled g times)
    B, H, r, D = q.shape
    H_kv = k.shape[1]
    g = H // H_kv
    add = None
    if not bool(m.all()):
        add = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, float("-inf"))
        add = add.repeat(g, 1)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(B, H_kv, g * r, D), k.contiguous(), v.contiguous(), 0.0, False, attn_mask=add,
        scale=scaling)
    lse = lse.float().reshape(B, H, r)
    # the kernel reports lse = 0 (output 0) for a row whose keys are all masked: make it -inf for the merge
    lse = lse.masked_fill(~m.any(-1), float("-inf"))
    o = torch.where(torch.isinf(lse)[..., None], 0.0, o.reshape(B, H, r, -1))
    return o, lse


def _block_backward(q, k, v, mrows, scaling, lse, do, delta):
    # q, do: [B, H, tq, D]; k, v: [B, H_kv, tk, D]; lse, delta: [B, H, tq] (all fp32) -> dq, dk, dv
    B, H, tq, D = q.shape
    H_kv, tk = k.shape[1], k.shape[2]
    g = H // H_kv
    ke, ve = _expand(k, g), _expand(v, g)
    dq = torch.empty_like(q)
    dk = torch.zeros(B, H, tk, D, device=q.device)
    dv = torch.zeros(B, H, tk, v.shape[-1], device=q.device)
    for rows in _row_chunks(q, tk):
        m = mrows(rows)
        if not bool(m.any()):
            dq[:, :, rows] = 0.0
            continue
        qr, dor = q[:, :, rows], do[:, :, rows]
        s = torch.matmul(qr, ke.transpose(-1, -2)) * scaling
        lr = lse[:, :, rows]
        p = torch.exp(s - torch.where(torch.isinf(lr), 0.0, lr)[..., None]).masked_fill(~m, 0.0)
        dv += torch.matmul(p.transpose(-1, -2), dor)  # [B, H, tk, D]
        dp = torch.matmul(dor, ve.transpose(-1, -2))
        ds = p * (dp - delta[:, :, rows, None])
        dq[:, :, rows] = torch.matmul(ds, ke) * scaling
        dk += torch.matmul(ds.transpose(-1, -2), qr) * scaling
    if g > 1:
        dk = dk.view(B, H_kv, g, tk, D).sum(2)
        dv = dv.view(B, H_kv, g, tk, v.shape[-1]).sum(2)
    return dq, dk, dv


# ---- ring attention (P2P) as an autograd Function -----------------------------------------------------
def _ring_exchange(tensors: list[torch.Tensor], ranks: tuple[int, ...], idx: int, group, stats, key):
    """Send ``tensors`` to the next rank of the ring, receive the previous rank's. -> (recv buffers, works)"""
    n = len(ranks)
    nxt, prv = ranks[(idx + 1) % n], ranks[(idx - 1) % n]
    tensors = [t.contiguous() for t in tensors]
    recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = []
    for t, r in zip(tensors, recv):
        ops.append(dist.P2POp(dist.isend, t, nxt, group))
        ops.append(dist.P2POp(dist.irecv, r, prv, group))
        if stats is not None:
            stats.add(key, _nbytes(t))
    works = dist.batch_isend_irecv(ops)
    return recv, works


class _RingP2P(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, qpos, kpos_all, ranks, idx, group, scaling, stats):
        # q: [B, H, t, D], k/v: [B, H_kv, t, D] local; kpos_all: [n, t] positions held by each ring member
        n = len(ranks)
        qf = q.float()
        o = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        cur = [k, v]
        for s in range(n):
            works = []
            if s < n - 1:
                nxt, works = _ring_exchange(cur, ranks, idx, group, stats, "fwd/ring-p2p")
            src = (idx - s) % n
            if table.any(qpos, kpos_all[src]):
                mrows = table.rows_fn(qpos, kpos_all[src], q.device)
                o2, lse2 = _block_forward(qf, cur[0].float(), cur[1].float(), mrows, scaling)
                o, lse = lse_merge(o, lse, o2, lse2)
            for w in works:
                w.wait()
            if s < n - 1:
                cur = nxt
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (table, qpos, kpos_all, ranks, idx, group, scaling, stats)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        table, qpos, kpos_all, ranks, idx, group, scaling, stats = ctx.args
        n = len(ranks)
        qf, dof = q.float(), do.float()
        delta = (dof * o).sum(-1)  # [B, H, t]
        dq = torch.zeros_like(qf)
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        cur = [k, v]
        for s in range(n):
            works = []
            if s < n - 1:
                nxt, works = _ring_exchange(cur, ranks, idx, group, stats, "bwd/ring-p2p-kv")
            src = (idx - s) % n
            if table.any(qpos, kpos_all[src]):
                mrows = table.rows_fn(qpos, kpos_all[src], q.device)
                a, b, c = _block_backward(qf, cur[0].float(), cur[1].float(), mrows, scaling, lse, dof, delta)
                dq += a
                dk_acc += b
                dv_acc += c
            for w in works:
                w.wait()
            if n > 1:  # the accumulators travel with their K/V block; after step n - 1 they reach the owner
                (dk_acc, dv_acc), w2 = _ring_exchange([dk_acc, dv_acc], ranks, idx, group, stats,
                                                      "bwd/ring-p2p-dkv")
                for w in w2:
                    w.wait()
            if s < n - 1:
                cur = nxt
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), *([None] * 8)


class _RingAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, qpos, kpos_all, ranks, idx, group, scaling, stats):
        n = len(ranks)
        kg, vg = _all_gather_seq(k, n, group, stats, "fwd/allgather"), _all_gather_seq(v, n, group, stats,
                                                                                      "fwd/allgather")
        kpos = kpos_all.flatten()
        mrows = table.rows_fn(qpos, kpos, q.device)
        o, lse = _block_forward(q.float(), kg.float(), vg.float(), mrows, scaling)
        ctx.save_for_backward(q, kg, vg, o, lse)
        ctx.args = (table, qpos, kpos, n, group, scaling, stats)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, kg, vg, o, lse = ctx.saved_tensors
        table, qpos, kpos, n, group, scaling, stats = ctx.args
        dof = do.float()
        delta = (dof * o).sum(-1)
        mrows = table.rows_fn(qpos, kpos, q.device)
        dq, dk, dv = _block_backward(q.float(), kg.float(), vg.float(), mrows, scaling, lse, dof, delta)
        dk = _reduce_scatter_seq(dk, n, group, stats, "bwd/reduce-scatter")
        dv = _reduce_scatter_seq(dv, n, group, stats, "bwd/reduce-scatter")
        return dq.to(q.dtype), dk.to(kg.dtype), dv.to(vg.dtype), *([None] * 8)


def _gather_fn():  # torch 2.13 renamed all_gather_into_tensor to all_gather_single
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_seq(x, n, group, stats, key):
    # x: [B, h, t, D] -> [B, h, n * t, D] (members' shards in group order)
    if n == 1:
        return x
    # members' shards stacked on dim 0
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_fn()(out, x.contiguous(), group=group)
    if stats is not None:
        stats.add(key, (n - 1) * _nbytes(x))
    B, h, t, D = x.shape
    return out.view(n, B, h, t, D).permute(1, 2, 0, 3, 4).reshape(B, h, n * t, D)


def _reduce_scatter_seq(x, n, group, stats, key):
    # x: [B, h, n * t, D] -> this member's [B, h, t, D], summed over members
    if n == 1:
        return x
    B, h, nt, D = x.shape
    inp = x.reshape(B, h, n, nt // n, D).permute(2, 0, 1, 3, 4).reshape(n * B, h, nt // n, D).contiguous()
    out = torch.empty((B, h, nt // n, D), dtype=x.dtype, device=x.device)
    _reduce_scatter_fn()(out, inp, group=group)
    if stats is not None:
        stats.add(key, (n - 1) * _nbytes(out))
    return out


# ---- Ulysses all-to-all as autograd Functions -------------------------------------------------------
def _a2a(x: torch.Tensor, group, stats, key) -> torch.Tensor:
    # x: [n, ...] contiguous; chunk i goes to member i; returns [n, ...], chunk i from member i
    n = x.shape[0]
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.add(key, (n - 1) * _nbytes(x) // n)
    return out


def _seq_to_heads(x, n, group, stats, key):
    # [B, h, t, D] -> [B, h / n, n * t, D]
    B, h, t, D = x.shape
    y = _a2a(x.reshape(B, n, h // n, t, D).permute(1, 0, 2, 3, 4).contiguous(), group, stats, key)
    return y.permute(1, 2, 0, 3, 4).reshape(B, h // n, n * t, D)


def _heads_to_seq(x, n, group, stats, key):
    # [B, h / n, n * t, D] -> [B, h, t, D]
    B, hn, nt, D = x.shape
    y = _a2a(x.reshape(B, hn, n, nt // n, D).permute(2, 0, 1, 3, 4).contiguous(), group, stats, key)
    return y.permute(1, 0, 2, 3, 4).reshape(B, n * hn, nt // n, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, group, stats, phase):
        ctx.args = (n, group, stats, phase)
        return _seq_to_heads(x, n, group, stats, f"fwd/{phase}")

    @staticmethod
    def backward(ctx, g):
        n, group, stats, phase = ctx.args
        return _heads_to_seq(g.contiguous(), n, group, stats, f"bwd/{phase}"), None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, group, stats, phase):
        ctx.args = (n, group, stats, phase)
        return _heads_to_seq(x, n, group, stats, f"fwd/{phase}")

    @staticmethod
    def backward(ctx, g):
        n, group, stats, phase = ctx.args
        return _seq_to_heads(g.contiguous(), n, group, stats, f"bwd/{phase}"), None, None, None, None


def _ulysses_heads(q, k, v, u: int, head_fallback: str):
    """Make head counts fit ``u`` ranks. -> (q, k, v, H_out) with ``H_out`` the real query heads."""
    H, H_kv = q.shape[1], k.shape[1]
    if H % u == 0 and H_kv % u == 0:
        return q, k, v, H
    if H % u == 0 and u % H_kv == 0:  # replicate each KV head u / H_kv times (grads sum back)
        r = u // H_kv
        return q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), H
    if head_fallback != "pad":
        raise LonglabError(
            f"Ulysses over {u} ranks needs the query heads H={H} to be a multiple of {u} and the KV heads "
            f"H_kv={H_kv} to divide or be divided by {u}; use strategy 'ring-p2p' / 'ring-allgather', a "
            f"ulysses_size that fits, or head_fallback='pad' (KV heads expanded to H, heads zero-padded)")
    g = H // H_kv
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    pad = -H % u
    if pad:
        z = q.new_zeros(q.shape[0], pad, *q.shape[2:])
        q = torch.cat([q, z], 1)
        k = torch.cat([k, k.new_zeros(k.shape[0], pad, *k.shape[2:])], 1)
        v = torch.cat([v, v.new_zeros(v.shape[0], pad, *v.shape[2:])], 1)
    return q, k, v, H


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: SliceMask | MaskTable,
    layout: Layout,
    strategy: str = "usp",
    ulysses_size: int | None = None,
    mesh: Mesh | None = None,
    scaling: float | None = None,
    stats: CommStats | None = None,
    head_fallback: str = "error",
) -> torch.Tensor:
    """This rank's attention output for its tokens. q: [B, H, t, D], k, v: [B, H_kv, t, D] (this rank's
    positions ``layout.positions(rank)``) -> [B, H, t, D]; differentiable (explicit backward).

    ``strategy``: ``"ulysses"`` (``u = N``), ``"ring-p2p"``, ``"ring-allgather"`` (``u = 1``), or ``"usp"``
    (``u = ulysses_size``, default the largest divisor of ``N`` with ``u*u <= N`` that fits the heads)."""
    if strategy not in STRATEGIES:
        raise LonglabError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if head_fallback not in ("error", "pad"):
        raise LonglabError(f"head_fallback must be 'error' or 'pad', got {head_fallback!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if layout.world != world:
        raise LonglabError(f"layout is for {layout.world} ranks, the process group has {world}")
    t = layout.T // world
    if q.shape[2] != t or k.shape[2] != t or v.shape[2] != t:
        raise LonglabError(f"every rank holds T / N = {t} tokens; got q {q.shape[2]}, k {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise LonglabError(f"H={q.shape[1]} must be a multiple of H_kv={k.shape[1]}")
    table = mask if isinstance(mask, MaskTable) else MaskTable(mask)
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    if strategy == "ulysses":
        u = world
    elif strategy.startswith("ring"):
        u = 1
    else:
        u = ulysses_size or _default_u(world, q.shape[1], k.shape[1])
    if mesh is None or mesh.u != u:
        mesh = Mesh.build(u, world) if world > 1 else Mesh(1, 1, (0,), (0,), None, None)
    H = q.shape[1]
    if u > 1:
        q, k, v, H = _ulysses_heads(q, k, v, u, head_fallback)
        q = _SeqToHeads.apply(q, u, mesh.ulysses_group, stats, "ulysses-q")
        k = _SeqToHeads.apply(k, u, mesh.ulysses_group, stats, "ulysses-kv")
        v = _SeqToHeads.apply(v, u, mesh.ulysses_group, stats, "ulysses-kv")
    # positions this rank's (post all-to-all) queries hold, and those of each ring member's keys
    def group_pos(r: int) -> torch.Tensor:
        base = (r // u) * u
        return torch.cat([layout.positions(base + j) for j in range(u)])

    qpos = group_pos(rank)
    ring = mesh.ring_ranks
    kpos_all = torch.stack([group_pos(r) for r in ring])  # [n_ring, u * t]
    idx = ring.index(rank)
    fn = _RingAllGather if strategy == "ring-allgather" else _RingP2P
    o = fn.apply(q, k, v, table, qpos, kpos_all, ring, idx, mesh.ring_group, scaling, stats)
    if u > 1:
        o = _HeadsToSeq.apply(o, u, mesh.ulysses_group, stats, "ulysses-o")
        o = o[:, :H]
    return o


def _default_u(world: int, H: int, H_kv: int) -> int:
    best = 1
    for u in range(1, world + 1):
        if world % u == 0 and u * u <= world and H % u == 0 and (H_kv % u == 0 or u % H_kv == 0):
            best = u
    return best


def theoretical_bytes(strategy: str, T: int, world: int, H: int, H_kv: int, D: int, elem_bytes: int,
                      u: int = 1, backward: bool = False) -> int:
    """LongCA-bench's per-device volume. Ulysses: ``(N-1)/N^2 * T * (H + H_kv) * D * 2`` elements (q, k, v
    in, o out); Ring-P2P / Ring-AllGather: ``(N-1)/N * T * H_kv * D * 2`` (k and v). Backward: Ulysses the
    same again (dO in; dQ, dK, dV out); Ring-P2P adds ``N/N * T * H_kv * D * 2`` for the dK/dV
    accumulators' ``N`` hops (sent in fp32 here); Ring-AllGather ``(N-1)/N * T * H_kv * D * 2`` for the
    reduce-scatter (fp32).
    USP: Ulysses over ``u`` on the local shard plus the ring over ``N/u`` groups on ``H_kv/u`` heads."""
    N = world
    if strategy == "ulysses":
        u, r = N, 1
    elif strategy.startswith("ring"):
        u, r = 1, N
    else:
        r = N // u
    t = T / N
    uly = (u - 1) / u * t * (H + H_kv) * D * 2 * elem_bytes if u > 1 else 0.0
    kv_heads = max(H_kv / u, 1.0) if u > 1 else H_kv
    ring = (r - 1) * (u * t) * kv_heads * D * 2 * elem_bytes
    if not backward:
        return int(round(uly + ring))
    if strategy == "ring-allgather":
        ring_b = (r - 1) * (u * t) * kv_heads * D * 2 * 4
    else:
        ring_b = ring + r * (u * t) * kv_heads * D * 2 * 4 if r > 1 else 0.0
    return int(round(uly + ring_b))


# ---- launching ------------------------------------------------------------------------------------------
def _free_port() -> int:
    check_loopback()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


INIT_TIMEOUT_S = 60.0  # a process group that has not formed by then fails instead of waiting forever


def check_loopback(timeout: float = 5.0) -> None:
    """The process group meets on 127.0.0.1: check that a TCP connection there works (a sandbox without a
    loopback interface would make gloo wait forever) and keep gloo on the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=timeout):
                pass
    except OSError as exc:
        raise LonglabError(
            f"context parallelism needs a loopback network (a TCP connection to 127.0.0.1 failed: "
            f"{exc.strerror or exc}); run without --context-parallel here"
        ) from None


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, int(os.environ.get("LONGLAB_CP_THREADS", "1"))))
    from datetime import timedelta

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=INIT_TIMEOUT_S))
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., dict], world: int, args: tuple = (), backend: str = "gloo",
          start_method: str = "spawn") -> list[dict]:
    """Run ``fn(rank, world, *args) -> dict`` (JSON-serialisable) on ``world`` processes joined in one
    process group; returns each rank's dict. With ``start_method="spawn"`` ``fn`` must be importable (a
    module-level function); ``"fork"`` starts in well under a second instead of re-importing torch in
    every child (each child then runs single-threaded)."""
    import torch.multiprocessing as mp

    if world < 1:
        raise LonglabError(f"world size must be >= 1, got {world}")
    if start_method not in ("spawn", "fork"):
        raise LonglabError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, _free_port(), backend, fn, args, tmp), nprocs=world,
                           join=True, start_method=start_method)
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out
