"""HGMem's baselines on the same backend, prompt and answer budget (issue #31).

- :func:`rag_answer` — plain top-k chunk RAG: the ``k`` chunks (HGMem's 200/50 chunks, same embedder) most
  similar to the question, in document order, then the answer prompt of :func:`~.hgmem.answer_messages`.
- :func:`context_answers` — the whole document in context under a KV recipe (``full``, ``snapkv@0.5``,
  ``kivi4``, ...): one :class:`~longlab.request.Request` per question, query-aware, the same instruction.
  Needs the local engine (:class:`~.backend.LocalBackend`): a remote endpoint has its own cache.
- :func:`reuse_answers` — the document KV store with reuse (:mod:`longlab.reuse`): the document is cut
  into ``piece_tokens`` pieces stored once per document in a :class:`~longlab.reuse.MemoryStore` (or a
  :class:`~longlab.reuse.DocStore`) and every question assembles them with ``reuse`` (default
  ``cacheblend:recompute=0.15``), so the document's prefill is paid once, not per question.

Every function returns ``(text, record)`` per question, ``record`` holding tokens and seconds spent.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import LonglabError, check_range
from .backend import ChatBackend, LocalBackend
from .embed import VectorIndex
from .hgmem import answer_messages, chunk_text

__all__ = ["ChunkStore", "rag_answer", "context_answers", "reuse_answers", "ANSWER_INSTRUCTION"]

ANSWER_INSTRUCTION = (
    "Answer the question using the information above. Reply with the answer only, a short phrase."
)


class ChunkStore:
    """A document's chunks and their vector index."""

    def __init__(
        self, text: str, embedder: Any, *, tokenizer: Any = None, chunk_tokens: int = 200, overlap: int = 50
    ) -> None:
        self.chunks = chunk_text(text, tokenizer, chunk_tokens, overlap)
        self.index = VectorIndex(embedder)
        self.index.add(list(range(len(self.chunks))), self.chunks)


def rag_answer(
    backend: ChatBackend, store: ChunkStore, question: str, *, k: int = 4, answer_tokens: int = 32
) -> tuple[str, dict[str, Any]]:
    """Top-``k`` chunk RAG; the chunks go in document order."""
    check_range("k", k, 1, 256, integer=True)
    stats = getattr(backend, "stats", None)
    before = stats.snapshot() if stats is not None else None
    start = time.perf_counter()
    ids = sorted(i for i, _ in store.index.search(question, k))
    context = "\n".join(store.chunks[i] for i in ids)
    text = backend.chat(answer_messages(question, context), max_tokens=answer_tokens)
    record: dict[str, Any] = {"chunks": ids, "wall_s": time.perf_counter() - start}
    if stats is not None:
        record["spent"] = stats.since(before)
    return text, record


def _local(backend: Any, what: str) -> LocalBackend:
    if not isinstance(backend, LocalBackend):
        raise LonglabError(
            f"{what} needs the local engine (a model name), not {type(backend).__name__}: a remote "
            f"endpoint keeps its own KV cache"
        )
    return backend


def _record(result: Any, wall: float) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "spent": {
            "calls": 1,
            "prompt_tokens": int(result.prompt_tokens),
            "generated_tokens": len(result.token_ids),
            "seconds": wall,
        },
        "kv_bytes_before": int(result.kv_bytes_before),
        "kv_bytes_after": int(result.kv_bytes_after),
        "prefill_s": float(result.prefill_s),
        "decode_s": float(result.decode_s),
    }


def context_answers(
    backend: LocalBackend,
    document: str,
    questions: list[str],
    *,
    recipes: list[str] | str = "full",
    answer_tokens: int = 32,
) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The whole ``document`` in context under each of ``recipes``: recipe -> one ``(text, record)`` per
    question. The recipes of one question run as one engine batch, so they share one prefill of the prompt
    (:mod:`longlab.engine.prefill`); each record's ``wall_s`` is the engine's own account of that request
    (prefill, which counts the shared prefix in full, + compression + decode), i.e. its cost alone."""
    from ..engine import Engine
    from ..request import Request

    backend = _local(backend, "the whole-document baseline")
    recipes = [recipes] if isinstance(recipes, str) else list(recipes)
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {r: [] for r in recipes}
    for q in questions:
        requests = [
            Request(
                context=document,
                question=f"{ANSWER_INSTRUCTION}\nQuestion: {q}",
                recipe=r,
                query_aware=True,
                max_new_tokens=answer_tokens,
                chunk_size=backend.chunk_size,
                strict=False,
                batch_decode=False,
            ).check()
            for r in recipes
        ]
        for r, result in zip(recipes, Engine(backend.model, backend.tokenizer).run(requests)):
            alone = float(result.prefill_s) + float(result.compress_s) + float(result.decode_s)
            out[r].append((result.text, _record(result, alone)))
    return out


def reuse_answers(
    backend: LocalBackend,
    document: str,
    questions: list[str],
    *,
    reuse: str = "cacheblend:recompute=0.15",
    piece_tokens: int = 512,
    answer_tokens: int = 32,
    store: Any = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The document as ``piece_tokens`` pieces in a KV store, assembled with ``reuse`` for every question;
    the first question pays the pieces' prefill (``record["stored"]`` says which did)."""
    from ..engine import Engine
    from ..request import Request
    from ..reuse import MemoryStore

    backend = _local(backend, "the document KV store baseline")
    check_range("piece_tokens", piece_tokens, 16, 1 << 16, integer=True)
    pieces = chunk_text(document, backend.tokenizer, piece_tokens, 0)
    store = store if store is not None else MemoryStore()
    engine = Engine(backend.model, backend.tokenizer, store=store)
    out = []
    for i, q in enumerate(questions):
        request = Request(
            documents=pieces,
            question=f"{ANSWER_INSTRUCTION}\nQuestion: {q}",
            reuse=reuse,
            max_new_tokens=answer_tokens,
            strict=False,
        ).check()
        start = time.perf_counter()
        (result,) = engine.run([request])
        rec = _record(result, time.perf_counter() - start)
        rec.update(pieces=len(pieces), stored=i == 0)
        out.append((result.text, rec))
    return out
