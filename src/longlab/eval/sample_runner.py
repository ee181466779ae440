"""The sample runner: one sample under many recipes, its context prefilled once.

For one sample the expensive part, the prefill of its context, is shared by every recipe:

1. the prompt is tokenized once (:func:`longlab.pipeline.encode_prompts`);
2. the recipes are grouped by shared prefix (:mod:`longlab.eval.planner`); every context token before
   the *tail* is fed once, uncompressed (``compress="none"``), into a
   :class:`~longlab.pipeline.Stream` whose recipe holds each observing KV policy of the group
   (``needs_observe``, e.g. H2O's accumulated attention), so their state covers the shared prefix;
3. the tail is fed once too, with ``compress="end"`` (query-aware: tail + question), while a
   :class:`~longlab.hook.ChunkRecorder` keeps what each layer's compression step sees (the last
   chunk's queries and attention output);
4. each recipe gets a fork of that stream (:meth:`Stream.fork`), keeps only the observer state it
   owns, and replays the compression step alone (:func:`~longlab.hook.replay_compression`), then
   feeds the question (query-agnostic) and decodes greedily. A recipe whose KV policy computes
   attention itself while the tail is prefilled (``reads_attention``, e.g. a latent memory) instead
   forks before the tail and feeds it with its own recipe.

A row equals an independent ``generate(..., compress="end")`` run token for token: same tokens, same
chunk boundaries, same compression point (tests/test_runner.py).

With ``prefill_metrics`` (``--prefill-metrics``) a recipe whose prefill policy
``reports_prefill_metrics`` also records the density, attention recall and output error of every
prefill chunk per layer and head (:class:`~longlab.sparse.prefill.PrefillMetrics`: the shared prefix's,
copied into each branch, plus the branch's own tail and question); they go to the store's ``metrics``
table under the row's ``run_key``, and the time spent measuring is left out of ``prefill_s``.
With ``batch_decode`` (the default) the branches of a sample whose recipes are
:func:`~longlab.eval.planner.batchable` and whose cache layers are ``batchable`` are stacked as batch
rows of one cache (padded with empty slots), ask the question and decode together; a row that emits
EOS leaves the batch (:meth:`Stream.decode`), so the batch costs what its rows still need. The tokens
are those of one stream per recipe (tests/test_runner.py), several times cheaper.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..recipe import Method, Recipe, parse_recipe
from .config import EvalConfig
from .planner import PrefixGroup, batchable, compresses_every_chunk, plan, replayable

if TYPE_CHECKING:
    from ..sparse.prefill import PrefillMetrics

__all__ = ["METRICS_KEY", "SampleRunner", "recipe_columns"]

METRICS_KEY = "metrics"  # a yielded row's metric items (popped before the row is stored)


def recipe_columns(recipe: Recipe) -> tuple[str, float | None]:
    """(method, compression_ratio) of a recipe: its last eviction policy other than ``full``, else
    its quantizer, else its prefill policy; ``full`` is ratio 0, a fixed budget has no ratio."""
    evict = [p for p in recipe.kv if p.kind == "kv" and p.name != "full"]
    if evict:
        p = evict[-1]
        return p.name, (None if p.budget is not None else float(p.compression_ratio))
    quant = [p for p in recipe.kv if p.kind != "kv"]
    if quant:
        return quant[-1].name, None
    if recipe.prefill is not None:
        return recipe.prefill.name, None
    if recipe.context is not None:  # a context compressor alone (longlab.compress)
        return recipe.context.name, float(recipe.context.compression_ratio)
    return "full", 0.0


class SampleRunner:
    """Evaluates samples under many recipes with one model, one shared prefill per sample."""

    def __init__(
        self, model: Any, tokenizer: Any, config: EvalConfig, config_hash: str, backend: str = "serial"
    ) -> None:
        from ..pipeline import eos_token_ids

        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.config_hash = config_hash
        self.backend = backend
        self.eos = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._state_keys: dict[str, frozenset[str]] = {}  # observer key -> extras keys it writes

    def identity(self, sample: Any, recipe: str) -> dict[str, Any]:
        """The store's key fields of one grid cell."""
        return {
            "model": self.config.model, "recipe": recipe, "task": sample.task, "length": sample.length,
            "sample_id": sample.sample_id, "query_aware": self.config.query_aware, "seed": self.config.seed,
            "config_hash": self.config_hash,
        }

    def run(self, sample: Any, recipes: Sequence[str]) -> Iterator[dict[str, Any]]:
        """Rows of ``sample`` under each recipe, yielded as each one finishes (as each batch with
        ``batch_decode``)."""
        from ..pipeline import encode_prompts

        layout = sample.metadata.get("prompt", True)  # a layout of longlab.prompt.LAYOUTS, e.g. "plain"
        prompt = encode_prompts(
            self.tokenizer, [sample.context], [sample.question], [sample.answer_prefix], layout
        )
        (ctx,), (q,) = prompt  # token ids of the context part and of the question part
        from ..compress.api import compressed_rows  # a context compressor's recipes run on its shorter ids

        yield from compressed_rows(
            self.model, self.tokenizer, sample, recipes, ctx, q,
            lambda names, ids, squeeze: self._run_recipes(sample, names, ids, q, squeeze),
        )

    def _run_recipes(
        self, sample: Any, recipes: Sequence[str], ctx: list[int], q: list[int], squeeze: Any = None
    ) -> Iterator[dict[str, Any]]:
        """Rows of ``sample`` under ``recipes`` with context ids ``ctx``, prefix groups planned here;
        ``squeeze``: the recipes' context compression (:func:`longlab.compress.api.compressed_rows`)."""
        pending = list(recipes)
        while pending:
            rerun: list[str] = []
            for group in self._plan(pending, ctx, q):
                yield from self._run_group(sample, group, ctx, q, rerun, squeeze)
            if rerun == pending:  # cannot happen (a lone recipe is always safe); never loop
                raise RuntimeError(f"prefix sharing failed for {rerun}")
            pending = rerun

    def _plan(self, recipes: Sequence[str], ctx: list[int], q: list[int]) -> list[PrefixGroup]:
        """Group recipes by shared prefix (first fit)."""
        cfg = self.config
        parsed = [(name, parse_recipe(name)) for name in recipes]
        return plan(
            parsed, len(ctx), len(q), cfg.chunk_size, cfg.query_aware, self._state_keys, cfg.compress
        )

    def _run_group(
        self, sample: Any, group: PrefixGroup, ctx: list[int], q: list[int], rerun: list[str],
        squeeze: Any = None,
    ) -> Iterator[dict[str, Any]]:
        """Prefill the group's shared prefix once, then branch, compress and decode every member;
        members spoilt by an observer collision are appended to ``rerun`` instead."""
        from ..cache import LonglabCache
        from ..pipeline import Stream
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        observer = Recipe(prefill=group.prefill, kv=list(group.observers.values()))  # type: ignore[list-item]
        shared = Stream(self.model, LonglabCache(observer), 1)
        shared.pad_id = self.pad_id
        metrics = self._new_metrics(group.prefill)
        t0 = time.perf_counter()
        if group.start > 0:
            with collect_prefill_metrics(metrics):
                shared.feed([ctx[: group.start]], cfg.chunk_size, compress="none")
        shared_s = time.perf_counter() - t0 - (metrics.seconds if metrics is not None else 0.0)
        group.learn()
        spoilt = group.unsafe()
        rerun.extend(name for name, _ in group.recipes if name in spoilt)
        members = [(name, recipe) for name, recipe in group.recipes if name not in spoilt]
        common = {
            "shared_prefill_s": shared_s, "shared_prefill_tokens": group.start,
            "shared_by": len(members), "tail_tokens": len(ctx) - group.start,
            "question_tokens": len(q), "chunk_size": cfg.chunk_size, "backend": self.backend,
        }
        batch: list[_Branch] = []
        own = [replayable(r) and not compresses_every_chunk(r, cfg.compress) for _, r in members]
        direct = [member for member, shared_tail in zip(members, own) if not shared_tail]
        replayed = [member for member, shared_tail in zip(members, own) if shared_tail]
        # direct members fork before the shared stream takes the tail (a chain consumes them first)
        branches = (self._branch(shared, group, n, r, ctx, q, common, metrics, squeeze) for n, r in direct)
        if replayed:
            branches = itertools.chain(
                branches, self._replay_branches(shared, group, replayed, ctx, q, common, metrics)
            )
        for branch in branches:
            recipe = branch.recipe
            if cfg.batch_decode and batchable(recipe):
                batch.append(branch)
                continue
            if not (cfg.query_aware and q) and q:
                measured = branch.metrics.seconds if branch.metrics is not None else 0.0
                t0 = time.perf_counter()
                with collect_prefill_metrics(branch.metrics):
                    branch.logits = branch.stream.feed([q], cfg.chunk_size, compress="none")
                branch.prefill_s += time.perf_counter() - t0
                if branch.metrics is not None:
                    branch.prefill_s -= branch.metrics.seconds - measured
            yield from self._decode(sample, [branch], squeeze=squeeze)
        if batch:
            yield from self._decode_batch(sample, batch, q)

    def _replay_branches(
        self, shared: Any, group: PrefixGroup, members: list[tuple[str, Recipe]], ctx: list[int],
        q: list[int], common: dict[str, Any], shared_metrics: PrefillMetrics | None,
    ) -> Iterator[_Branch]:
        """Feed the tail once into the shared stream, recording what its last chunk's compression step
        sees, then fork per recipe and replay only the compression
        (:func:`longlab.hook.replay_compression`): the same cache as feeding the tail per recipe."""
        from ..hook import ChunkRecorder, replay_compression
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        observers = shared.cache.recipe
        recorder = ChunkRecorder()
        shared.cache.recipe = Recipe(prefill=observers.prefill, kv=[*observers.kv, recorder])
        measured = shared_metrics.seconds if shared_metrics is not None else 0.0
        tail = ctx[group.start:]
        rows = [tail + q] if cfg.query_aware and q else [tail]
        t0 = time.perf_counter()
        try:
            with collect_prefill_metrics(shared_metrics):
                logits = shared.feed(rows, cfg.chunk_size, compress="end")  # [1, V], for every recipe
        finally:
            shared.cache.recipe = observers  # the records stay out of every fork
        tail_s = time.perf_counter() - t0
        if shared_metrics is not None:
            tail_s -= shared_metrics.seconds - measured
        for name, recipe in members:
            # a batched branch only evicts (new tensors) before it is stacked: share the buffers
            stream, fork_s = _fork(shared, group, recipe, share=cfg.batch_decode and batchable(recipe))
            replay_compression(stream.cache, recorder.records)
            before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
            compress_s = float(stream.cache.stats["compress_s"])
            extra = {**common, "fork_s": fork_s, "shared_tail_s": tail_s, "replayed": True}
            metrics = shared_metrics.copy() if shared_metrics is not None else None
            if metrics is not None:
                extra["metrics_s"] = metrics.seconds
            # prefix and tail were paid once for the group; each row counts them in full
            prefill_s = common["shared_prefill_s"] + tail_s + fork_s
            yield _Branch(
                name, recipe, stream, logits, len(ctx), before, after, prefill_s, compress_s, extra, metrics
            )

    def _new_metrics(self, prefill: Method | None) -> PrefillMetrics | None:
        """A quality collector for a sparse prefill policy when ``prefill_metrics`` is on, else None."""
        from ..sparse.prefill import PrefillMetrics

        if not self.config.prefill_metrics or prefill is None or not prefill.reports_prefill_metrics:
            return None
        return PrefillMetrics(self.config.metric_rows)

    def _branch(
        self, shared: Any, group: PrefixGroup, name: str, recipe: Recipe, ctx: list[int], q: list[int],
        common: dict[str, Any], shared_metrics: PrefillMetrics | None = None, squeeze: Any = None,
    ) -> _Branch:
        """Fork the shared prefix into ``recipe`` and feed the tail (compressing once, at its end)."""
        from ..compress.api import prefill_rows  # stream.feed, or a context part's own prefill (hico-forward)
        from ..sparse.prefill import collect_prefill_metrics

        cfg = self.config
        metrics = shared_metrics.copy() if shared_metrics is not None else self._new_metrics(recipe.prefill)
        measured = metrics.seconds if metrics is not None else 0.0
        stream, fork_s = _fork(shared, group, recipe)
        tail = ctx[group.start:]
        t0 = time.perf_counter()
        rows = [tail + q] if cfg.query_aware and q else [tail]
        with collect_prefill_metrics(metrics):
            # compress="end" (the default), or after every chunk with --compress chunk (then start = 0)
            compress = "chunk" if compresses_every_chunk(recipe, cfg.compress) else "end"
            logits = prefill_rows(recipe, stream, rows, cfg.chunk_size, compress=compress, squeeze=squeeze)
        before, after = stream.cache.full_nbytes(), stream.cache.nbytes()
        tail_s = time.perf_counter() - t0 - (metrics.seconds - measured if metrics is not None else 0.0)
        compress_s = float(stream.cache.stats["compress_s"])
        extra = {**common, "fork_s": fork_s, "compress_calls": int(stream.cache.stats["compress_calls"])}
        if metrics is not None:
            extra["metrics_s"] = metrics.seconds  # measuring time, not in prefill_s (question added later)
        # the shared prefix counts in full for every row (what this row cost on its own);
        # extra.shared_prefill_s says how much of it was paid once for shared_by rows
        prefill_s = common["shared_prefill_s"] + fork_s + tail_s - compress_s
        return _Branch(
            name, recipe, stream, logits, len(ctx), before, after, prefill_s, compress_s, extra, metrics
        )

    def _decode(
        self, sample: Any, branches: list[_Branch], stream: Any = None, squeeze: Any = None
    ) -> Iterator[dict[str, Any]]:
        """Decode greedily (one stream per branch, or ``stream`` holding them all as batch rows)."""
        import torch

        from ..tasks import score_sample
        from .store import peak_rss_mb, run_key_of

        max_new = self.config.max_new_for(sample.max_new_tokens)
        if stream is None:
            (branch,) = branches
            stream, logits = branch.stream, branch.logits
        else:
            logits = torch.cat([b.logits for b in branches])  # [B, V]
        t0 = time.perf_counter()
        from ..compress.api import decode_rows  # guided decoding (longlab.compress.guidance), else plain

        token_rows = decode_rows([b.recipe for b in branches], stream, logits, max_new, self.eos,
                                 squeeze=squeeze, drop_finished=True)
        decode_s = time.perf_counter() - t0
        for branch, tokens in zip(branches, token_rows):
            prediction = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            method, ratio = recipe_columns(branch.recipe)
            row: dict[str, Any] = {
                **self.identity(sample, branch.name),
                "method": method, "compression_ratio": ratio, "depth": sample.depth,
                "prediction": prediction, "answers": list(sample.answers),
                "score": score_sample(sample, prediction),
                "prefill_s": branch.prefill_s, "compress_s": branch.compress_s, "decode_s": decode_s,
                "kv_bytes_before": branch.kv_bytes_before, "kv_bytes_after": branch.kv_bytes_after,
                "peak_rss_mb": peak_rss_mb(), "context_tokens": branch.context_tokens,
                "recipe_repr": "; ".join(repr(m) for m in branch.recipe.methods),
                "extra": {
                    **branch.extra, "generated_tokens": len(tokens), "max_new_tokens": max_new,
                    "decode_batch": len(branches),
                },
            }
            row["run_key"] = run_key_of(row)
            if branch.metrics is not None:
                row["extra"]["metrics_s"] = branch.metrics.seconds
                row[METRICS_KEY] = branch.metrics.items()
            yield row

    def _decode_batch(self, sample: Any, batch: list[_Branch], q: list[int]) -> Iterator[dict[str, Any]]:
        """Stack the branches' caches as batch rows, ask the question once, decode them together.

        Each branch's tokens are computed as in its own stream up to float rounding (batched matmuls,
        padded empty slots); only recipes without decode-time behaviour are batched."""
        cfg = self.config
        plain = [b for b in batch if all(layer.batchable for layer in b.stream.cache.layers)]
        for branch in batch:
            if branch not in plain:  # storage of another kind (e.g. converted by a policy): decode alone
                if not (cfg.query_aware and q) and q:
                    branch.logits = branch.stream.feed([q], cfg.chunk_size, compress="none")
                yield from self._decode(sample, [branch])
        if not plain:
            return
        batch = plain
        ask = len(q) if not (cfg.query_aware and q) else 0
        reserve = ask + self.config.max_new_for(sample.max_new_tokens)
        stream = _stack([b.stream for b in batch], reserve)
        for b in batch:
            b.stream = None  # free the per-branch caches
        if not (cfg.query_aware and q) and q:
            t0 = time.perf_counter()
            logits = stream.feed([q] * len(batch), cfg.chunk_size, compress="none")  # [B, V]
            question_s = time.perf_counter() - t0
            for i, b in enumerate(batch):
                b.logits = logits[i : i + 1]
                b.prefill_s += question_s
                b.extra["batched_question_s"] = question_s
        yield from self._decode(sample, batch, stream)


@dataclass
class _Branch:
    """One recipe's fork of a sample's shared prefix, compressed, ready to decode."""

    name: str
    recipe: Recipe
    stream: Any
    logits: Any  # [1, V] next-token logits
    context_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    extra: dict[str, Any]
    metrics: PrefillMetrics | None = None  # sparse-prefill quality (with ``prefill_metrics``)


def _fork(shared: Any, group: PrefixGroup, recipe: Recipe, share: bool = False) -> tuple[Any, float]:
    """A copy of the shared stream under ``recipe`` keeping only the observer state the recipe owns,
    and the seconds the copy took. ``share``: copy on write (the recipe never writes into held slots)."""
    t0 = time.perf_counter()
    stream = shared.fork(recipe, share=share)
    keep = group.owned_state(recipe)
    for layer in stream.cache.layers:
        layer.extras = {k: v for k, v in layer.extras.items() if k in keep}
    return stream, time.perf_counter() - t0


def _stack(streams: list[Any], reserve: int = 0) -> Any:
    """One stream whose batch rows are ``streams`` (each of batch 1, same tokens seen), under the
    empty recipe (:meth:`LonglabLayer.stacked`: leading empty slots pad the shorter rows, which
    attention skips per row; ``reserve`` spare slots for the question and the answer)."""
    import torch

    from ..cache import LonglabCache, LonglabLayer
    from ..pipeline import Stream

    cache = LonglabCache(None)
    layers = [LonglabLayer.stacked(list(rows), reserve) for rows in zip(*(s.cache.layers for s in streams))]
    cache.layers = layers
    first = streams[0]
    stacked = Stream(first.model, cache, len(streams))
    stacked.pad_id = first.pad_id
    stacked.seen_mask = torch.cat([s.seen_mask for s in streams])  # [B, n_seen]
    stacked.next_pos = torch.cat([s.next_pos for s in streams])  # [B]
    return stacked
