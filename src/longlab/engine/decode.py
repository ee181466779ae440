"""Decoding lanes: the rows of running requests, advanced one step at a time by the engine.

A *row* is one request being decoded: its pending next-token logits, its sampler (greedy, or
temperature/top-p from the request's own generator, so a row's tokens never depend on the rows beside
it), its stop conditions (EOS, ``max_new_tokens``, stop strings), its grammar (``response_format``: a
:class:`~longlab.grammar.GrammarMask` applied to its logits before every pick, per row, so
constrained and free rows share one batch) and what it has produced.

A *lane* holds rows and advances them together:

- :class:`StreamLane`: the rows of one :class:`~longlab.engine.stream.Stream` (one forward per step for all
  of them). A lane under the empty recipe whose layers are plain (``batchable``) takes new rows between
  steps (:meth:`StreamLane.join` restacks the caches, padding shorter rows with empty slots that attention
  skips), and rows that finish leave it (``Cache.batch_select_indices``), so a step costs only the rows
  still running. Rows whose recipe acts at decode (a decode policy, quantized storage) get a lane each.
- :class:`SpecLane`: one speculative-decoding run (draft, verify, accept: several tokens a step).
- :class:`OneShotLane`: a decoding that runs whole in one step (a context method's guided decoding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Sampler", "Row", "Lane", "StreamLane", "SpecLane", "OneShotLane", "stack_streams"]


class Sampler:
    """The next token of one row: argmax at temperature 0, else a draw from ``softmax(logits / T)``
    restricted to the top-p nucleus, from this row's own generator (seeded by its request)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def __call__(self, logits: torch.Tensor) -> int:  # logits: [V] fp32 on CPU -> a token id
        if self.generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


@dataclass
class Row:
    """One request being decoded. ``logits [V]``: its pending next-token logits."""

    key: Any  # the engine's request handle
    logits: torch.Tensor
    max_new_tokens: int
    eos: set[int]
    sampler: Sampler = field(default_factory=Sampler)
    stop: list[str] | None = None
    detokenize: Callable[[list[int]], str] | None = None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # "eos", "length" or "stop" once finished
    decode_s: float = 0.0  # seconds of the steps this row took part in
    steps: int = 0  # forwards this row took part in
    info: dict[str, Any] = field(default_factory=dict)  # what the lane measured (speculation, batch size)
    grammar: Any = None  # a GrammarMask (response_format) or None: free text

    def constrain(self) -> None:
        """Mask the pending logits to the tokens the row's grammar allows now (no grammar: nothing)."""
        if self.grammar is not None and self.finish is None:
            self.logits = self.grammar.apply(self.logits)

    def take(self, token: int) -> None:
        """Append ``token`` and decide whether the row is finished."""
        self.tokens.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if token in self.eos:
            self.finish = "eos"
        elif self.stop and self._stopped():
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish = "length"

    def _stopped(self) -> bool:
        longest = max(len(s) for s in self.stop or ())
        tail = self.detokenize(self.tokens[-(longest + 8) :]) if self.detokenize else ""
        return any(s in tail for s in self.stop or ())


class Lane:
    """Rows advanced together. :meth:`step` advances every row one step and returns the rows that
    finished in it (they have left the lane)."""

    rows: list[Row]

    def step(self) -> list[Row]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the lane holds (the engine calls it once every row has finished)."""

    def keep_rows(self, keep: list[int]) -> bool:
        """Keep only the rows at indices ``keep`` now, freeing the others' cache rows; False where the lane
        cannot (its rows then ride along until it ends)."""
        return False


class StreamLane(Lane):
    """The rows of one stream, one forward per step. ``joinable``: the lane runs under the empty recipe
    with plain layers, so rows of other streams may join it (:meth:`join`) and finished rows leave it.
    ``drop``: finished rows leave the batch (else they ride along until every row has finished)."""

    def __init__(
        self,
        stream: Any,
        rows: list[Row],
        *,
        joinable: bool = False,
        drop: bool = True,
        hook: Callable[[], Any] | None = None,
    ) -> None:
        self.stream, self.rows = stream, list(rows)
        self.joinable = joinable
        self.drop = drop and all(m.batch_select_safe for m in stream.cache.recipe.methods)
        self.hook = hook  # a context manager factory active around every forward (merged embeddings)
        self._done: list[Row] = []  # finished rows still in the batch (``drop`` off)

    def keep_rows(self, keep: list[int]) -> bool:
        if not self.drop:
            return False
        self.stream._select_rows(keep)
        self.rows = [self.rows[i] for i in keep]
        return True

    def step(self) -> list[Row]:
        t0 = time.perf_counter()
        live = [r for r in self.rows if r.finish is None]
        for r in live:
            r.constrain()
        greedy = [i for i, r in enumerate(self.rows) if r.sampler.greedy]
        picks = [0] * len(self.rows)
        if greedy:  # one argmax for every greedy row
            stacked = torch.stack([self.rows[i].logits for i in greedy])
            for i, t in zip(greedy, stacked.argmax(-1).tolist()):
                picks[i] = t
        for i, r in enumerate(self.rows):
            if not r.sampler.greedy:
                picks[i] = r.sampler(r.logits)
        for r, t in zip(self.rows, picks):
            if r.finish is None:
                r.take(t)
        finished = [r for r in live if r.finish is not None]
        running = [i for i, r in enumerate(self.rows) if r.finish is None]
        if running and self.drop and len(running) < len(self.rows):
            self.stream._select_rows(running)
            picks = [picks[i] for i in running]
            self.rows = [self.rows[i] for i in running]
        if running:
            batch = len(self.rows)
            with self.hook() if self.hook is not None else _nothing():
                logits = self.stream.feed([[t] for t in picks], compress="none").float().cpu()  # [B, V]
            for r, lg in zip(self.rows, logits):
                r.logits = lg
        else:
            batch = len(self.rows)
            self.rows = []
        seconds = time.perf_counter() - t0
        for r in live:
            r.decode_s += seconds
            r.steps += 1
            r.info["decode_batch"] = max(r.info.get("decode_batch", 0), batch)
        if not self.drop:  # finished rows ride along; report them once
            out = [r for r in finished if r not in self._done]
            self._done += out
            if not running:
                self.rows = []
            return out
        return finished

    def join(self, other: StreamLane) -> None:
        """Take ``other``'s rows into this lane (both joinable): one stream whose rows are both lanes'.
        The restacked cache reserves the slots the rows may still append (their remaining tokens), so no
        decode step re-allocates the batch with a fixed spare (``DECODE_RESERVE``) held by every row."""
        reserve = max((r.max_new_tokens - len(r.tokens) for r in self.rows + other.rows), default=0)
        self.stream = stack_streams([self.stream, other.stream], reserve)
        self.rows = self.rows + other.rows
        other.rows = []


class SpecLane(Lane):
    """One speculative-decoding run (:func:`longlab.spec.loop.speculative_steps`): each step drafts,
    verifies in one target forward and accepts; the row's tokens are the run's output."""

    def __init__(self, row: Row, steps: Iterator[Any], hook: Callable[[], Any] | None = None) -> None:
        self.rows = [row]
        self._steps = steps
        self.hook = hook

    def step(self) -> list[Row]:
        row = self.rows[0]
        t0 = time.perf_counter()
        try:
            with self.hook() if self.hook is not None else _nothing():
                next(self._steps)
            done = False
        except StopIteration as stop:
            tokens, stats = stop.value
            row.tokens = list(tokens[0])
            row.info["speculation"] = stats
            last = row.tokens[-1] if row.tokens else None
            row.finish = "eos" if last in row.eos else "length"
            done = True
        row.decode_s += time.perf_counter() - t0
        row.steps += 1
        if done:
            self.rows = []
            return [row]
        return []


class OneShotLane(Lane):
    """A decoding that runs whole in one step: ``run() -> tokens`` (guided decoding)."""

    def __init__(self, row: Row, run: Callable[[], list[int]], hook: Callable[[], Any] | None = None) -> None:
        self.rows = [row]
        self._run = run
        self.hook = hook

    def step(self) -> list[Row]:
        row = self.rows[0]
        t0 = time.perf_counter()
        with self.hook() if self.hook is not None else _nothing():
            row.tokens = list(self._run())
        row.finish = "eos" if row.tokens and row.tokens[-1] in row.eos else "length"
        row.decode_s += time.perf_counter() - t0
        row.steps += 1
        self.rows = []
        return [row]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def stack_streams(streams: list[Any], reserve: int = 0) -> Any:
    """One stream whose batch rows are the rows of ``streams`` (plain layers), under the empty recipe
    (:meth:`LonglabLayer.stacked`: leading empty slots pad the shorter rows, which attention skips per
    row; ``reserve`` spare slots for the tokens to come). Streams that saw different numbers of tokens
    get their padding masks left-padded to the longest."""
    from ..cache import LonglabCache, LonglabLayer

    cache = LonglabCache(None)
    layers = zip(*(s.cache.layers for s in streams))
    cache.layers = [LonglabLayer.stacked(list(rows), reserve) for rows in layers]
    first = streams[0]
    width = max(s.seen_mask.shape[1] for s in streams)
    for layer in cache.layers:
        layer.n_seen = width
    stacked = first.__class__(first.model, cache, sum(s.batch_size for s in streams))  # a Stream
    stacked.pad_id = first.pad_id
    masks = [torch.nn.functional.pad(s.seen_mask, (width - s.seen_mask.shape[1], 0)) for s in streams]
    stacked.seen_mask = torch.cat(masks)  # [B, n_seen]
    stacked.next_pos = torch.cat([s.next_pos for s in streams])  # [B]
    return stacked
