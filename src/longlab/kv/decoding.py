"""Decode-time eviction: long generations stay within a budget.

``decoding:base=snapkv,interval=64,budget=256`` wraps any score-based KV policy (the *base*) and runs
it during decoding: whenever a layer holds ``budget + interval`` entries per head, the base policy
compresses it back to ``budget``. Held entries therefore never exceed ``budget + interval`` after the
first decode step, and compression costs one scoring pass every ``interval`` tokens (the scheme of
kvpress's ``DecodingPress``). The base sees the last ``window_size`` decode queries (buffered per
layer, with their true positions) as its observation window, so SnapKV-style scorers work at decode
time as they do at prefill. Prefill is left to the other policies of the recipe (``snapkv@0.5+decoding:...``).

``h2o-stream`` and ``tova-stream`` are the streaming forms of H2O (Zhang et al. 2023,
arXiv:2306.14048) and TOVA (Oren et al. 2024, arXiv:2401.06104): ``interval=1``, so each step evicts
the lowest-scoring entry once the budget is reached — H2O's accumulated attention, TOVA's attention of
the current query.

A base spec with several parameters separates them by ``;`` (the recipe syntax reserves ``,``):
``decoding:base=snapkv:window_size=16;kernel_size=7,budget=512``.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

from ..recipe import LonglabError, parse_method, register
from .base import KVPolicy

__all__ = ["DecodingCompression", "StreamingH2O", "StreamingTOVA"]

_QUERIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (q [B,H,n,D], qidx [B,n])


@register("decoding")
@dataclass
class DecodingCompression(KVPolicy):
    """Compress with ``base`` back to ``budget`` entries per head every time a layer reaches
    ``budget + interval`` during decoding (kvpress ``DecodingPress`` scheme)."""

    paper = "kvpress DecodingPress"
    needs_observe = True
    base: str = "snapkv"
    interval: int = 64
    window_size: int = 32  # decode queries buffered as the base's observation window
    _base: KVPolicy | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise LonglabError(f"{self.name}: set budget (entries kept per head after each compression)")
        for name in ("interval", "window_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LonglabError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.base, str) or "@" in self.base:
            raise LonglabError(
                f"{self.name}: base must be a method name such as 'snapkv' (no '@ratio'), got {self.base!r}"
            )
        base = parse_method(self.base.replace(";", ","))
        if base.kind != "kv" or isinstance(base, DecodingCompression):
            raise LonglabError(f"{self.name}: base must be an eviction policy, got {self.base!r}")
        try:
            self._base = dataclasses.replace(base, budget=self.budget, compression_ratio=0.0)
        except LonglabError as exc:
            raise LonglabError(f"{self.name}: base {self.base!r}: {exc}") from None

    def observe(self, ctx) -> None:
        # Buffer the last window_size queries of this layer (post-RoPE) with their positions.
        q, qidx = ctx.q, ctx.query_index  # [B, H, T_q, D], [B, T_q]
        old = _QUERIES.get(ctx.layer)
        if old is not None and old[0].shape[0] == q.shape[0]:
            q, qidx = torch.cat([old[0], q], dim=2), torch.cat([old[1], qidx], dim=1)
        _QUERIES[ctx.layer] = (q[:, :, -self.window_size :], qidx[:, -self.window_size :])
        if self._base.needs_observe:
            self._base.observe(ctx)

    def select_decode(self, ctx) -> torch.Tensor | None:
        if int(ctx.layer.lengths().max()) < self.budget + self.interval:
            return None
        q, qidx = _QUERIES.get(ctx.layer, (ctx.q, ctx.query_index))
        return self._base.select(dataclasses.replace(ctx, q=q, query_index=qidx))


@register("h2o-stream")
@dataclass
class StreamingH2O(DecodingCompression):
    """Streaming H2O (Zhang et al. 2023, arXiv:2306.14048): accumulated attention over every query, one
    eviction per decode step once ``budget`` is reached (``interval=1``)."""

    paper = "arXiv:2306.14048"
    base: str = "h2o"
    interval: int = 1


@register("tova-stream")
@dataclass
class StreamingTOVA(DecodingCompression):
    """Streaming TOVA (Oren et al. 2024, arXiv:2401.06104): the current query's head-averaged attention,
    one eviction per decode step once ``budget`` is reached (``interval=1``)."""

    paper = "arXiv:2401.06104"
    base: str = "tova"
    interval: int = 1
