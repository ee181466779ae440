"""A small language model as a token scorer: ``Scorer.nll(ids, prefix) -> [T]`` self-information.

``nll[i] = -log p(x_i | prefix, x_<i)`` in nats, computed in chunks with a plain
:class:`transformers.DynamicCache` (the model's own attention, no longlab recipe), so the logits held at
once are ``[chunk, V]``, never ``[T, V]``. The first token of a sequence without prefix has no
prediction: its nll is 0. :class:`IncrementalScorer` keeps a growing compressed prefix in a cache, for
LLMLingua's iterative compression (each segment scored given the already-compressed text).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Scorer", "IncrementalScorer"]

# model -> {(prefix, ids, tail): (nll of ids, nll of tail, seconds)}; entries die with their model
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Scorer:
    """Wraps a causal LM (``model(input_ids, position_ids, cache, use_cache)``) for token scores."""

    def __init__(self, model: Any, chunk: int = 512) -> None:
        self.model = model
        self.chunk = chunk
        self.device = next(model.parameters()).device
        self.forwards = 0  # model calls made (for the report)
        self.tokens = 0  # tokens run through the model
        self.memo_s = 0.0  # seconds the memoized calls this scorer reused first cost

    def _cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], cache: Any, start: int, last_logits: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``ids`` at positions ``start...`` into ``cache``; returns (nll of each of ``ids`` [T],
        logits after the last one [V]). ``last_logits``: the logits predicting ``ids[0]`` (None: nll 0)."""
        out = torch.zeros(len(ids))
        prev = last_logits
        for a in range(0, len(ids), self.chunk):
            piece = list(ids[a : a + self.chunk])
            x = torch.tensor([piece], device=self.device)  # [1, t]
            pos = torch.arange(start + a, start + a + len(piece), device=self.device)[None]  # [1, t]
            logits = self.model(input_ids=x, position_ids=pos, cache=cache, use_cache=True).logits[0]
            self.forwards += 1
            self.tokens += len(piece)
            logp = logits.float().log_softmax(-1)  # [t, V]
            target = x[0]
            nll = torch.empty(len(piece))
            if len(piece) > 1:
                nll[1:] = -logp[:-1].gather(-1, target[1:, None])[:, 0].cpu()
            nll[0] = 0.0 if prev is None else float(-prev.float().log_softmax(-1)[target[0]])
            out[a : a + len(piece)] = nll
            prev = logits[-1]
        return out, prev  # type: ignore[return-value]

    def nll(self, ids: Sequence[int], prefix: Sequence[int] = ()) -> torch.Tensor:
        """``-log p(x_i | prefix, x_<i)`` for each token of ``ids``: ``[len(ids)]`` (memoized)."""
        return self.nll_then(prefix, ids, ())[0]

    def nll_then(
        self, prefix: Sequence[int], ids: Sequence[int], tail: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """nll of ``ids`` after ``prefix``, and of ``tail`` after both: (``[len(ids)]``, ``[len(tail)]``).

        Memoized per model (the last 256 calls), so compressing one context at several ratios scores it
        once; :attr:`memo_s` adds up the seconds the memoized calls first cost, which a compression
        reports as part of its own time (what a standalone run pays)."""
        memo = _MEMO.setdefault(self.model, {})
        key = (tuple(prefix), tuple(ids), tuple(tail))
        hit = memo.get(key)
        if hit is not None:
            self.memo_s += hit[2]
            return hit[0], hit[1]
        t0 = time.perf_counter()
        cache = self._cache()
        last = None
        if prefix:
            _, last = self.run(prefix, cache, 0)
        scores, last = self.run(ids, cache, len(prefix), last)
        after = self.run(tail, cache, len(prefix) + len(ids), last)[0] if tail else torch.zeros(0)
        if len(memo) >= 256:
            memo.pop(next(iter(memo)))
        memo[key] = (scores, after, time.perf_counter() - t0)
        return scores, after


class IncrementalScorer:
    """A compressed prefix held in a cache: :meth:`score` a segment given it, :meth:`append` the tokens
    kept (re-encoded given the prefix, as LLMLingua's iterative compression conditions each segment on
    the compressed text before it)."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.cache = scorer._cache()
        self.length = 0
        self.last: torch.Tensor | None = None  # logits after the prefix [V]

    def score(self, ids: Sequence[int]) -> torch.Tensor:
        """nll of each token of ``ids`` given the prefix and the segment's own earlier tokens; the cache
        is cropped back to the prefix afterwards."""
        scores, _ = self.scorer.run(ids, self.cache, self.length, self.last)
        self.cache.crop(-len(ids))  # back to the prefix (negative: tokens removed from the end)
        return scores

    def append(self, ids: Sequence[int]) -> None:
        if ids:
            _, self.last = self.scorer.run(ids, self.cache, self.length, self.last)
            self.length += len(ids)
