"""HGMem: hypergraph working memory for multi-step RAG (Zhou et al., arXiv 2512.23959, ICML 2026; code
Encyclomen/HGMem).

Offline (:class:`DocumentIndex`, once per document, shared by every question about it):

- chunks of ``chunk_tokens`` = 200 tokens with ``overlap`` = 50 (stride 150), in the backend's tokens;
- per chunk, LightRAG-style entity and relation extraction through a JSON schema (:data:`EXTRACT_SCHEMA`;
  entity types organization, person, geo, event, role, concept) into a :class:`KnowledgeGraph`;
- a vector index over chunks and one over entities (``name: description``).

Online (:meth:`HGMem.answer`), for step ``t = 0 .. max_rounds - 1`` (official default 4):

1. **Plan** (:data:`PLAN_SCHEMA`): ``stop`` (memory suffices), ``local`` (a sub-query tied to memory point
   ids: retrieve in the ``hops``-hop (2) neighbourhood of those points' vertices, their inner chunks and the
   neighbours' outer chunks) or ``global`` (a sub-query over the whole entity and chunk indices). Step 0
   has an empty memory and is a global exploration with the question itself, as in the official loop.
2. **Evolve** (:data:`EVOLVE_SCHEMA`): from the retrieved entities, relations and chunks (CSV-like
   context), *insert* new memory points and *update* point ``i``. Entities a point names that the graph
   lacks are added to the graph and the entity index (the official code summarises them with one more
   call; here the point's own description is their description — one call fewer).
3. **Merge** (:data:`MERGE_SCHEMA`): point sets ``(i, j, ...)`` become one higher-order hyperedge.

Answer: from the memory points plus their supporting chunks (at most ``answer_chunks``, official 50; the
prompt is bounded by ``answer_context_tokens``), ``answer_tokens`` generated — the same answer budget as
the baselines of :mod:`longlab.memory.rag`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import LonglabError, check_range, shorten
from .backend import ChatBackend, chat_json
from .embed import VectorIndex
from .hypergraph import HypergraphMemory, KnowledgeGraph, norm_name

__all__ = [
    "HGMemConfig",
    "DocumentIndex",
    "HGMem",
    "chunk_text",
    "ENTITY_TYPES",
    "EXTRACT_SCHEMA",
    "PLAN_SCHEMA",
    "EVOLVE_SCHEMA",
    "MERGE_SCHEMA",
    "answer_messages",
    "MAX_DOC_CHARS",
]

ENTITY_TYPES = ["organization", "person", "geo", "event", "role", "concept"]
MAX_DOC_CHARS = 2_000_000
MAX_CHUNKS = 4096
_NAME = {"type": "string", "maxLength": 80}
_DESC = {"type": "string", "maxLength": 300}

EXTRACT_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "entities": {
            "type": "array",
            "maxItems": 16,
            "items": {
                "type": "object",
                "properties": {"name": _NAME, "type": {"enum": ENTITY_TYPES}, "description": _DESC},
                "required": ["name", "type", "description"],
            },
        },
        "relations": {
            "type": "array",
            "maxItems": 16,
            "items": {
                "type": "object",
                "properties": {"source": _NAME, "target": _NAME, "description": _DESC},
                "required": ["source", "target", "description"],
            },
        },
    },
    "required": ["entities", "relations"],
}
EXTRACT_PROMPT = (
    "Extract the named entities (types: {types}) and the relations between them from the text. Reply with "
    'JSON {{"entities": [{{"name", "type", "description"}}], "relations": [{{"source", "target", '
    '"description"}}]}}.\nText: {chunk}'
)
#: version of the loop's instructions, recorded with every row so rows of two versions never pair. 1: the
#: instructions up to commit 53ea4fc, sample values in their JSON ("a fact"), which SmolLM2 and Gemma-3-270M
#: copied into every point; 2 (commits ef2cdcf-47cdf08): fields described in words, no example, after which
#: Qwen2.5-0.5B's memory was empty (0 points) on all 37 persist items it ran; 3: the evolve step shows one
#: worked example from another domain, as the official prompts do (Encyclomen/HGMem's evolve prompt shows a
#: full sample output), and a copied example is dropped by :func:`copies_instruction`.
PROMPTS_VERSION = 3
#: the sample values of the version-1 instructions' JSON, which small models copied as their facts
V1_SAMPLE_VALUES = ("a fact", "rewritten fact", "the merged fact")
PLAN_INSTRUCTION = (
    "Is the memory enough to answer the question? Reply with a JSON object. Its field decision is stop when "
    "the memory answers the question, local to look closer at some memory points, or global to search the "
    "whole text again. Its field point_ids lists the ids of the memory points to look closer at (for "
    "local). Its field subquery says in your own words what to look up next."
)
EVOLVE_INSTRUCTION = (
    "Record what the retrieved text says that helps answer the question, as memory points. Reply with a "
    "JSON object. Its field insert lists new memory points; each names the entities it links (objects) "
    "and states in one sentence what the retrieved text says about them (description). Its field update "
    "lists memory points to rewrite with what the retrieved text adds; each gives the point's id and its "
    "new description. An example from another text: for the question 'Who taught the violinist of the "
    "Harrow Quartet?' and the text 'The Harrow Quartet's violinist is Ines Marlo. Ines Marlo studied with "
    "Petr Danek. It rained.', the reply is "
    '{"insert": [{"objects": ["Harrow Quartet", "Ines Marlo"], "description": "The violinist of the '
    'Harrow Quartet is Ines Marlo."}, {"objects": ["Ines Marlo", "Petr Danek"], "description": "Ines '
    'Marlo studied with Petr Danek."}], "update": []}.'
)
MERGE_INSTRUCTION = (
    "Which memory points describe one connected fact and should become one point? Reply with a JSON "
    "object. Its field merge lists the groups to merge; each gives the ids of two or more points and, in "
    "one sentence, the fact they make together (description). Leave the list empty when no points belong "
    "together."
)


def plain_words(text: str) -> str:
    """``text`` lower-case, letters and digits only, words joined by one space."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def copies_instruction(description: str, instruction: str, data: str | None = None) -> bool:
    """Whether ``description`` echoes the request instead of stating a fact of the data: it is empty, or a
    run of ``instruction``'s words, or (given the ``data`` the model was shown: question, memory,
    retrieved text) every word of it occurs in ``instruction`` while some word of it occurs nowhere in
    ``data`` (a copy or remix of the instruction's example). Compared lower-case on letters and digits."""
    d = plain_words(description)
    if not d or f" {d} " in f" {plain_words(instruction)} ":
        return True
    if data is None:
        return False
    words = set(d.split())
    return words <= set(plain_words(instruction).split()) and not words <= set(plain_words(data).split())


def instructions_note(versions: Iterable[int], dropped: int, points: Sequence[str] | None = None) -> str:
    """One phrase for a page: which version(s) of HGMem's loop instructions built some rows
    (:data:`PROMPTS_VERSION`) and what they did to the memory. Under version 1 (sample values in the JSON,
    :data:`V1_SAMPLE_VALUES`, which small models copy as facts): how many of ``points`` are one of those
    values, when given; under later versions: how many echoed descriptions or sub-queries were dropped."""
    seen = sorted(set(versions))
    if seen == [1]:
        values = ", ".join(repr(v) for v in V1_SAMPLE_VALUES)
        if points is None:
            return (
                f"HGMem's instructions: version 1 (sample values in their JSON, {values}, which small models "
                "copy as facts)"
            )
        copied = sum(plain_words(p) in V1_SAMPLE_VALUES for p in points)
        return (
            f"HGMem's instructions: version 1, {copied} of its {len(points)} points are one of their sample "
            f"values ({values})"
        )
    return (
        f"HGMem's instructions: version {'/'.join(map(str, seen))}, {dropped} echoed descriptions or "
        "sub-queries dropped"
    )


def _dropped_echo(text: str, instruction: str, data: str | None, trace: Any) -> bool:
    """:func:`copies_instruction`, counting a non-empty echo in ``trace.instruction_copies`` (if given)."""
    echo = copies_instruction(text, instruction, data)
    if echo and trace is not None and text.strip():
        trace.instruction_copies += 1
    return echo


PLAN_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "decision": {"enum": ["stop", "local", "global"]},
        "point_ids": {"type": "array", "maxItems": 8, "items": {"type": "integer"}},
        "subquery": {"type": "string", "maxLength": 300},
    },
    "required": ["decision", "point_ids", "subquery"],
}
EVOLVE_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "insert": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "objects": {"type": "array", "minItems": 1, "maxItems": 8, "items": _NAME},
                    "description": _DESC,
                },
                "required": ["objects", "description"],
            },
        },
        "update": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "description": _DESC},
                "required": ["id", "description"],
            },
        },
    },
    "required": ["insert", "update"],
}
MERGE_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "merge": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "ids": {"type": "array", "minItems": 2, "maxItems": 8, "items": {"type": "integer"}},
                    "description": _DESC,
                },
                "required": ["ids", "description"],
            },
        }
    },
    "required": ["merge"],
}


#: HGMemConfig's fields and their allowed ranges (integers), checked by :meth:`HGMemConfig.check`
HGMEM_RANGES: dict[str, tuple[int, int]] = {
    "chunk_tokens": (16, 4096),
    "overlap": (0, 2048),
    "max_rounds": (1, 16),
    "hops": (0, 8),
    "top_entities": (1, 256),
    "top_chunks": (1, 256),
    "answer_chunks": (1, 256),
    "answer_context_tokens": (64, 1 << 17),
    "extract_tokens": (1, 4096),
    "plan_tokens": (1, 4096),
    "evolve_tokens": (1, 4096),
    "merge_tokens": (1, 4096),
    "answer_tokens": (1, 4096),
    "retries": (0, 8),
}
JSON_CALLS = ("extract_tokens", "plan_tokens", "evolve_tokens", "merge_tokens")  # the schema-bound calls


@dataclass
class HGMemConfig:
    """Defaults as the official code where it has them (chunks 200/50, 4 rounds, 2 hops, ≤ 50 answer
    chunks); retrieval sizes and per-call token limits are this port's, bounded for small models."""

    chunk_tokens: int = 200
    overlap: int = 50
    max_rounds: int = 4
    hops: int = 2
    top_entities: int = 8
    top_chunks: int = 4
    answer_chunks: int = 50
    answer_context_tokens: int = 3000
    extract_tokens: int = 256
    plan_tokens: int = 96
    evolve_tokens: int = 256
    merge_tokens: int = 128
    answer_tokens: int = 32
    retries: int = 1

    @classmethod
    def capped(cls, json_tokens: int | None = None, **fields: Any) -> HGMemConfig:
        """A checked config with ``fields``; ``json_tokens`` caps every schema-bound call's generated
        tokens (extract/plan/evolve/merge: each ``min(default, json_tokens)``)."""
        cfg = cls(**fields)
        if json_tokens is not None:
            check_range("json_tokens", json_tokens, 1, HGMEM_RANGES["extract_tokens"][1], integer=True)
            for name in JSON_CALLS:
                setattr(cfg, name, min(getattr(cfg, name), json_tokens))
        return cfg.check()

    def check(self) -> HGMemConfig:
        for name, (low, high) in HGMEM_RANGES.items():
            check_range(name, getattr(self, name), low, high, integer=True)
        if self.overlap >= self.chunk_tokens:
            raise LonglabError(
                f"overlap must be smaller than chunk_tokens ({self.chunk_tokens}), got {self.overlap}"
            )
        return self


def chunk_text(text: str, tokenizer: Any, size: int = 200, overlap: int = 50) -> list[str]:
    """Windows of ``size`` tokens advancing by ``size - overlap`` (the last one may be shorter); without a
    tokenizer, whitespace words stand in for tokens."""
    if not isinstance(text, str) or not text.strip():
        raise LonglabError(f"document must be a non-empty string, got {shorten(text)}")
    if len(text) > MAX_DOC_CHARS:
        raise LonglabError(f"document has {len(text)} characters, more than {MAX_DOC_CHARS}")
    stride = size - overlap
    if tokenizer is None:
        words = text.split()
        pieces = [" ".join(words[i : i + size]) for i in range(0, max(1, len(words) - overlap), stride)]
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.decode(ids[i : i + size]) for i in range(0, max(1, len(ids) - overlap), stride)]
    if len(pieces) > MAX_CHUNKS:
        raise LonglabError(f"document makes {len(pieces)} chunks, more than {MAX_CHUNKS}")
    return [p.strip() for p in pieces if p.strip()]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def answer_messages(question: str, context: str) -> list[dict[str, str]]:
    """The answer prompt every system of this family uses (HGMem and the baselines)."""
    return _user(
        f"{context}\n\nAnswer the question using the information above. Reply with the answer only, "
        f"a short phrase.\nQuestion: {question}"
    )


class DocumentIndex:
    """A document's chunks, knowledge graph, and chunk/entity vector indices (HGMem's offline stage)."""

    def __init__(self, chunks: list[str], graph: KnowledgeGraph, embedder: Any) -> None:
        self.chunks = chunks
        self.graph = graph
        self.chunk_index = VectorIndex(embedder)
        self.chunk_index.add(list(range(len(chunks))), chunks)
        self.entity_index = VectorIndex(embedder)
        self.index_entities(list(graph.entities))
        self.extract_failures = 0

    def index_entities(self, names: list[str]) -> None:
        ents = [self.graph.entities[n] for n in names]
        self.entity_index.add([e.name for e in ents], [f"{e.name}: {e.description}" for e in ents])

    @classmethod
    def build(
        cls,
        backend: ChatBackend,
        text: str,
        embedder: Any,
        *,
        tokenizer: Any = None,
        config: HGMemConfig | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> DocumentIndex:
        """Chunk ``text``, extract entities and relations from each chunk (one schema call each), index.
        ``progress`` gets one line per chunk."""
        cfg = (config or HGMemConfig()).check()
        chunks = chunk_text(text, tokenizer, cfg.chunk_tokens, cfg.overlap)
        graph = KnowledgeGraph()
        failures = 0
        for i, chunk in enumerate(chunks):
            got = chat_json(
                backend,
                _user(EXTRACT_PROMPT.format(types=", ".join(ENTITY_TYPES), chunk=chunk)),
                EXTRACT_SCHEMA,
                max_tokens=cfg.extract_tokens,
                retries=cfg.retries,
            )
            if progress is not None:
                progress(
                    f"extract {i + 1}/{len(chunks)}: "
                    + (
                        "no valid JSON"
                        if got is None
                        else f"{len(got['entities'])} entities, {len(got['relations'])} relations"
                    )
                )
            if got is None:
                failures += 1
                continue
            for e in got["entities"]:
                if norm_name(e["name"]):
                    graph.add_entity(e["name"], e["type"], e["description"], chunk=i)
            for r in got["relations"]:
                if norm_name(r["source"]) and norm_name(r["target"]):
                    graph.add_relation(r["source"], r["target"], r["description"], chunk=i)
        index = cls(chunks, graph, embedder)
        index.extract_failures = failures
        return index


@dataclass
class Trace:
    """What one question's loop did, round by round (stored in the results row's ``extra``)."""

    rounds: list[dict[str, Any]] = field(default_factory=list)
    points: int = 0
    answer_chunks: int = 0
    json_failures: int = 0
    instruction_copies: int = 0  # descriptions / sub-queries dropped by :func:`copies_instruction`


class HGMem:
    """HGMem over one :class:`DocumentIndex` and one backend (see the module docstring for the loop)."""

    def __init__(
        self,
        backend: ChatBackend,
        index: DocumentIndex,
        config: HGMemConfig | None = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        self.backend, self.index, self.cfg = backend, index, (config or HGMemConfig()).check()
        self.tokenizer = tokenizer

    # ----------------------------------------------------------------------------------------- retrieval
    def retrieve_global(self, query: str) -> tuple[list[str], list[int]]:
        ents = [k for k, _ in self.index.entity_index.search(query, self.cfg.top_entities)]
        chunks = [k for k, _ in self.index.chunk_index.search(query, self.cfg.top_chunks)]
        return ents, chunks

    def retrieve_local(
        self, query: str, memory: HypergraphMemory, pids: list[int]
    ) -> tuple[list[str], list[int]]:
        """Entities in the ``hops`` neighbourhood of the points' vertices, ranked by the sub-query; chunks:
        the points' own (inner) and their neighbours' (outer), ranked by the sub-query."""
        anchors = sorted(set().union(*(memory.points[p].objects for p in pids)))
        near = set(self.index.graph.neighbourhood(anchors, self.cfg.hops))
        ents = [k for k, _ in self.index.entity_index.search(query, self.cfg.top_entities, among=near)]
        pool: set[int] = set().union(*(memory.points[p].chunks for p in pids))
        for name in near:
            pool |= self.index.graph.entities[name].chunks
        chunks = (
            [k for k, _ in self.index.chunk_index.search(query, self.cfg.top_chunks, among=pool)]
            if pool
            else []
        )
        return ents, chunks

    def context_of(self, ents: list[str], chunks: list[int]) -> str:
        g = self.index.graph
        lines = ["-----Entities-----", "name,type,description"]
        lines += [
            f'"{n}","{g.entities[n].type}","{g.entities[n].description}"' for n in ents if n in g.entities
        ]
        lines += ["-----Relations-----", "source,target,description"]
        lines += [f'"{r.source}","{r.target}","{r.description}"' for r in g.relations_among(ents)]
        lines += ["-----Chunks-----"] + [f"[chunk {c}] {self.index.chunks[c]}" for c in chunks]
        return "\n".join(lines)

    # -------------------------------------------------------------------------------------------- loop
    def _json(self, prompt: str, schema: dict, max_tokens: int, trace: Trace) -> Any | None:
        got = chat_json(self.backend, _user(prompt), schema, max_tokens=max_tokens, retries=self.cfg.retries)
        if got is None:
            trace.json_failures += 1
        return got

    def run_memory(self, question: str) -> tuple[HypergraphMemory, Trace]:
        """The plan -> retrieve -> evolve -> merge loop; the final memory and its trace."""
        cfg = self.cfg
        memory = HypergraphMemory()
        trace = Trace()
        for t in range(cfg.max_rounds):
            step: dict[str, Any] = {"t": t}
            if t == 0:
                decision, pids, sub = "global", [], question
            else:
                plan = self._json(
                    f"Question: {question}\nMemory points:\n{memory.render()}\n\n{PLAN_INSTRUCTION}",
                    PLAN_SCHEMA,
                    cfg.plan_tokens,
                    trace,
                )
                if plan is None or plan["decision"] == "stop":
                    step["decision"] = "stop" if plan else "stop (no valid plan)"
                    trace.rounds.append(step)
                    break
                decision, sub = plan["decision"], plan["subquery"].strip()
                if _dropped_echo(sub, PLAN_INSTRUCTION, f"{question}\n{memory.render()}", trace):
                    sub = question
                pids = [p for p in plan["point_ids"] if p in memory.points]
                if decision == "local" and not pids:
                    decision = "global"
            ents, chunks = (
                self.retrieve_local(sub, memory, pids) if decision == "local" else self.retrieve_global(sub)
            )
            step.update(
                decision=decision, subquery=sub[:200], point_ids=pids, entities=len(ents), chunks=list(chunks)
            )
            shown = (
                f"Question: {question}\nSub-query: {sub}\nMemory points:\n{memory.render()}\n\nRetrieved:\n"
                f"{self.context_of(ents, chunks)}"
            )
            evolve = self._json(
                f"{shown}\n\n{EVOLVE_INSTRUCTION}",
                EVOLVE_SCHEMA,
                cfg.evolve_tokens,
                trace,
            )
            if evolve is not None:
                step["inserted"], step["updated"] = self.evolve(memory, evolve, chunks, trace, shown)
            if len(memory) >= 2:
                shown = f"Question: {question}\nMemory points:\n{memory.render()}"
                merge = self._json(
                    f"{shown}\n\n{MERGE_INSTRUCTION}",
                    MERGE_SCHEMA,
                    cfg.merge_tokens,
                    trace,
                )
                if merge is not None:
                    step["merged"] = self.merge(memory, merge, trace, shown)
            trace.rounds.append(step)
        trace.points = len(memory)
        return memory, trace

    def evolve(
        self,
        memory: HypergraphMemory,
        ops: dict,
        chunks: list[int],
        trace: Trace | None = None,
        shown: str | None = None,
    ) -> tuple[int, int]:
        """Apply insert/update operations; entities new to the graph are added to it and to the entity index.
        A point's chunks are the retrieved chunks that mention one of its objects (else all retrieved).
        A description that echoes the instruction (:func:`copies_instruction` against ``shown``, the data
        of the prompt) is dropped and counted."""
        graph = self.index.graph
        inserted = updated = 0

        def echoed(description: str) -> bool:
            return _dropped_echo(description, EVOLVE_INSTRUCTION, shown, trace)

        for op in ops["insert"]:
            names = [n for n in dict.fromkeys(norm_name(o) for o in op["objects"]) if n]
            if not names or echoed(op["description"]):
                continue
            new = [n for n in names if n not in graph.entities]
            for n in new:
                graph.add_entity(n, "", op["description"])
            if new:
                self.index.index_entities(new)
            support = [c for c in chunks if any(n.lower() in self.index.chunks[c].lower() for n in names)]
            memory.insert(names, op["description"], support or chunks)
            inserted += 1
        for op in ops["update"]:
            if op["id"] in memory.points and not echoed(op["description"]):
                memory.update(op["id"], op["description"], chunks=chunks)
                updated += 1
        return inserted, updated

    @staticmethod
    def merge(
        memory: HypergraphMemory, ops: dict, trace: Trace | None = None, shown: str | None = None
    ) -> int:
        """Apply merge operations (two or more known ids each); an echoed description
        (:func:`copies_instruction` against ``shown``) is dropped and counted."""
        done = 0
        for op in ops["merge"]:
            ids = [i for i in dict.fromkeys(op["ids"]) if i in memory.points]
            if _dropped_echo(op["description"], MERGE_INSTRUCTION, shown, trace):
                continue
            if len(ids) >= 2:
                memory.merge(ids, op["description"])
                done += 1
        return done

    def answer_context(self, memory: HypergraphMemory) -> tuple[str, int]:
        """Memory points, then their supporting chunks (≤ ``answer_chunks``), cut at
        ``answer_context_tokens`` (whole chunks)."""
        chunk_ids = sorted(set().union(*(p.chunks for p in memory.points.values()))) if memory.points else []
        chunk_ids = chunk_ids[: self.cfg.answer_chunks]
        head = "Memory:\n" + memory.render()
        budget = self.cfg.answer_context_tokens - _count(self.tokenizer, head)
        parts, used = [], 0
        for c in chunk_ids:
            n = _count(self.tokenizer, self.index.chunks[c])
            if n > budget:
                break
            budget -= n
            parts.append(self.index.chunks[c])
            used += 1
        return head + ("\n\nSupporting text:\n" + "\n".join(parts) if parts else ""), used

    def answer(self, question: str) -> tuple[str, dict[str, Any]]:
        """The answer text and a record (rounds, points, chunks used, calls and tokens spent, seconds)."""
        if not isinstance(question, str) or not question.strip():
            raise LonglabError(f"question must be a non-empty string, got {shorten(question)}")
        stats = getattr(self.backend, "stats", None)
        before = stats.snapshot() if stats is not None else None
        start = time.perf_counter()
        memory, trace = self.run_memory(question)
        context, trace.answer_chunks = self.answer_context(memory)
        text = self.backend.chat(answer_messages(question, context), max_tokens=self.cfg.answer_tokens)
        record = {
            "trace": json.loads(json.dumps(asdict(trace))),
            "memory": memory.render()[:4000],
            "wall_s": time.perf_counter() - start,
        }
        if stats is not None:
            record["spent"] = stats.since(before)
        return text, record


def _count(tokenizer: Any, text: str) -> int:
    return (
        len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text.split())
    )
