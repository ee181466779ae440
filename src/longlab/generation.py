"""``generate``: the one-line API, a thin facade over the :class:`~longlab.engine.Engine`.

``generate(model, tokenizer, context, question, recipe="snapkv@0.5", **fields)`` builds one
:class:`~longlab.request.Request` per context (``fields`` are the request's: ``max_new_tokens``,
``query_aware``, ``documents``, ``reuse``, ``speculative``, ``position``, ``temperature``, ...), runs them
as one batch and returns a :class:`GenerationResult`. Modes: query-agnostic (default: the context is
compressed alone, then the question is asked) and query-aware (``query_aware=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .engine import Engine, Result
from .errors import LonglabError
from .request import Request

__all__ = ["generate", "GenerationResult"]


def generate(model: Any, tokenizer: Any, context: str | list[str] | None = None,
             question: str | list[str] | None = None, recipe: Any = "snapkv@0.5", *, store: Any = None,
             **fields: Any) -> GenerationResult:
    """Answer ``question`` about ``context`` with the KV cache managed by ``recipe``.

    ``context`` is a string or a list of strings (one batch row each; ``bytes`` are decoded as UTF-8,
    strictly); ``question`` and ``answer_prefix`` are one value for every row or a list with one per row.
    ``fields`` are :class:`~longlab.request.Request` fields (``docs=`` is accepted for ``documents=``);
    ``store`` is the document KV store of ``documents=`` (:mod:`longlab.reuse`). Every argument is checked
    before the model runs: a bad one raises :class:`~longlab.errors.LonglabError` naming it."""
    if "docs" in fields:
        fields["documents"] = fields.pop("docs")
    unknown = sorted(set(fields) - {f for f in Request.__dataclass_fields__ if f != "parsed"})
    if unknown:
        raise LonglabError(
            f"generate() has no argument {', '.join(unknown)}; see longlab.Request for the fields"
        )
    many = isinstance(context, (list, tuple))
    contexts = list(context) if many else [context]
    if many and not contexts:
        raise LonglabError("context is empty: give at least one context string")
    rows = {"question": question, "answer_prefix": fields.pop("answer_prefix", "")}
    for name, value in rows.items():
        if isinstance(value, (list, tuple)):
            if not many or len(value) != len(contexts):
                raise LonglabError(f"{name} has {len(value)} items but there are {len(contexts)} contexts")
        else:
            rows[name] = [value] * len(contexts)
    fields.setdefault("batch_decode", len(contexts) > 1)  # a lone row decodes in (and returns) its own cache
    requests = [Request(context=c, question=q, answer_prefix=p, recipe=recipe, **fields)
                for c, q, p in zip(contexts, rows["question"], rows["answer_prefix"])]
    for i, request in enumerate(requests):  # every row checked, named as the caller gave it
        request.check(f"context[{i}]" if many else "context")
    return GenerationResult.of(Engine(model, tokenizer, store=store).run(requests))


@dataclass
class GenerationResult:
    """Answers and what they cost, one entry per row. Byte counts are for the prompt's cache (after the
    question in query-aware mode): ``kv_bytes_before`` is what an uncompressed cache holds,
    ``kv_bytes_after`` what the LonglabCache holds after compression (sums over rows); seconds are sums
    over rows, but ``decode_s``, the longest row's (rows decode together)."""

    texts: list[str]
    token_ids: list[list[int]]
    context_tokens: list[int]
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    decode_s: float
    recipe: str
    cache: Any = field(default=None, repr=False)  # the cache of a lone row that decoded alone
    reuse: Any = field(default=None, repr=False)  # longlab.reuse.ReusePrefill when generated from documents=
    speculation: dict | None = field(default=None, repr=False)  # longlab.spec counters (acceptance, ...)
    context: list[dict] | None = field(default=None, repr=False)  # longlab.compress records, one per row
    results: list[Result] = field(default_factory=list, repr=False)  # the engine's results, one per row

    @classmethod
    def of(cls, results: list[Result]) -> GenerationResult:
        first = results[0]
        records = [r.context for r in results] if first.context is not None else None
        return cls(
            [r.text for r in results], [r.token_ids for r in results], [r.context_tokens for r in results],
            sum(r.kv_bytes_before for r in results), sum(r.kv_bytes_after for r in results),
            sum(r.prefill_s for r in results), sum(r.compress_s for r in results),
            max(r.decode_s for r in results), first.recipe, first.cache if len(results) == 1 else None,
            first.reuse, first.speculation, records, results,
        )

    @property
    def text(self) -> str:
        return self.texts[0]

    def summary(self) -> str:
        n = ",".join(str(t) for t in self.context_tokens)
        return (
            f"[{self.recipe}] context tokens {n} "
            f"| KV {_mib(self.kv_bytes_before)} -> {_mib(self.kv_bytes_after)} "
            f"| prefill {self.prefill_s:.2f}s compress {self.compress_s:.2f}s decode {self.decode_s:.2f}s"
        ) + "".join(  # a context compressor's record (longlab.compress)
            f" | context {c['original_tokens']} -> {c['kept_tokens']} tokens in {c['context_s']:.2f}s"
            for c in self.context or []
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
