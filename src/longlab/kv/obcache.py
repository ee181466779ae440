"""OBCache: output-aware eviction scores plugged into the H2O, TOVA and SnapKV pipelines.

OBCache (Optimal Brain Cache), arXiv:2510.07651 (code: DreamSoul-AI/OBCache, read via its renamed copy
MalachiAjayi/kv-cache-pruner). Eviction is layer-wise structured pruning: a token's saliency is the
squared change of the attention outputs of the observation queries ``i`` when its value, its key, or
both are pruned (Optimal Brain Damage: first-order output change, squared). Per query head and token
``j``, with ``A`` the attention, ``z = q.k * scaling`` the logits and ``o_i = sum_j A_ij v_j``
(masked / future positions have ``A = z = 0``):

- value  (``v_j -> 0``, exact):  ``S^V_j = sum_i A_ij^2 ||v_j||^2``  (``p=1``: ``sum_i A_ij ||v_j||_1``)
- key    (``k_j -> 0``):          ``S^K_j = sum_i (A_ij z_ij)^2 ||v_j - o_i||^2``
- joint  (both):                  ``S^VK_j = S^V_j + S^K_j + S^x_j``,
  ``S^x_j = sum_i 2 A_ij^2 z_ij (||v_j||^2 - v_j.o_i)`` (``cross=false`` drops ``S^x``)

GQA: the scores of the query heads sharing a KV head are summed (their total squared error).

Registered names ``{h2o,tova,snapkv}-obc{v,k,vk}``: the pipeline of the baseline (its observation
queries, accumulation, protected window and pooling, with the baseline's defaults so a comparison
isolates the score) with the OBCache score in place of accumulated attention:

- ``h2o-obc*``: scores of every query seen (prefill and decode) add up per slot (the ``_fullhist``
  variant of the paper code; longlab's ``h2o`` also accumulates over every query);
- ``tova-obc*``: the last query only, no recent window, each KV head keeping its own token set as the
  OBCache code does (its score tracker keeps ``[B, heads, T]`` scores and takes the top-k per head even
  for the TOVA preset); ``share_heads=true`` sums the scores over the heads of the layer so they keep one
  token set, as longlab's ``tova`` does;
- ``snapkv-obc*``: the last ``window_size`` queries, then 1-D pooling over the non-window slots only (the
  code pools ``score[..., :recent_cutoff]``); ``pooling=max,kernel_size=7`` gives the paper's
  ``obc*+maxpool`` preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import param
from .attention_scores import H2O, TOVA, SnapKV
from .base import outside_window, pool_scores

__all__ = ["obc_scores", "probs_and_logits", "OBCScore", "H2OOBC", "TOVAOBC", "SnapKVOBC"]

_OBC_STATE = "obc_acc"
SCORE_TYPES = ("v", "k", "vk")


def probs_and_logits(ctx, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``A`` and logits ``z`` (0 where masked) of the selected queries, fp32: ``[B, H, t, T]``.

    Query heads of a KV head are stacked as rows of one product, so keys are never repeated."""
    q = ctx.q[:, :, rows].float()  # [B, H, t, D]
    B, H, t, D = q.shape
    k = ctx.k.float()  # [B, H_kv, T, D]
    z = (q.reshape(B, k.shape[1], -1, D) @ k.transpose(-1, -2)).reshape(B, H, t, -1) * ctx.scaling
    m = ctx.mask(rows)  # [B, H_kv | 1, t, T]
    if m.shape[1] > 1:
        m = m.repeat_interleave(ctx.groups, dim=1)
    A = torch.nan_to_num(torch.softmax(z.masked_fill(~m, float("-inf")), dim=-1), nan=0.0)
    return A, z.masked_fill(~m, 0.0)


def obc_scores(
    A: torch.Tensor,
    z: torch.Tensor,
    v: torch.Tensor,
    score_type: str = "vk",
    p: int = 2,
    cross: bool = True,
    o: torch.Tensor | None = None,
) -> torch.Tensor:
    """OBCache saliency of every key, summed over the query rows and the query heads of each KV head.

    A, z: [B, H, t, T] attention and logits (0 where masked); v: [B, H_kv, T, D] values (query head h
    reads KV head h // (H / H_kv); pass H_kv = H for per-head scores); o: [B, H, t, D] the queries'
    attention outputs if already computed (else ``A v``). Returns [B, H_kv, T].

    The key and joint scores are sums over i of a squared first-order output change. Joint pruning
    changes ``o_i`` by ``-A_ij ((1 + z_ij) v_j - z_ij o_i)``, so with ``x.y`` dot products
    ``S^VK_j = sum_i A_ij^2 [alpha ||v_j||^2 + z_ij^2 ||o_i||^2 - 2 beta v_j.o_i]``, where
    ``(alpha, beta) = ((1+z)^2, z(1+z))``; dropping the cross term gives ``(1 + z^2, z^2)`` and the key
    score alone ``(z^2, z^2)``. Expanded this way, ``sum_i beta_ij v_j.o_i`` is one [T, g*t] x [g*t, D]
    product per KV head and no [t, T] dot-product matrix is formed.
    """
    A, z, v = A.float(), z.float(), v.float()
    B, H, t, T = A.shape
    H_kv = v.shape[1]
    g = H // H_kv

    def per_kv(x: torch.Tensor) -> torch.Tensor:  # [B, H, T] -> [B, H_kv, T]
        return x.reshape(B, H_kv, g, T).sum(2)

    if score_type == "v":
        if p == 1:
            return per_kv(A.sum(2)) * v.abs().sum(-1)
        return per_kv((A * A).sum(2)) * (v * v).sum(-1)
    if o is None:
        o = (A.reshape(B, H_kv, g * t, T) @ v).reshape(B, H, t, -1)  # [B, H, t, D]
    o = o.float()
    A2 = A * A
    z2 = z * z
    if score_type == "k":
        alpha = beta = A2 * z2
    elif cross:
        one_z = 1 + z
        alpha, beta = A2 * one_z * one_z, A2 * z * one_z
    else:
        beta = A2 * z2
        alpha = A2 + beta
    on = (o * o).sum(-1)  # [B, H, t]  ||o_i||^2
    c_v = per_kv(alpha.sum(2)) * (v * v).sum(-1)  # [B, H_kv, T]
    c_o = per_kv((A2 * z2 * on[..., None]).sum(2))
    m = beta.reshape(B, H_kv, g * t, T).transpose(-1, -2) @ o.reshape(B, H_kv, g * t, -1)  # [B, H_kv, T, D]
    return c_v + c_o - 2 * (m * v).sum(-1)


@dataclass
class OBCScore:
    """The OBCache score as a mix-in: ``score_type`` is fixed by each registered class; ``p`` and
    ``cross`` are hyper-parameters."""

    score_type: ClassVar[str] = "vk"
    p: int = param(2, choices=(1, 2))
    cross: bool = param(True, choices=(True, False))

    def _validate_obc(self) -> None:
        if self.p == 1 and self.score_type != "v":
            raise LonglabError(f"{self.name}: p=1 exists only for the value score (obcv), got p={self.p!r}")
        if not self.cross and self.score_type != "vk":
            raise LonglabError(f"{self.name}: cross=false applies only to the joint score (obcvk)")

    def obc_block(self, ctx, rows: slice) -> torch.Tensor:
        """Summed OBCache score of the query rows ``rows`` of this forward: [B, H_kv, T]."""
        A, z = probs_and_logits(ctx, rows)  # [B, H, t, T]
        out = ctx.attn_output  # after attention (select), the rows' outputs o_i are already there
        o = out[:, :, rows] if out is not None and out.shape[-2] == ctx.q.shape[-2] else None
        return obc_scores(A, z, ctx.v, self.score_type, self.p, self.cross, o)  # [B, H_kv, T]


@dataclass
class H2OOBC(OBCScore, H2O):
    """H2O pipeline with OBCache scores (arXiv:2510.07651): ``s_j = sum_i S_ij`` over
    every query seen, prefill and decode, accumulated per slot; recent window as ``h2o``."""

    paper = "arXiv:2510.07651"
    pipeline: ClassVar[str] = "h2o"

    def validate(self) -> None:
        super().validate()
        self._validate_obc()

    @property
    def state_key(self) -> str:
        """``layer.extras`` key of the accumulated score, one per variant (they never share state)."""
        return f"{_OBC_STATE}.{self.name}"

    def observe(self, ctx) -> None:
        layer = ctx.layer
        acc = layer.extras.get(self.state_key)
        if acc is None:
            acc = torch.zeros(layer.index.shape, dtype=torch.float32, device=layer.index.device)
        for rows in ctx.query_blocks():
            acc = acc + self.obc_block(ctx, rows)
        layer.extras[self.state_key] = acc  # [B, H_kv, T]

    def score(self, ctx) -> torch.Tensor:
        return ctx.layer.extras[self.state_key]


@dataclass
class TOVAOBC(OBCScore, TOVA):
    """TOVA pipeline with OBCache scores (arXiv:2510.07651): ``s_j = S_tj`` for the last query ``t``
    only, no recent window; each KV head keeps its own top entries, as the OBCache code evicts
    (``share_heads=true``: summed over the heads so the layer keeps one token set, as in TOVA)."""

    paper = "arXiv:2510.07651"
    pipeline: ClassVar[str] = "tova"
    share_heads: bool = param(False, choices=(True, False))

    def validate(self) -> None:
        super().validate()
        self._validate_obc()

    def score(self, ctx) -> torch.Tensor:
        T_q = ctx.q.shape[-2]
        s = self.obc_block(ctx, slice(T_q - 1, T_q))  # [B, H_kv, T]
        return s.sum(1, keepdim=True).expand_as(s) if self.share_heads else s


@dataclass
class SnapKVOBC(OBCScore, SnapKV):
    """SnapKV pipeline with OBCache scores (arXiv:2510.07651):
    ``s_j = pool_k(sum_{i in last W} S_ij)``; the last W tokens are kept."""

    paper = "arXiv:2510.07651"
    pipeline: ClassVar[str] = "snapkv"

    def validate(self) -> None:
        super().validate()
        self._validate_obc()

    def score(self, ctx) -> torch.Tensor:
        T_q = ctx.q.shape[-2]
        s = self.obc_block(ctx, slice(max(0, T_q - self.window_size), T_q))  # [B, H_kv, T]
        region = outside_window(ctx, self.window_size)  # pooled over the non-window slots only
        return pool_scores(s, self.kernel_size, self.pooling, region).masked_fill(~region, 0.0)


def _variant(base: type, score_type: str) -> type:
    """Register ``{pipeline}-obc{score_type}``: a subclass of ``base`` fixing the score type."""
    label = {"v": "value", "k": "key", "vk": "joint value+key"}[score_type]
    doc = f"{base.pipeline} pipeline, OBCache {label} score S^{score_type.upper()} (arXiv:2510.07651).\n\n"
    attrs = {"score_type": score_type, "__doc__": doc + base.__doc__}
    cls = type(f"{base.__name__}_{score_type}", (base,), attrs)
    cls.__module__ = __name__
    return register(f"{base.pipeline}-obc{score_type}")(dataclass(cls))


VARIANTS = {  # name -> class, e.g. "snapkv-obcvk"
    f"{b.pipeline}-obc{st}": _variant(b, st) for b in (H2OOBC, TOVAOBC, SnapKVOBC) for st in SCORE_TYPES
}
