"""Multi-document QA with exact answers, for KV reuse in retrieval-augmented prompts (issue #11).

A sample is ``m`` documents (``metadata["documents"]``, in prompt order; ``context`` is their
concatenation, each document followed by a blank line, so the plain pipeline can run it too), a question
and its exact answer. Every document is neutral prose (the essay haystack) about one archive, with facts
inserted at random depths:

- ``multidoc_qa_1`` (single hop): every document states the code of *its* archive ("The secret code of
  the amber-falcon archive is 4821937."); the question asks for one archive's code, so the other
  documents' facts are same-form distractors.
- ``multidoc_qa_2`` (two hops): one document says who keeps the asked archive ("The amber-falcon archive
  is kept by Nora Quint."), *another* document gives that person's badge number ("Nora Quint has badge
  number 5531904."); the other documents hold other keepers and other badge numbers. Answering needs
  attention across two documents that were encoded apart.

``salient`` documents (default ``m // 4``) also carry globally salient but irrelevant sentences — capitals,
urgency, a repeated number ("URGENT NOTICE: THE MOST IMPORTANT NUMBER IN THIS ENTIRE REPORT IS 7730128 —
REMEMBER 7730128!") — the tokens that draw attention and KV deviation whatever the question, the case
ProphetKV's claim is about. Answers have ``digits`` digits (default 7). Document sizes: ``doc_tokens``
tokens each (default ``(length - 64) // num_docs``), ``num_docs`` 2..64 (the issue: 4..16 of 200..800 tokens).

:func:`load_multidoc_jsonl` reads a user's file of ``{"documents": [...], "question": ..., "answers":
[...]}`` lines into the same samples.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .haystacks import (
    Tokenizer,
    check_length,
    check_num_samples,
    check_seed,
    count_tokens,
    essay_sentences,
    sample_rng,
    words,
)
from .registry import register_task
from .sample import Sample

__all__ = ["multidoc_qa_1", "multidoc_qa_2", "load_multidoc_jsonl", "join_documents", "MULTIDOC_TASKS"]

MULTIDOC_TASKS = ("multidoc_qa_1", "multidoc_qa_2")
_FIRST = (
    "Nora",
    "Ivan",
    "Lena",
    "Omar",
    "Greta",
    "Felix",
    "Mira",
    "Tobias",
    "Alma",
    "Rafael",
    "Edith",
    "Hugo",
    "Selma",
    "Victor",
    "Ingrid",
    "Pablo",
    "Clara",
    "Anton",
    "Freya",
    "Milo",
    "Ada",
    "Bruno",
    "Elsa",
    "Jonas",
)
_LAST = (
    "Quint",
    "Harlow",
    "Brandt",
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Castell",
    "Varga",
    "Pereira",
    "Novak",
    "Ashby",
    "Kessler",
    "Duarte",
    "Whitcombe",
    "Sorensen",
    "Ibarra",
    "Falk",
    "Renner",
    "Mendel",
    "Ostrov",
)


def join_documents(documents: list[str]) -> str:
    """The documents as one context: each without trailing whitespace, followed by a blank line (the
    layout ``longlab.reuse`` uses, so both paths see the same text)."""
    return "".join(d.rstrip() + "\n\n" for d in documents)


def _keys(rng: random.Random, count: int) -> list[str]:
    w, out = words(), []
    while len(out) < count:
        key = f"{rng.choice(w['adjectives'])}-{rng.choice(w['nouns'])}"
        if key not in out:
            out.append(key)
    return out


def _numbers(rng: random.Random, count: int, taken: set[str], digits: int = 7) -> list[str]:
    out = []
    while len(out) < count:
        x = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def _people(rng: random.Random, count: int) -> list[str]:
    pairs = [f"{f} {s}" for f in _FIRST for s in _LAST]
    rng.shuffle(pairs)
    return pairs[:count]


def _document(
    tokenizer: Tokenizer,
    rng: random.Random,
    sentences: tuple[str, ...],
    title: str,
    facts: list[str],
    target: int,
) -> str:
    """A document of at most ``target`` tokens: ``title``, essay sentences (the last one cut to fill the
    budget), ``facts`` at random depths."""
    start = rng.randrange(len(sentences))
    body: list[str] = []

    def size(extra: list[str]) -> int:
        return count_tokens(tokenizer, " ".join([title, *facts, *body, *extra]))

    i = 0
    while i < 10 * len(sentences):
        candidate = sentences[(start + i) % len(sentences)]
        if size([candidate]) > target:
            break
        body.append(candidate)
        i += 1
    words: list[str] = []
    for w in sentences[(start + i) % len(sentences)].split():
        if size([" ".join([*words, w]).rstrip(".") + "."]) > target:
            break
        words.append(w)
    if words:
        body.append(" ".join(words).rstrip(".") + ".")
    for fact in facts:
        body.insert(rng.randint(0, len(body)), fact)
    return " ".join([title, *body])


def _target(tokenizer: Tokenizer, length: int, num_docs: int, doc_tokens: int | None, question: str) -> int:
    """Tokens per document: ``doc_tokens``, else what ``length`` leaves after the question and separators."""
    if doc_tokens is not None:
        return doc_tokens
    sep = count_tokens(tokenizer, "x\n\n") - count_tokens(tokenizer, "x")
    return (length - count_tokens(tokenizer, question) - num_docs * max(sep, 1) - 2) // num_docs


def _check(tokenizer: Tokenizer, length: int, num_samples: int, seed: int, num_docs: int) -> None:
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or not 2 <= num_docs <= 64:
        raise ValueError(f"num_docs must be an integer in [2, 64], got {num_docs!r}")


def _sizes(length: int, num_docs: int, doc_tokens: int | None) -> int:
    size = doc_tokens if doc_tokens is not None else (length - 64) // num_docs
    if isinstance(size, bool) or not isinstance(size, int) or size < 48:
        raise ValueError(
            f"doc_tokens must be an integer >= 48 (length {length} over {num_docs} documents gives {size}); "
            "raise length or lower num_docs"
        )
    return size


def _check_digits(digits: int) -> int:
    if isinstance(digits, bool) or not isinstance(digits, int) or not 3 <= digits <= 12:
        raise ValueError(f"digits must be an integer in [3, 12] (answer length), got {digits!r}")
    return digits


def _salient(rng: random.Random, taken: set[str]) -> str:
    (num,) = _numbers(rng, 1, taken)
    return (
        f"URGENT NOTICE: THE MOST IMPORTANT NUMBER IN THIS ENTIRE REPORT IS {num}. REMEMBER {num}! "
        f"NOTHING ELSE MATTERS AS MUCH AS {num}."
    )


def _sample(
    tokenizer: Tokenizer, task: str, documents: list[str], question: str, prefix: str, answer: str, meta: dict
) -> Sample:
    context = join_documents(documents)
    meta = {
        **meta,
        "context_tokens": count_tokens(tokenizer, context),
        "question_tokens": count_tokens(tokenizer, question),
    }
    return Sample(
        context=context,
        question=question,
        answer_prefix=prefix,
        answers=[answer],
        max_new_tokens=12,
        task=task,
        metadata={"documents": documents, **meta},
    )


@register_task("multidoc_qa_1", metric="string_match_all")
def multidoc_qa_1(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    num_docs: int = 8,
    doc_tokens: int | None = None,
    salient: int | None = None,
    essay_source: str | None = None,
    digits: int = 7,
) -> list[Sample]:
    """Single hop: the code of one archive, stated in one of ``num_docs`` documents (see the module doc)."""
    _check(tokenizer, length, num_samples, seed, num_docs)
    _sizes(length, num_docs, doc_tokens)
    n_salient = num_docs // 4 if salient is None else salient
    source, sentences = essay_sentences(essay_source)
    out = []
    for index in range(num_samples):
        rng = sample_rng("multidoc_qa_1", seed, index)
        keys = _keys(rng, num_docs)
        taken: set[str] = set()
        codes = _numbers(rng, num_docs, taken, _check_digits(digits))
        gold = rng.randrange(num_docs)
        loud = set(rng.sample([i for i in range(num_docs) if i != gold], min(n_salient, num_docs - 1)))
        question = f"What is the secret code of the {keys[gold]} archive?"
        target = _target(tokenizer, length, num_docs, doc_tokens, question)
        docs = []
        for i in range(num_docs):
            facts = [f"The secret code of the {keys[i]} archive is {codes[i]}."]
            if i in loud:
                facts.append(_salient(rng, taken))
            title = f"Report on the {keys[i]} archive."
            docs.append(_document(tokenizer, rng, sentences, title, facts, target))
        prefix = f"The secret code of the {keys[gold]} archive is"
        meta = {"gold_docs": [gold], "salient_docs": sorted(loud), "hops": 1, "haystack_source": source}
        out.append(_sample(tokenizer, "multidoc_qa_1", docs, question, prefix, codes[gold], meta))
        out[-1].sample_id = f"multidoc_qa_1-{length}-s{seed}-{index}"
        out[-1].length = length
    return out


@register_task("multidoc_qa_2", metric="string_match_all")
def multidoc_qa_2(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    num_docs: int = 8,
    doc_tokens: int | None = None,
    salient: int | None = None,
    essay_source: str | None = None,
    reveal_keeper: bool = False,
    digits: int = 7,
) -> list[Sample]:
    """Two hops: who keeps the archive (one document), that person's badge number (another document).
    ``reveal_keeper=True`` names the keeper in the answer prefix (the first hop given away)."""
    _check(tokenizer, length, num_samples, seed, num_docs)
    _sizes(length, num_docs, doc_tokens)
    n_salient = num_docs // 4 if salient is None else salient
    source, sentences = essay_sentences(essay_source)
    out = []
    for index in range(num_samples):
        rng = sample_rng("multidoc_qa_2", seed, index)
        keys = _keys(rng, num_docs)
        people = _people(rng, num_docs)
        taken: set[str] = set()
        badges = _numbers(rng, num_docs, taken, _check_digits(digits))
        keeper = list(range(num_docs))
        rng.shuffle(keeper)  # archive i is kept by person keeper[i]
        # document i states who keeps archive i, and the badge of the person kept-by archive (i + 1) % m:
        # the two facts of one chain are always in different documents
        gold = rng.randrange(num_docs)
        badge_doc = {keeper[(i + 1) % num_docs]: i for i in range(num_docs)}
        loud = set(rng.sample(range(num_docs), min(n_salient, num_docs)))
        question = (
            f"Who keeps the {keys[gold]} archive, and what is that person's badge number? "
            "Answer with the badge number."
        )
        target = _target(tokenizer, length, num_docs, doc_tokens, question)
        docs = []
        for i in range(num_docs):
            p = keeper[(i + 1) % num_docs]
            facts = [
                f"The {keys[i]} archive is kept by {people[keeper[i]]}.",
                f"{people[p]} has badge number {badges[p]}.",
            ]
            if i in loud:
                facts.append(_salient(rng, taken))
            title = f"Report on the {keys[i]} archive."
            docs.append(_document(tokenizer, rng, sentences, title, facts, target))
        person = keeper[gold]
        prefix = (
            f"The {keys[gold]} archive is kept by {people[person]}, whose badge number is"
            if reveal_keeper
            else "The badge number is"
        )
        meta = {
            "gold_docs": [gold, badge_doc[person]],
            "salient_docs": sorted(loud),
            "hops": 2,
            "haystack_source": source,
        }
        out.append(_sample(tokenizer, "multidoc_qa_2", docs, question, prefix, badges[person], meta))
        out[-1].sample_id = f"multidoc_qa_2-{length}-s{seed}-{index}"
        out[-1].length = length
    return out


def load_multidoc_jsonl(path: str | os.PathLike, task: str = "multidoc_file") -> list[Sample]:
    """Samples from a JSONL file of ``{"documents": [str, ...], "question": str, "answers": [str, ...]}``
    lines (optional ``answer_prefix``, ``max_new_tokens``, ``sample_id``, ``task``). A bad line raises a
    ValueError naming the line and the key."""
    out = []
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"multidoc JSONL: no such file: {p}")
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}:{lineno}: not JSON ({err.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}:{lineno}: a line must be a JSON object")
        docs = data.get("documents")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d.strip() for d in docs):
            raise ValueError(f"{p}:{lineno}: 'documents' must be a non-empty list of non-empty strings")
        record = {k: v for k, v in data.items() if k != "documents"}
        record["context"] = join_documents(docs)
        record.setdefault("task", task)
        try:
            sample = Sample.from_dict(record)
        except ValueError as err:
            raise ValueError(f"{p}:{lineno}: {err}") from None
        sample.metadata["documents"] = docs
        sample.sample_id = sample.sample_id or f"{p.stem}-{lineno}"
        out.append(sample)
    if not out:
        raise ValueError(f"multidoc JSONL: {p} has no samples")
    return out
