"""Prefill once, branch many: the requests that share a prompt, each under its own recipe.

Requests whose prompt is the same token ids (and the same chunking, mode and compression point) form a
*prompt group*. The expensive part, the prefill of their context, is shared:

1. recipes with a context compressor are grouped by it; each compressor runs once on the context ids
   (:func:`longlab.compress.api.compress_prompts`), its recipes continue on the shorter ids;
2. the recipes are grouped by shared prefix (:mod:`longlab.engine.planner`); every context token before
   the *tail* is fed once, uncompressed (``compress="none"``), into a :class:`~longlab.engine.stream.Stream`
   whose recipe holds each observing KV policy of the group (``needs_observe``, e.g. H2O's accumulated
   attention), so their state covers the shared prefix;
3. the tail is fed once too, with ``compress="end"`` (query-aware: tail + question), while a
   :class:`~longlab.hook.ChunkRecorder` keeps what each layer's compression step sees;
4. each recipe gets a fork of that stream (:meth:`Stream.fork`), keeps only the observer state it owns
   and replays the compression step alone (:func:`~longlab.hook.replay_compression`). A recipe whose KV
   policy computes attention itself while the tail is prefilled (``reads_attention``), that transforms
   the prefill forward (``hico-forward``) or that compresses after every chunk (``compress="chunk"``)
   instead forks before the tail and feeds it with its own recipe.

Each :class:`Branch` equals an independent run of its request alone, token for token: same tokens, same
chunk boundaries, same compression point (tests/test_runner.py, tests/test_engine.py). The question of a
query-agnostic branch is left for the engine to feed (``Branch.question``), so branches that decode
together ask it in one batched forward.

With ``prefill_metrics`` a recipe whose prefill policy ``reports_prefill_metrics`` records the density,
attention recall and output error of every prefill chunk per layer and head
(:class:`~longlab.sparse.prefill.PrefillMetrics`); the time spent measuring is left out of ``prefill_s``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..recipe import Method, Recipe
from .planner import PrefixGroup, compresses_every_chunk, plan, replayable

if TYPE_CHECKING:
    from ..sparse.prefill import PrefillMetrics

__all__ = ["Branch", "PromptGroup", "prefill_group"]


@dataclass
class PromptGroup:
    """Requests sharing one prompt: context ids ``ctx``, question ids ``q`` and the prefill settings."""

    ctx: list[int]
    q: list[int]
    chunk_size: int
    query_aware: bool
    compress: str
    metric_rows: int  # 0: no prefill metrics
    members: list[tuple[Any, Recipe]] = field(default_factory=list)  # (request handle, recipe)
    question_text: str | None = None  # the question, for compressors that read it


@dataclass
class Branch:
    """One request's fork of its group's shared prefix, compressed, ready to decode."""

    key: Any
    recipe: Recipe
    stream: Any
    logits: Any  # [1, V] next-token logits (after the question unless ``question`` is still to feed)
    context_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    extra: dict[str, Any]
    metrics: PrefillMetrics | None = None
    question: list[int] | None = None  # question ids still to feed (query-agnostic)
    squeeze: Any = None  # the recipe's context compression (longlab.compress.api.Squeeze), or None


def prefill_group(
    model: Any, tokenizer: Any, group: PromptGroup, pad_id: int, known: dict[str, frozenset[str]]
) -> Iterator[Branch]:
    """Branches of every member of ``group`` (in the order their prefixes complete). ``known``: observer
    key -> state keys it writes, shared across calls (learnt as groups run)."""
    from ..compress.api import compress_prompts

    by_compressor: dict[str, tuple[Method | None, list[tuple[Any, Recipe]]]] = {}
    for key, recipe in group.members:
        by_compressor.setdefault(repr(recipe.context), (recipe.context, []))[1].append((key, recipe))
    for method, members in by_compressor.values():
        if method is None:
            yield from _run(model, group, members, group.ctx, pad_id, known, None)
            continue
        squeeze = compress_prompts(model, tokenizer, method, [group.ctx], [group.q], [group.question_text])
        with squeeze.applied(model):
            branches = list(_run(model, group, members, squeeze.ids[0], pad_id, known, squeeze))
        yield from branches  # each carries ``squeeze``: its record is read when the row finishes


def _run(
    model: Any,
    group: PromptGroup,
    members: Sequence[tuple[Any, Recipe]],
    ctx: list[int],
    pad_id: int,
    known: dict[str, frozenset[str]],
    squeeze: Any,
) -> Iterator[Branch]:
    """Branches of ``members`` on context ids ``ctx``: prefix groups planned, prefilled once each; members
    spoilt by an observer collision run again from their own prefix."""
    pending = list(members)
    while pending:
        rerun: list[tuple[Any, Recipe]] = []
        for pg in plan(
            pending, len(ctx), len(group.q), group.chunk_size, group.query_aware, known, group.compress
        ):
            yield from _run_prefix(model, group, pg, ctx, pad_id, rerun, squeeze)
        if rerun == pending:  # cannot happen (a lone recipe is always safe); never loop
            raise RuntimeError(f"prefix sharing failed for {[r.name for _, r in rerun]}")
        pending = rerun


def _new_metrics(group: PromptGroup, prefill: Method | None) -> PrefillMetrics | None:
    """A quality collector for a sparse prefill policy when prefill metrics are on, else None."""
    from ..sparse.prefill import PrefillMetrics

    if not group.metric_rows or prefill is None or not prefill.reports_prefill_metrics:
        return None
    return PrefillMetrics(group.metric_rows)


def _run_prefix(
    model: Any,
    group: PromptGroup,
    pg: PrefixGroup,
    ctx: list[int],
    pad_id: int,
    rerun: list[tuple[Any, Recipe]],
    squeeze: Any,
) -> Iterator[Branch]:
    """Prefill the prefix group's shared prefix once, then branch and compress every member."""
    from ..cache import LonglabCache
    from ..sparse.prefill import collect_prefill_metrics
    from .stream import Stream

    observer = Recipe(prefill=pg.prefill, kv=list(pg.observers.values()))  # type: ignore[list-item]
    shared = Stream(model, LonglabCache(observer), 1)
    shared.pad_id = pad_id
    metrics = _new_metrics(group, pg.prefill)
    t0 = time.perf_counter()
    if pg.start > 0:
        with collect_prefill_metrics(metrics):
            shared.feed([ctx[: pg.start]], group.chunk_size, compress="none")
    shared_s = time.perf_counter() - t0 - (metrics.seconds if metrics is not None else 0.0)
    pg.learn()
    spoilt = pg.unsafe()
    rerun.extend(m for m in pg.recipes if m[0] in spoilt)
    members = [m for m in pg.recipes if m[0] not in spoilt]
    common = {
        "shared_prefill_s": shared_s,
        "shared_prefill_tokens": pg.start,
        "shared_by": len(members),
        "tail_tokens": len(ctx) - pg.start,
        "question_tokens": len(group.q),
        "chunk_size": group.chunk_size,
    }
    own = [replayable(r) and not compresses_every_chunk(r, group.compress) for _, r in members]
    direct = [m for m, shared_tail in zip(members, own) if not shared_tail]
    replayed = [m for m, shared_tail in zip(members, own) if shared_tail]
    # direct members fork before the shared stream takes the tail (a chain consumes them first)
    branches = (_branch(group, shared, pg, k, r, ctx, common, metrics, squeeze) for k, r in direct)
    if replayed:
        branches = itertools.chain(
            branches, _replay(group, shared, pg, replayed, ctx, common, metrics, squeeze)
        )
    for branch in branches:
        if not (group.query_aware and group.q) and group.q:
            branch.question = list(group.q)
        yield branch


def _replay(
    group: PromptGroup,
    shared: Any,
    pg: PrefixGroup,
    members: list[tuple[Any, Recipe]],
    ctx: list[int],
    common: dict[str, Any],
    shared_metrics: PrefillMetrics | None,
    squeeze: Any,
) -> Iterator[Branch]:
    """Feed the tail once into the shared stream, recording what its last chunk's compression step
    sees, then fork per recipe and replay only the compression
    (:func:`longlab.hook.replay_compression`): the same cache as feeding the tail per recipe."""
    from ..hook import ChunkRecorder, replay_compression
    from ..sparse.prefill import collect_prefill_metrics
    from .planner import batchable

    observers = shared.cache.recipe
    recorder = ChunkRecorder()
    shared.cache.recipe = Recipe(prefill=observers.prefill, kv=[*observers.kv, recorder])
    measured = shared_metrics.seconds if shared_metrics is not None else 0.0
    tail = ctx[pg.start :]
    rows = [tail + group.q] if group.query_aware and group.q else [tail]
    t0 = time.perf_counter()
    try:
        with collect_prefill_metrics(shared_metrics):
            logits = shared.feed(rows, group.chunk_size, compress="end")  # [1, V], for every recipe
    finally:
        shared.cache.recipe = observers  # the records stay out of every fork
    tail_s = time.perf_counter() - t0
    if shared_metrics is not None:
        tail_s -= shared_metrics.seconds - measured
    for key, recipe in members:
        # a branch that only evicts (new tensors) before it is stacked may share the buffers
        stream, fork_s = _fork(shared, pg, recipe, share=batchable(recipe))
        replay_compression(stream.cache, recorder.records)
        before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
        compress_s = float(stream.cache.stats["compress_s"])
        extra = {**common, "fork_s": fork_s, "shared_tail_s": tail_s, "replayed": True}
        metrics = shared_metrics.copy() if shared_metrics is not None else None
        if metrics is not None:
            extra["metrics_s"] = metrics.seconds
        # prefix and tail were paid once for the group; each row counts them in full
        prefill_s = common["shared_prefill_s"] + tail_s + fork_s
        yield Branch(
            key,
            recipe,
            stream,
            logits,
            len(ctx),
            before,
            after,
            prefill_s,
            compress_s,
            extra,
            metrics,
            squeeze=squeeze,
        )


def _branch(
    group: PromptGroup,
    shared: Any,
    pg: PrefixGroup,
    key: Any,
    recipe: Recipe,
    ctx: list[int],
    common: dict[str, Any],
    shared_metrics: PrefillMetrics | None,
    squeeze: Any,
) -> Branch:
    """Fork the shared prefix into ``recipe`` and feed the tail (compressing once at its end, or after
    every chunk under ``compress="chunk"``, where the prefix is empty)."""
    from ..compress.api import prefill_rows  # stream.feed, or a context part's own prefill (hico-forward)
    from ..sparse.prefill import collect_prefill_metrics

    metrics = shared_metrics.copy() if shared_metrics is not None else _new_metrics(group, recipe.prefill)
    measured = metrics.seconds if metrics is not None else 0.0
    stream, fork_s = _fork(shared, pg, recipe)
    tail = ctx[pg.start :]
    t0 = time.perf_counter()
    rows = [tail + group.q] if group.query_aware and group.q else [tail]
    with collect_prefill_metrics(metrics):
        compress = "chunk" if compresses_every_chunk(recipe, group.compress) else "end"
        logits = prefill_rows(recipe, stream, rows, group.chunk_size, compress=compress, squeeze=squeeze)
    before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
    tail_s = time.perf_counter() - t0 - (metrics.seconds - measured if metrics is not None else 0.0)
    compress_s = float(stream.cache.stats["compress_s"])
    extra = {**common, "fork_s": fork_s, "compress_calls": int(stream.cache.stats["compress_calls"])}
    if metrics is not None:
        extra["metrics_s"] = metrics.seconds  # measuring time, not in prefill_s
    # the shared prefix counts in full for every row (what this row cost on its own);
    # extra.shared_prefill_s says how much of it was paid once for shared_by rows
    prefill_s = common["shared_prefill_s"] + fork_s + tail_s - compress_s
    return Branch(
        key,
        recipe,
        stream,
        logits,
        len(ctx),
        before,
        after,
        prefill_s,
        compress_s,
        extra,
        metrics,
        squeeze=squeeze,
    )


def _fork(shared: Any, pg: PrefixGroup, recipe: Recipe, share: bool = False) -> tuple[Any, float]:
    """A copy of the shared stream under ``recipe`` keeping only the observer state the recipe owns,
    and the seconds the copy took. ``share``: copy on write (the recipe never writes into held slots)."""
    t0 = time.perf_counter()
    stream = shared.fork(recipe, share=share)
    keep = pg.owned_state(recipe)
    for layer in stream.cache.layers:
        layer.extras = {k: v for k, v in layer.extras.items() if k in keep}
    return stream, time.perf_counter() - t0
