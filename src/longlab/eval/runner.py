"""One sample under every cell of the grid: requests to the engine, results into rows.

:class:`SampleRunner` turns a sample and its cells (:class:`~longlab.eval.config.Cell`: recipe, reuse
method, speculative config) into :class:`~longlab.request.Request` objects, runs them through one
:class:`~longlab.engine.Engine` (the cells of a sample share its prefill; rows that can decode together do),
and turns each :class:`~longlab.engine.Result` into a store row with one function (:meth:`row`). Rows of
the speculative axis carry their speed and bytes against the plain cell of the same recipe; rows scored by
teacher forcing (``--score forced``) carry their agreement with the full-cache reference.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..recipe import Recipe, parse_recipe
from ..request import Request
from .config import Cell, EvalConfig

__all__ = ["METRICS_KEY", "SampleRunner", "forced_kl", "recipe_columns"]

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
    """Evaluates samples under many cells with one model: one engine, one shared prefill per sample."""

    def __init__(self, model: Any, tokenizer: Any, config: EvalConfig, config_hash: str | dict[str, str],
                 backend: str = "serial") -> None:
        from ..engine import Engine

        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.hashes = config_hash if isinstance(config_hash, dict) else {"none": config_hash}
        self.backend = backend
        self.engine = Engine(model, tokenizer)

    def identity(self, sample: Any, cell: Cell | str, position: str = "none") -> dict[str, Any]:
        """The store's key fields of one grid cell."""
        cell = _as_cell(cell)
        return {
            "model": EvalConfig.label_of(self.config.model, position), "recipe": cell.label,
            "task": sample.task,
            "length": sample.length, "sample_id": sample.sample_id,
            "query_aware": self.config.query_aware or cell.reuse is not None, "seed": self.config.seed,
            "config_hash": self.hashes.get(position, self.hashes.get("none")),
        }

    def request(self, sample: Any, cell: Cell, position: str = "none") -> Request:
        """The request of one cell of ``sample``."""
        cfg = self.config
        docs = sample.metadata.get("documents") if cell.reuse is not None else None
        forced = cfg.score == "forced"
        return Request(
            context=None if docs else sample.context, documents=docs, question=sample.question,
            answer_prefix=sample.answer_prefix, recipe=cell.recipe, reuse=cell.reuse,
            speculative=cell.speculative, verify=cell.verify, gamma=cfg.gamma if cell.speculative else None,
            position=None if position == "none" else position,
            query_aware=cfg.query_aware if not docs else False,
            compress=cfg.compress if not docs else "chunk", chunk_size=cfg.chunk,
            max_new_tokens=cfg.max_new_for(sample.max_new_tokens), strict=cfg.strict,
            chat_template=sample.metadata.get("prompt", True),  # a layout of prompt.LAYOUTS, e.g. "plain"
            continuation=sample.answers[0] if forced and sample.answers else None,
            batch_decode=cfg.decode_in_batch,
            prefill_metrics=(cfg.metric_rows or 32) if cfg.prefill_metrics else 0,
            id=cell.label,
        )

    def run(self, sample: Any, cells: Sequence[Cell | str],
            position: str = "none") -> Iterator[dict[str, Any]]:
        """Rows of ``sample`` under each cell, yielded as they finish (a speculative cell's row after its
        plain reference's, a forced-scored row after the reference's)."""
        cells = [_as_cell(c) for c in cells]
        wanted = {c.label for c in cells}
        extra = self._references(cells)
        by_label = {c.label: c for c in [*cells, *extra]}
        requests = [self.request(sample, c, position) for c in by_label.values()]
        results: dict[str, Any] = {}
        waiting: list[tuple[Cell, Any]] = []
        for res in self.engine.results(requests):
            cell = by_label[res.request.id]
            results[cell.label] = res
            ready = [(c, r) for c, r in [*waiting, (cell, res)] if self._reference_of(c) in results]
            waiting = [(c, r) for c, r in [*waiting, (cell, res)] if self._reference_of(c) not in results]
            for c, r in ready:
                if c.label in wanted:
                    yield self.row(sample, c, r, results.get(self._reference_of(c)), position)
        for c, r in waiting:  # references that were not in this run
            if c.label in wanted:
                yield self.row(sample, c, r, None, position)

    def _reference_of(self, cell: Cell) -> str:
        """The label whose result a cell's row is compared with (its own label: none needed)."""
        if cell.speculative is not None:
            return cell.plain_label
        if self.config.score == "forced":
            return "full"
        return cell.label

    def _references(self, cells: list[Cell]) -> list[Cell]:
        """Reference cells a comparison needs that are not in ``cells`` (run, not stored)."""
        labels = {c.label for c in cells}
        out: list[Cell] = []
        for c in cells:
            ref = self._reference_of(c)
            if ref not in labels and ref not in {x.label for x in out}:
                reuse = None if c.reuse is None else "full-prefill"
                recipe = parse_recipe(ref.split("~", 1)[0]).name if c.speculative else "full"
                out.append(Cell(ref, recipe, reuse))
        return out

    def row(self, sample: Any, cell: Cell, res: Any, ref: Any, position: str = "none") -> dict[str, Any]:
        """The store row of one result (``ref``: its reference cell's result, or None)."""
        from ..tasks import score_sample
        from .identity import peak_rss_mb, run_key_of

        recipe = parse_recipe(cell.recipe)
        method, ratio = recipe_columns(recipe)
        if res.forced is not None:
            score = float(res.forced == res.forced_ids)
        else:
            score = score_sample(sample, res.text)
        extra = {**res.extra, "backend": self.backend, "prompt_tokens": res.prompt_tokens}
        if res.cache is not None:  # decoded alone: the cache after its last token (a batched row has none)
            extra["kv_bytes_end"] = int(res.cache.nbytes())
        numbers = {k: v for k, v in (sample.metadata or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:  # the sample's own counts (e.g. lookup_chain's steps), for the tables that read them
            extra["sample"] = numbers
        if cell.reuse is not None:
            extra.update(reuse=res.request.parsed.reuse.spec, kv_recipe=recipe.name,
                         num_docs=len(sample.metadata.get("documents") or ()))
        if res.forced is not None:
            extra["score_mode"] = "forced"
            extra["answer_nll"] = answer_nll(res.forced_logprobs, res.forced_ids)
            if ref is not None and ref.forced is not None:
                extra["fidelity"] = sum(a == b for a, b in zip(res.forced, ref.forced)) / len(res.forced)
                extra["kl_vs_full"] = forced_kl(ref.forced_logprobs, res.forced_logprobs)
        if cell.speculative is not None or (self.config.speculative and ref is res):
            extra.update(_speed(res, ref))
        row: dict[str, Any] = {
            **self.identity(sample, cell, position),
            "method": method, "compression_ratio": ratio, "depth": sample.depth,
            "prediction": res.text, "answers": list(sample.answers), "score": score,
            "prefill_s": res.prefill_s, "compress_s": res.compress_s, "decode_s": res.decode_s,
            "kv_bytes_before": res.kv_bytes_before, "kv_bytes_after": res.kv_bytes_after,
            "peak_rss_mb": peak_rss_mb(), "context_tokens": res.context_tokens,
            "recipe_repr": "; ".join(repr(m) for m in recipe.methods) + _spec_repr(res),
            "extra": extra,
        }
        row["run_key"] = run_key_of(row)
        if res.metrics is not None:
            row["extra"]["metrics_s"] = res.metrics.seconds
            row[METRICS_KEY] = res.metrics.items()
        return row


def answer_nll(logprobs: Any, ids: list[int]) -> float | None:
    """Mean negative log-likelihood per token of a teacher-forced answer, in nats: ``-1/T sum_t
    log p_t(ids[t])``, ``logprobs``: ``[T, V]`` (``Result.forced_logprobs``). ``None`` when missing."""
    if logprobs is None or not ids:
        return None
    import torch

    index = torch.tensor(ids, dtype=torch.long)[:, None]
    return float(-logprobs.float().gather(-1, index).mean())


def forced_kl(reference: Any, other: Any) -> float | None:
    """Mean over the continuation's positions of KL(reference || other) of the next-token distributions,
    in nats; ``reference``, ``other``: ``[T, V]`` log-probabilities (``Result.forced_logprobs``) of two
    recipes teacher-forced on the same tokens. ``None`` when either is missing."""
    if reference is None or other is None:
        return None
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def _as_cell(cell: Cell | str) -> Cell:
    """A cell, or a recipe name as the plain cell of that recipe."""
    return Cell(cell, cell) if isinstance(cell, str) else cell


def _spec_repr(res: Any) -> str:
    parsed = res.request.parsed
    if parsed.draft is None:
        return ""
    return f"; {parsed.draft!r}; {parsed.verifier!r}; gamma={res.request.gamma}"


def _read_bytes(res: Any) -> float:
    """K/V bytes a plain decode read for its tokens (every held slot of every layer, every step)."""
    from ..spec.slot_attention import kv_slot_bytes

    cache, n = res.cache, len(res.token_ids)
    total = 0.0
    for layer in getattr(cache, "layers", ()):
        if layer.is_initialized:
            T0, slot = layer.index.shape[-1] - (n - 1), kv_slot_bytes(layer)
            total += sum((T0 + i + 1) * slot for i in range(n - 1))
    return total


def _speed(res: Any, plain: Any) -> dict[str, Any]:
    """A speculative row's counters and its speed and bytes against plain decoding of the same prompt
    (decoded alone in the same run); the plain row's own (ratio 1)."""
    n = max(1, len(res.token_ids))
    info = res.speculation or {}
    read = info["target_kv_bytes"] + info["draft_kv_bytes"] if info else _read_bytes(res)
    out = {
        "spec": info.get("spec", "plain"), "acceptance_rate": info.get("acceptance_rate"),
        "tokens_per_forward": info.get("tokens_per_forward", 1.0),
        "decode_tokens_per_s": n / max(res.decode_s, 1e-9), "kv_bytes_read_per_token": read / n,
        "drafted": info.get("drafted", 0), "accepted": info.get("accepted", 0),
        "target_forwards": info.get("steps", n), "draft_forwards": info.get("draft_forwards", 0),
        "load_1m": os.getloadavg()[0],
    }
    if plain is not None:
        m = max(1, len(plain.token_ids))
        plain_read = _read_bytes(plain) / m
        out["speed_vs_plain"] = out["decode_tokens_per_s"] / (m / max(plain.decode_s, 1e-9))
        out["bytes_vs_plain"] = out["kv_bytes_read_per_token"] / max(1e-9, plain_read)
        out["same_as_plain"] = res.token_ids == plain.token_ids
    return out
