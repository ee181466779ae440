"""Run memory systems over QA samples and store one results row per (system, sample).

Systems (``--systems``): ``hgmem``; ``rag`` / ``rag:k=8`` (top-k chunk RAG); ``context:RECIPE`` (the whole
document in context under a KV recipe: ``context:full``, ``context:snapkv@0.5``, ``context:kivi4``);
``reuse`` / ``reuse:METHOD`` (the document KV store, ``reuse:cacheblend:recompute=0.15``). Samples are
grouped by document (``metadata["doc"]``, else the context): HGMem's offline index, the RAG chunk index and
the KV store are built once per document; their cost is stored as ``offline_s`` / ``offline_tokens`` and
spread over the document's questions in ``wall_per_question_s`` / ``generated_per_question`` /
``prompt_per_question``.

Rows go to the results store (:class:`~longlab.eval.store.ResultStore`) in the columns ``longlab report``
reads: ``recipe`` is the system spec, ``task``, ``length``, ``sample_id``, ``score`` (the task's metric),
``prediction``; ``extra`` holds tokens, calls, seconds, JSON failures and HGMem's round trace. A row
already in the store (same model, system, task, length, sample, config) is skipped, so a killed run resumes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from ..errors import LonglabError, shorten
from ..tasks.registry import score_sample
from ..tasks.sample import Sample
from .backend import ChatBackend, LocalBackend
from .hgmem import PROMPTS_VERSION, DocumentIndex, HGMem, HGMemConfig

__all__ = ["parse_system", "run_systems", "system_config", "SYSTEM_KINDS", "MAX_SAMPLES"]

SYSTEM_KINDS = ("hgmem", "rag", "context", "reuse")
MAX_SAMPLES = 10_000


def parse_system(spec: str) -> tuple[str, Any]:
    """``"hgmem"`` -> ("hgmem", None); ``"rag:k=8"`` -> ("rag", 8); ``"context:snapkv@0.5"`` ->
    ("context", "snapkv@0.5"); ``"reuse"`` -> ("reuse", "cacheblend:recompute=0.15")."""
    if not isinstance(spec, str) or not spec.strip():
        raise LonglabError(
            f"a system must be one of {', '.join(SYSTEM_KINDS)} (e.g. rag:k=4, context:full), "
            f"got {shorten(spec)}"
        )
    kind, _, arg = spec.strip().partition(":")
    if kind == "hgmem" and not arg:
        return "hgmem", None
    if kind == "rag":
        if not arg:
            return "rag", 4
        if not arg.startswith("k=") or not arg[2:].isdigit() or not 1 <= int(arg[2:]) <= 256:
            raise LonglabError(f"rag takes k=N with N in [1, 256] (rag:k=4), got {shorten(spec)}")
        return "rag", int(arg[2:])
    if kind == "context" and arg:
        from ..recipe import parse_recipe

        try:
            parse_recipe(arg)
        except LonglabError as exc:
            raise LonglabError(f"system {spec}: {exc}") from None
        return "context", arg
    if kind == "reuse":
        from ..reuse import parse_reuse

        method = arg or "cacheblend:recompute=0.15"
        try:
            parse_reuse(method)
        except LonglabError as exc:
            raise LonglabError(f"system {spec}: {exc}") from None
        return "reuse", method
    raise LonglabError(
        f"unknown system {shorten(spec)}; systems: hgmem, rag[:k=N], context:RECIPE "
        f"(context:full, context:snapkv@0.5, context:kivi4), reuse[:METHOD]"
    )


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    by: dict[str, list[Sample]] = {}
    for s in samples:
        by.setdefault(str(s.metadata.get("doc") or hash(s.context)), []).append(s)
    return list(by.values())


def system_config(kind: str, config: HGMemConfig, embedder: Any) -> dict[str, Any]:
    """What a system's answers depend on besides its spec (hashed into its rows' ``config_hash``, so a rerun
    skips a stored row only when it would compute the same one): HGMem, all of ``config``, the embedder
    and its instructions' version (:data:`~longlab.memory.hgmem.PROMPTS_VERSION`); RAG, its chunking, the
    embedder and the answer budget; whole-context and KV-reuse systems, the answer budget only."""
    if kind == "hgmem":
        return {"hgmem": asdict(config), "embedder": type(embedder).__name__, "prompts": PROMPTS_VERSION}
    if kind == "rag":
        return {"chunk_tokens": config.chunk_tokens, "overlap": config.overlap,
                "answer_tokens": config.answer_tokens, "embedder": type(embedder).__name__}
    return {"answer_tokens": config.answer_tokens}


def run_systems(
    backend: ChatBackend,
    samples: Sequence[Sample],
    systems: Sequence[str],
    *,
    embedder: Any,
    store: Any = None,
    config: HGMemConfig | None = None,
    seed: int = 0,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every system on every sample; the rows (also added to ``store`` when given)."""
    from ..eval.identity import config_hash, run_key_of
    from .rag import ChunkStore, context_answers, rag_answer, reuse_answers

    cfg = (config or HGMemConfig()).check()
    parsed = [(s, *parse_system(s)) for s in systems]
    if not samples or len(samples) > MAX_SAMPLES:
        raise LonglabError(f"samples must number 1..{MAX_SAMPLES}, got {len(samples)}")
    local = isinstance(backend, LocalBackend)
    for spec, kind, _ in parsed:
        if kind in ("context", "reuse") and not local:
            raise LonglabError(f"system {spec} needs the local engine (--model NAME), not an endpoint")
    tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    hashes = {spec: config_hash(system_config(kind, cfg, embedder)) for spec, kind, _ in parsed}
    rows: list[dict[str, Any]] = []
    for group in _groups(samples):
        doc = group[0].context
        joint: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for spec, kind, arg in parsed:
            base = [
                {
                    "model": backend.name,
                    "recipe": spec,
                    "method": kind,
                    "task": s.task,
                    "length": s.length,
                    "sample_id": s.sample_id,
                    "query_aware": 1,
                    "seed": seed,
                    "config_hash": hashes[spec],
                }
                for s in group
            ]
            todo = [i for i, b in enumerate(base) if store is None or not store.has(run_key_of(b))]
            if not todo:
                continue
            chosen = [group[i] for i in todo]
            stats = getattr(backend, "stats", None)
            before = stats.snapshot() if stats is not None else None
            t0 = time.perf_counter()
            offline: dict[str, Any] = {}
            if kind == "hgmem":
                index = DocumentIndex.build(
                    backend, doc, embedder, tokenizer=tokenizer, config=cfg, progress=say
                )
                offline = {
                    "chunks": len(index.chunks),
                    "entities": len(index.graph.entities),
                    "relations": len(index.graph.relations),
                    "extract_failures": index.extract_failures,
                }
                system = HGMem(backend, index, cfg, tokenizer=tokenizer)
            elif kind == "rag":
                chunk_store = ChunkStore(
                    doc, embedder, tokenizer=tokenizer, chunk_tokens=cfg.chunk_tokens, overlap=cfg.overlap
                )
            offline_s = time.perf_counter() - t0
            if stats is not None:
                spent = stats.since(before)
                offline["offline_generated_tokens"] = spent["generated_tokens"]
                offline["offline_prompt_tokens"] = spent["prompt_tokens"]
            # hgmem and rag answer lazily, so each row is stored as soon as its question is answered
            # (a run cut short keeps what it finished; a rerun skips the stored questions)
            results: Any
            if kind == "hgmem":
                results = (system.answer(s.question) for s in chosen)
            elif kind == "rag":
                results = (
                    rag_answer(backend, chunk_store, s.question, k=arg, answer_tokens=cfg.answer_tokens)
                    for s in chosen
                )
            elif kind == "context":
                if spec not in joint:  # every context system of this document at once: one shared prefill
                    recipes = [a for sp, k, a in parsed if k == "context"]
                    got = context_answers(
                        backend,
                        doc,
                        [s.question for s in group],
                        recipes=recipes,
                        answer_tokens=cfg.answer_tokens,
                    )
                    joint.update({sp: got[a] for sp, k, a in parsed if k == "context"})
                results = [joint[spec][i] for i in todo]
            else:
                results = reuse_answers(
                    backend, doc, [s.question for s in chosen], reuse=arg, answer_tokens=cfg.answer_tokens
                )
            for i, s, (text, rec) in zip(todo, chosen, results):
                spent = rec.get("spent", {})
                share = 1 / len(chosen)  # this question's share of the document's offline work
                gen = spent.get("generated_tokens", 0) + offline.get("offline_generated_tokens", 0) * share
                prompt = spent.get("prompt_tokens", 0) + offline.get("offline_prompt_tokens", 0) * share
                row = dict(
                    base[i],
                    prediction=text,
                    answers=list(s.answers),
                    score=score_sample(s, text) if s.answers else None,
                    context_tokens=len(tokenizer.encode(doc, add_special_tokens=False))
                    if tokenizer is not None
                    else None,
                    prefill_s=rec.get("prefill_s"),
                    decode_s=rec.get("decode_s"),
                    kv_bytes_before=rec.get("kv_bytes_before"),
                    kv_bytes_after=rec.get("kv_bytes_after"),
                )
                row["extra"] = {
                    "wall_s": rec["wall_s"],
                    "offline_s": offline_s,
                    "wall_per_question_s": rec["wall_s"] + offline_s / len(chosen),
                    "generated_tokens": spent.get("generated_tokens"),
                    "prompt_tokens": spent.get("prompt_tokens"),
                    "calls": spent.get("calls"),
                    "json_failures": spent.get("json_failures"),
                    "json_repaired": spent.get("json_repaired"),
                    "constrained": spent.get("constrained"),
                    "generated_per_question": gen,
                    "prompt_per_question": prompt,
                    "doc": s.metadata.get("doc"),
                    "backend": type(backend).__name__,
                    "embedder": type(embedder).__name__,
                    **({"hgmem_prompts": PROMPTS_VERSION} if kind == "hgmem" else {}),
                    **offline,
                    **{
                        k: v for k, v in rec.items() if k in ("trace", "memory", "chunks", "stored", "pieces")
                    },
                }
                if store is not None:
                    store.add(row)
                rows.append(row)
                say(
                    f"{spec:>22} {s.sample_id}: score {row['score']} | {shorten(text, 40)!s} | "
                    f"gold {s.answers[:1]} | {row['extra']['wall_per_question_s']:.1f} s/q"
                )
    return rows
