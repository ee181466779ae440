"""Long-document multi-hop QA for memory systems (issue #31), generated offline, answers by string match.

``longdoc_multihop``: one document per ``questions_per_doc`` questions. A document is essay filler with
``questions_per_doc`` two-hop chains and ``distractors`` extra facts scattered at random depths:

- hop 1: ``"{person} works for the {organization}."``
- hop 2: ``"The {organization} has its headquarters in {city}."``, 30-60% of the document away from hop 1
- distractors: headquarters of organizations nobody in the document works for.

Question: ``"In which city is the main office of the employer of {person}?"``; the answer
is the invented city name (``string_match_part``: contained in the reply, case-insensitive). The question
shares no content word with the hop-2 sentence, so one retrieval by the question finds hop 1 only — the case
HGMem's multi-step memory is for. Names are invented (no model knows them). Every sample of one document
carries the same ``context`` and ``metadata["doc"]``, so memory systems and KV reuse build once per document.

``load_memory_jsonl``: a user's own long-document / long-dialogue QA file, checked before it is trusted.
One JSON object a line, with

- NarrativeQA style: ``{"document" | "context": str, "question": str, "answers": [str] | "answer": str}``;
- LoCoMo style: ``{"conversation": [{"speaker": str, "text": str}, ...], "question": str, "answer": str}``
  (turns become ``"speaker: text"`` lines);
- optional ``"id"`` (the sample id) and ``"doc_id"`` (samples with one ``doc_id`` share one memory).

Bounds: at most ``max_samples`` lines (default 10,000), ``max_chars`` characters a document (default
400,000, ~100k tokens), file at most 256 MiB; a bad line is refused with its line number and field.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..errors import LonglabError, shorten
from ..safeio import read_user_file
from .haystacks import (
    LengthTooSmall,
    Tokenizer,
    check_length,
    check_num_samples,
    check_seed,
    check_tokenizer,
    count_tokens,
    essay_sentences,
    fit_units,
    join_with_inserts,
    sample_rng,
)
from .registry import declare_task, register_task
from .sample import Sample

__all__ = ["longdoc_multihop", "load_memory_jsonl", "MAX_LONGDOC_TOKENS", "MEMORY_JSONL_TASK"]

MAX_LONGDOC_TOKENS = 131_072
MEMORY_JSONL_TASK = "memory_jsonl"
_FIRST = (
    "Alma",
    "Borin",
    "Cadee",
    "Dorin",
    "Elsbeth",
    "Farrow",
    "Gideon",
    "Halcy",
    "Ivo",
    "Jessa",
    "Kelvar",
    "Lioren",
    "Marisol",
    "Nadim",
    "Oriel",
    "Perrin",
    "Quilla",
    "Rasmus",
    "Sunniva",
    "Tobiah",
    "Ulla",
    "Vesper",
    "Wendel",
    "Xanthe",
    "Yorick",
    "Zelda",
)
_LAST = (
    "Ashgrove",
    "Brackwell",
    "Corvane",
    "Dunmere",
    "Elderfield",
    "Fenwick",
    "Galloway",
    "Harrowgate",
    "Ironside",
    "Juniper",
    "Kettleby",
    "Larkspur",
    "Mossbank",
    "Northcote",
    "Oakhurst",
    "Pendry",
    "Quarrington",
    "Redfern",
    "Stellan",
    "Thornbury",
)
_ORG_A = (
    "Amber",
    "Basalt",
    "Cobalt",
    "Driftwood",
    "Ember",
    "Falcon",
    "Granite",
    "Heron",
    "Indigo",
    "Jade",
    "Kestrel",
    "Lantern",
    "Meridian",
    "Nimbus",
    "Obsidian",
    "Pinnacle",
    "Quartz",
    "Saffron",
    "Tundra",
    "Umber",
    "Verdant",
    "Willow",
)
_ORG_B = (
    "Foundry",
    "Institute",
    "Guild",
    "Consortium",
    "Observatory",
    "Shipyard",
    "Trust",
    "Cooperative",
    "Laboratory",
    "Syndicate",
)
_CITY_A = ("Vel", "Quen", "Tor", "Ash", "Mir", "Kal", "Bren", "Os", "Zan", "Rhu", "Ell", "Dra", "Fen", "Yor")
_CITY_B = (
    "mora",
    "bridge",
    "haven",
    "dell",
    "stead",
    "wick",
    "port",
    "fall",
    "mere",
    "crest",
    "holt",
    "vale",
)


def _names(rng: Any, n: int, parts: tuple[tuple[str, ...], ...], sep: str, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        name = sep.join(rng.choice(p) for p in parts)
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


@register_task("longdoc_multihop", metric="string_match_part")
def longdoc_multihop(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    questions_per_doc: int = 8,
    distractors: int = 8,
    essay_source: str | None = None,
) -> list[Sample]:
    """Two-hop questions over generated documents of at most ``length`` tokens (context + question)."""
    check_tokenizer(tokenizer)
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    if length > MAX_LONGDOC_TOKENS:
        raise LonglabError(
            f"length must be at most {MAX_LONGDOC_TOKENS} tokens for longdoc_multihop, got {length}"
        )
    for name, value, high in (
        ("questions_per_doc", questions_per_doc, 64),
        ("distractors", distractors, 256),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not (1 if name[0] == "q" else 0) <= value <= high
        ):
            raise LonglabError(
                f"{name} must be an integer in [{1 if name[0] == 'q' else 0}, {high}], got {shorten(value)}"
            )
    source, sentences = essay_sentences(essay_source)
    out: list[Sample] = []
    n_docs = -(-num_samples // questions_per_doc)
    for d in range(n_docs):
        rng = sample_rng("longdoc_multihop", seed, d)
        taken: set[str] = set()
        q = min(questions_per_doc, num_samples - d * questions_per_doc)
        people = _names(rng, q, (_FIRST, _LAST), " ", taken)
        orgs = _names(rng, q + distractors, (_ORG_A, _ORG_B), " ", taken)
        cities = _names(rng, q + distractors, (_CITY_A, _CITY_B), "", taken)
        inserts = []  # (depth, fact): hop 2 lies 0.3..0.6 of the document away from hop 1 (wrapping)
        for p, o, c in zip(people, orgs, cities):
            d1 = rng.uniform(0.03, 0.97)
            d2 = 0.03 + (d1 - 0.03 + rng.uniform(0.3, 0.6)) % 0.94
            inserts += [(d1, f"{p} works for the {o}."), (d2, f"The {o} has its headquarters in {c}.")]
        inserts += [
            (rng.uniform(0.03, 0.97), f"The {o} has its headquarters in {c}.")
            for o, c in zip(orgs[q:], cities[q:])
        ]
        start = rng.randrange(len(sentences))
        questions = [f"In which city is the main office of the employer of {p}?" for p in people]
        longest_q = max(count_tokens(tokenizer, x) for x in questions)

        def text_of(n: int, start: int = start, inserts: list = inserts) -> str:
            units = [sentences[(start + i) % len(sentences)] for i in range(n)]
            return join_with_inserts(units, inserts, " ")[0]

        try:
            n = fit_units(
                lambda n: count_tokens(tokenizer, text_of(n)),
                length - longest_q,
                0,
                guess=length // 30,
                slack=32,
            )
        except LengthTooSmall as exc:
            raise LonglabError(
                f"length {length} is too small for {q} two-hop chains and {distractors} "
                f"distractors (the facts alone take {exc.args[0]} tokens); raise length or "
                f"lower questions_per_doc / distractors"
            ) from None
        context = text_of(n)
        doc_id = "doc-" + hashlib.sha256(context.encode()).hexdigest()[:12]
        for j, (person, city) in enumerate(zip(people, cities)):
            out.append(
                Sample(
                    context=context,
                    question=questions[j],
                    answers=[city],
                    max_new_tokens=32,
                    task="longdoc_multihop",
                    length=length,
                    sample_id=f"longdoc_multihop-{length}-s{seed}-d{d}-q{j}",
                    metadata={
                        "doc": doc_id,
                        "hops": 2,
                        "person": person,
                        "organization": orgs[j],
                        "haystack_source": source,
                    },
                )
            )
    return out


declare_task(MEMORY_JSONL_TASK, metric="string_match_part")


def _text_field(obj: dict, key: str, line: int, max_chars: int) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise LonglabError(f"line {line}: {key} must be a non-empty string, got {shorten(value)}")
    if len(value) > max_chars:
        raise LonglabError(f"line {line}: {key} has {len(value)} characters, more than {max_chars}")
    return value


def load_memory_jsonl(
    path: str | os.PathLike, *, max_samples: int = 10_000, max_chars: int = 400_000
) -> list[Sample]:
    """Samples from a user's NarrativeQA- or LoCoMo-style JSONL (see the module docstring)."""
    raw = read_user_file(path, "--data", max_bytes=256 << 20)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LonglabError(f"--data {shorten(str(path))} is not UTF-8 text ({exc})") from None
    out: list[Sample] = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) >= max_samples:
            raise LonglabError(f"--data {shorten(str(path))} has more than max_samples={max_samples} samples")
        try:
            obj = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError as exc:
            raise LonglabError(f"line {line_no}: not a JSON object ({shorten(str(exc))})") from None
        if not isinstance(obj, dict):
            raise LonglabError(f"line {line_no}: expected a JSON object, got {shorten(obj)}")
        if "conversation" in obj:
            turns = obj["conversation"]
            if not isinstance(turns, list) or not turns:
                raise LonglabError(
                    f"line {line_no}: conversation must be a non-empty list of "
                    f"{{speaker, text}}, got {shorten(turns)}"
                )
            rows = []
            for i, t in enumerate(turns):
                if (
                    not isinstance(t, dict)
                    or not isinstance(t.get("speaker"), str)
                    or not isinstance(t.get("text"), str)
                ):
                    raise LonglabError(
                        f"line {line_no}: conversation[{i}] must be {{speaker: str, text: str}}, "
                        f"got {shorten(t)}"
                    )
                rows.append(f"{t['speaker']}: {t['text']}")
            context = "\n".join(rows)
            if len(context) > max_chars:
                raise LonglabError(
                    f"line {line_no}: conversation has {len(context)} characters, more than {max_chars}"
                )
        else:
            key = "document" if "document" in obj else "context"
            context = _text_field(obj, key, line_no, max_chars)
        question = _text_field(obj, "question", line_no, 10_000)
        answers = obj.get("answers", obj.get("answer"))
        if isinstance(answers, str):
            answers = [answers]
        if (
            not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)
            or len(answers) > 64
        ):
            raise LonglabError(
                f"line {line_no}: answers must be a non-empty string or a list of 1..64 "
                f"non-empty strings, got {shorten(answers)}"
            )
        sid = obj.get("id", f"{MEMORY_JSONL_TASK}-{line_no}")
        doc = obj.get("doc_id", "doc-" + hashlib.sha256(context.encode()).hexdigest()[:12])
        if not isinstance(sid, str) or not isinstance(doc, str):
            raise LonglabError(f"line {line_no}: id and doc_id must be strings")
        out.append(
            Sample(
                context=context,
                question=question,
                answers=answers,
                max_new_tokens=32,
                task=MEMORY_JSONL_TASK,
                sample_id=sid,
                metadata={"doc": doc},
            )
        )
    if not out:
        raise LonglabError(f"--data {shorten(str(path))} holds no samples")
    return out
