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
- ``tova-obc*``: the last query only, per KV head (the paper evicts per head), no recent window;
- ``snapkv-obc*``: the last ``window_size`` queries, then 1-D pooling; ``pooling=max,kernel_size=7``
  gives the paper's ``obc*+maxpool`` preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..recipe import LonglabError, register
from .attention import H2O, TOVA, SnapKV
from .base import pool_scores

__all__ = ["obc_scores", "probs_and_logits", "OBCScore", "H2OOBC", "TOVAOBC", "SnapKVOBC"]

_OBC_STATE = "obc_acc"
SCORE_TYPES = ("v", "k", "vk")


def probs_and_logits(ctx, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``A`` and logits ``z`` (0 where masked) of the selected queries, fp32: ``[B, H, t, T]``."""
    q = ctx.q[:, :, rows].float()  # [B, H, t, D]
    k = ctx.k.float().repeat_interleave(ctx.groups, dim=1)  # [B, H, T, D]
    z = torch.matmul(q, k.transpose(-1, -2)) * ctx.scaling  # [B, H, t, T]
    m = ctx.mask(rows)
    if m.shape[1] > 1:
        m = m.repeat_interleave(ctx.groups, dim=1)
    A = torch.nan_to_num(torch.softmax(z.masked_fill(~m, float("-inf")), dim=-1), nan=0.0)
    return A, z.masked_fill(~m, 0.0)


def obc_scores(
    A: torch.Tensor, z: torch.Tensor, v: torch.Tensor, score_type: str = "vk", p: int = 2, cross: bool = True
) -> torch.Tensor:
    """OBCache saliency of every key, summed over the query rows.

    A, z: [B, H, t, T] attention and logits (0 where masked); v: [B, H, T, D] values (repeated to the
    query heads). Returns [B, H, T]. ``o_i = sum_j A_ij v_j`` is recomputed from ``A`` and ``v``.
    """
    A, z, v = A.float(), z.float(), v.float()
    if score_type == "v":
        if p == 1:
            return A.sum(2) * v.abs().sum(-1)
        return (A * A).sum(2) * (v * v).sum(-1)
    o = torch.matmul(A, v)  # [B, H, t, D]
    vn = (v * v).sum(-1)[:, :, None, :]  # [B, H, 1, T]  ||v_j||^2
    vo = torch.matmul(o, v.transpose(-1, -2))  # [B, H, t, T]  v_j . o_i
    on = (o * o).sum(-1)[..., None]  # [B, H, t, 1]  ||o_i||^2
    az = A * z
    s_k = (az * az * (vn + on - 2 * vo)).sum(2)  # [B, H, T]
    if score_type == "k":
        return s_k
    A2 = A * A
    s = A2.sum(2) * vn[:, :, 0] + s_k
    if cross:
        s = s + (2 * A2 * z * (vn - vo)).sum(2)
    return s


@dataclass
class OBCScore:
    """The OBCache score as a mix-in: ``score_type`` is fixed by each registered class; ``p`` and
    ``cross`` are hyper-parameters."""

    score_type: ClassVar[str] = "vk"
    p: int = 2
    cross: bool = True

    def _validate_obc(self) -> None:
        if self.p not in (1, 2) or isinstance(self.p, bool):
            raise LonglabError(f"{self.name}: p must be 1 or 2, got {self.p!r}")
        if self.p == 1 and self.score_type != "v":
            raise LonglabError(f"{self.name}: p=1 exists only for the value score (obcv), got p={self.p!r}")
        if not isinstance(self.cross, bool):
            raise LonglabError(f"{self.name}: cross must be true or false, got {self.cross!r}")
        if not self.cross and self.score_type != "vk":
            raise LonglabError(f"{self.name}: cross=false applies only to the joint score (obcvk)")

    def obc_block(self, ctx, rows: slice) -> torch.Tensor:
        """Summed OBCache score of the query rows ``rows`` of this forward: [B, H_kv, T]."""
        A, z = probs_and_logits(ctx, rows)  # [B, H, t, T]
        v = ctx.v.float().repeat_interleave(ctx.groups, dim=1)  # [B, H, T, D]
        s = obc_scores(A, z, v, self.score_type, self.p, self.cross)  # [B, H, T]
        B, H, T = s.shape
        return s.reshape(B, H // ctx.groups, ctx.groups, T).sum(2)  # [B, H_kv, T]


@dataclass
class H2OOBC(OBCScore, H2O):
    """H2O pipeline with OBCache scores (arXiv:2510.07651): ``s_j = sum_i S_ij`` over
    every query seen, prefill and decode, accumulated per slot; recent window as ``h2o``."""

    paper = "arXiv:2510.07651"
    pipeline: ClassVar[str] = "h2o"

    def validate(self) -> None:
        super().validate()
        self._validate_obc()

    def observe(self, ctx) -> None:
        layer = ctx.layer
        acc = layer.extras.get(_OBC_STATE)
        if acc is None:
            acc = torch.zeros(layer.index.shape, dtype=torch.float32, device=layer.index.device)
        for rows in ctx.query_blocks():
            acc = acc + self.obc_block(ctx, rows)
        layer.extras[_OBC_STATE] = acc  # [B, H_kv, T]

    def score(self, ctx) -> torch.Tensor:
        return ctx.layer.extras[_OBC_STATE]


@dataclass
class TOVAOBC(OBCScore, TOVA):
    """TOVA pipeline with OBCache scores (arXiv:2510.07651): ``s_j = S_tj`` for the
    last query ``t`` only, per KV head, no recent window."""

    paper = "arXiv:2510.07651"
    pipeline: ClassVar[str] = "tova"

    def validate(self) -> None:
        super().validate()
        self._validate_obc()

    def score(self, ctx) -> torch.Tensor:
        T_q = ctx.q.shape[-2]
        return self.obc_block(ctx, slice(T_q - 1, T_q))  # [B, H_kv, T]


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
        return pool_scores(s, self.kernel_size, self.pooling)


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
