"""``reuse_prefill``: the first token of a RAG prompt built from stored documents.

The prompt is ``[prefix][doc_1 + "\\n\\n"]...[doc_m + "\\n\\n"][question part]``: with a chat template the
prefix is everything before the user's content (system prompt, user header) and the question part is the
question, the end of the user turn, the assistant header and ``answer_prefix``; without one the prefix is
empty and the question part is ``question`` + ``answer_prefix``. Documents are tokenized alone, so the
full-prefill reference sees exactly the same token ids as every reuse method.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hook import ATTN_NAME
from ..recipe import LonglabError, LonglabTypeError, shorten
from .assemble import ReuseCache, build_job
from .compose import compress_assembled, record_last_forward, reuse_recipe
from .docstore import DocStore, MemoryStore
from .modelio import Runner
from .policies import ReuseMethod, parse_reuse

__all__ = ["ReusePrefill", "reuse_prefill", "split_prompt", "doc_segment", "open_store"]

_SENTINEL = "\u2063LONGLAB_DOCS\u2063"


def doc_segment(text: str) -> str:
    """A document as it sits in the prompt: its text without trailing whitespace, then a blank line."""
    return text.rstrip() + "\n\n"


def split_prompt(
    tokenizer: Any, question: str, answer_prefix: str = "", chat_template: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids of the prefix (before the documents) and of the question part (after them)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL + question}], tokenize=False, add_generation_prompt=True
        )
        before, after = rendered.split(_SENTINEL, 1)
        prefix = list(tokenizer(before, add_special_tokens=False)["input_ids"])
        q_text = after + answer_prefix
    else:
        prefix = []
        if answer_prefix and not answer_prefix[0].isspace():
            answer_prefix = " " + answer_prefix
        q_text = question + answer_prefix
    return prefix, list(tokenizer(q_text, add_special_tokens=False)["input_ids"])


def open_store(store: Any) -> DocStore | MemoryStore:
    """``None`` -> a :class:`MemoryStore`; a path -> a :class:`DocStore` there; a store -> itself."""
    if store is None:
        return MemoryStore()
    if isinstance(store, (DocStore, MemoryStore)):
        return store
    if isinstance(store, (str, os.PathLike)):
        return DocStore(store)
    raise LonglabTypeError(f"store must be a DocStore, a directory path or None, got {shorten(store)}")


@dataclass
class ReusePrefill:
    """The prefilled prompt: ``cache`` (ready for decoding at position ``n_positions``), the first token's
    ``logits [1, V]``, and what it cost: seconds to fetch the documents, assemble them and compute, the
    fraction of document token-layers recomputed and of a full prefill's token-layers computed."""

    cache: ReuseCache
    logits: torch.Tensor
    n_positions: int
    prompt_tokens: int
    method: str
    fetch_s: float
    assemble_s: float
    compute_s: float
    recompute_fraction: float
    cost_fraction: float
    stages: list[str] = field(default_factory=list)
    store_stats: dict[str, int] = field(default_factory=dict)
    recipe: str = "full"  # the KV recipe that compressed the cache after the reuse prefill
    compress_s: float = 0.0  # its compression step (after the first token's logits: not in ttft_s)

    @property
    def ttft_s(self) -> float:
        return self.fetch_s + self.assemble_s + self.compute_s


def _check_texts(docs: Any, question: Any) -> list[str]:
    if isinstance(docs, str) or not isinstance(docs, (list, tuple)):
        raise LonglabTypeError(f"docs must be a list of document strings, got {shorten(docs)}")
    if not docs:
        raise LonglabError("docs is empty: give at least one document")
    for i, d in enumerate(docs):
        if not isinstance(d, str):
            raise LonglabTypeError(f"docs[{i}] must be a string, got {type(d).__name__}")
        if not d.strip():
            raise LonglabError(f"docs[{i}] is empty: every document must have text")
    if not isinstance(question, str) or not question.strip():
        raise LonglabError(
            f"question must be a non-empty string when docs are given, got {shorten(question)}"
        )
    return list(docs)


@torch.inference_mode()
def reuse_prefill(
    model: Any,
    tokenizer: Any,
    docs: list[str],
    question: str,
    reuse: str | ReuseMethod | None = None,
    *,
    store: Any = None,
    answer_prefix: str = "",
    chat_template: bool = True,
    recipe: Any = None,
) -> ReusePrefill:
    """Prefill ``[prefix][docs][question]`` with the reuse method ``reuse`` (default ``full-prefill``), the
    documents' KV coming from ``store`` (a :class:`DocStore`, a directory, or None: encoded now, in
    memory), then compress the cache with the KV recipe ``recipe`` (``"snapkv@0.5"``; None or ``"full"``:
    keep everything), query-aware at the end of the prompt (:mod:`longlab.reuse.compose`). Every argument
    is checked before the model runs."""
    method = parse_reuse(reuse)
    kv_recipe = reuse_recipe(recipe, method)
    if kv_recipe is not None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != ATTN_NAME:
            raise LonglabError(
                f"recipe {kv_recipe.name!r} needs a model whose attention is 'longlab', but this one runs "
                f"{attn!r}; load it with longlab.load_model(...)"
            )
    docs = _check_texts(docs, question)
    runner = Runner(model)
    prefix_ids, q_ids = split_prompt(tokenizer, question, answer_prefix, chat_template)
    segments = [doc_segment(d) for d in docs]
    doc_ids = [list(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in segments]
    limit = runner.max_positions
    for i, ids in enumerate(doc_ids):
        if limit and len(prefix_ids) + len(ids) > limit:
            raise LonglabError(
                f"docs[{i}] has {len(ids)} tokens, longer than the model's max_position_embeddings={limit}"
            )
    total = (
        len(prefix_ids) + len(q_ids) + (max(map(len, doc_ids)) if method.parallel else sum(map(len, doc_ids)))
    )
    if limit and total > limit:
        raise LonglabError(
            f"prompt of {total} positions is longer than the model's max_position_embeddings={limit}"
        )

    store = open_store(store) if method.uses_store else None  # after every check: a refusal creates nothing
    start = time.perf_counter()
    stored = None
    if store is not None:
        doc_prefix = prefix_ids if method.parallel else []
        stored = [store.fetch(model, tokenizer, s, ids, doc_prefix) for s, ids in zip(segments, doc_ids)]
    fetched = time.perf_counter()
    job = build_job(runner, prefix_ids, doc_ids, q_ids, stored, parallel=method.parallel)
    attention = method.attention_recipe(job)
    if attention is not None:
        job.cache.recipe = attention
    recorder = record_last_forward(job) if kv_recipe is not None else None
    assembled = time.perf_counter()
    if stored is not None and len(prefix_ids):
        job.forward(job.prefix_rows, name="prefix")
    logits = method.prefill(job)
    job.finish()
    done = time.perf_counter()
    if kv_recipe is not None:
        compress_assembled(job, kv_recipe, recorder)
    compressed = time.perf_counter()
    return ReusePrefill(
        job.cache,
        logits,
        job.n_positions,
        len(job.ids),
        method.spec,
        fetched - start,
        assembled - fetched,
        done - assembled,
        job.recompute_fraction(),
        job.cost_fraction(),
        list(job.stages),
        dict(store.stats) if store is not None else {},
        kv_recipe.name if kv_recipe is not None else "full",
        compressed - done,
    )
