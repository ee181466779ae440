"""Decode-time eviction: long generations stay within a budget.

``decoding:base=snapkv,interval=64,budget=256`` wraps any score-based KV policy (the *base*) and runs
it during decoding: whenever a layer holds ``budget + interval`` entries per head, the base policy
compresses it back to ``budget``. Held entries therefore never exceed ``budget + interval`` after the
first decode step, and compression costs one scoring pass every ``interval`` tokens (the scheme of
kvpress's ``DecodingPress``). The base sees the last ``window_size`` decode queries (decoding steps
only, as kvpress buffers them; buffered in each layer's ``layer.state`` with their true positions, so
forks and batch selection carry them) as its observation window, so SnapKV-style scorers work at
decode time as they do at prefill. Prefill is left to the other policies of the recipe
(``snapkv@0.5+decoding:...``).

``h2o-stream`` and ``tova-stream`` are the streaming forms of H2O (Zhang et al. 2023,
arXiv:2306.14048) and TOVA (Oren et al. 2024, arXiv:2401.06104): ``interval=1``, so each step evicts
the lowest-scoring entry once the budget is reached — H2O's accumulated attention, TOVA's attention of
the current query.

A base spec with several parameters separates them by ``;`` (the recipe syntax reserves ``,``):
``decoding:base=snapkv:window_size=16;kernel_size=7,budget=512``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..recipe import LonglabError, parse_method, register
from ..registry import MAX_TOKENS, param
from .base import KVPolicy

__all__ = ["DecodingCompression", "StreamingH2O", "StreamingTOVA"]


@register("decoding")
@dataclass
class DecodingCompression(KVPolicy):
    """Compress with ``base`` back to ``budget`` entries per head every time a layer reaches
    ``budget + interval`` during decoding (kvpress ``DecodingPress`` scheme)."""

    paper = "kvpress DecodingPress"
    needs_observe = True
    acts_during_decode = True  # capability: evicts at decode steps
    batch_select_safe = True  # capability: the decode-query buffer lives in layer.state (batch first)
    base: str = "snapkv"
    interval: int = param(64, low=1, high=MAX_TOKENS, integer=True)
    # decode queries buffered as the base's observation window
    window_size: int = param(32, low=1, high=MAX_TOKENS, integer=True)
    _base: KVPolicy | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise LonglabError(f"{self.name}: set budget (entries kept per head after each compression)")
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

    @property
    def _state_keys(self) -> tuple[str, str]:
        """``layer.state`` keys of the buffered queries ``[B, H, n, D]`` and their positions ``[B, n]``."""
        return f"{self.name}.queries", f"{self.name}.query_index"

    def observe(self, ctx) -> None:
        # Buffer the last window_size *decode* queries of this layer (post-RoPE) with their positions, as
        # kvpress's DecodingPress buffers decoding steps only (prefill is left to the other policies), in
        # layer.state: forks copy them, batch selection keeps them, nbytes counts them.
        if self._base.needs_observe:
            self._base.observe(ctx)
        if ctx.phase != "decode":
            return
        q, qidx = ctx.q, ctx.query_index  # [B, H, 1, D], [B, 1]
        kq, ki = self._state_keys
        state = ctx.layer.state
        old_q, old_i = state.get(kq), state.get(ki)
        if old_q is not None and old_i is not None and old_q.shape[:2] == q.shape[:2]:
            q, qidx = torch.cat([old_q, q], dim=2), torch.cat([old_i, qidx.to(old_i.dtype)], dim=1)
        state[kq] = q[:, :, -self.window_size :].contiguous()
        state[ki] = qidx[:, -self.window_size :].contiguous()

    def select_decode(self, ctx) -> torch.Tensor | None:
        if int(ctx.layer.lengths().max()) < self.budget + self.interval:
            return None
        kq, ki = self._state_keys
        q, qidx = ctx.layer.state.get(kq, ctx.q), ctx.layer.state.get(ki, ctx.query_index)
        return self._base.select(dataclasses.replace(ctx, q=q, query_index=qidx))


@register("h2o-stream")
@dataclass
class StreamingH2O(DecodingCompression):
    """Streaming H2O (Zhang et al. 2023, arXiv:2306.14048): accumulated attention over every query, one
    eviction per decode step once ``budget`` is reached (``interval=1``)."""

    paper = "arXiv:2306.14048"
    base: str = "h2o"
    interval: int = param(1, low=1, high=MAX_TOKENS, integer=True)


@register("tova-stream")
@dataclass
class StreamingTOVA(DecodingCompression):
    """Streaming TOVA (Oren et al. 2024, arXiv:2401.06104): the current query's head-averaged attention,
    one eviction per decode step once ``budget`` is reached (``interval=1``)."""

    paper = "arXiv:2401.06104"
    base: str = "tova"
    interval: int = param(1, low=1, high=MAX_TOKENS, integer=True)
