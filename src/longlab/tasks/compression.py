"""Tasks for context compression (issue #13): redundant haystacks and citations, with exact answers.

- ``redundant_niah``: a haystack of near-duplicate "frames" — a few sentence templates repeated with
  one word changed ("The north corridor is quiet and the lamp stands by the door.") — the redundancy
  that token merging (HiCo/ToMe) and the TPP rule remove; ``num_needles`` (1-3) needles "The special
  magic number for the {key} archive is {7 digits}." at random depths, one asked. ``hops=2``: the asked
  archive's needle is replaced by a link "The {key1} archive points to the {key2} archive." and
  the number is stated for ``key2`` (multi-hop: needle -> needle).
- ``cite_qa``: the context is numbered sentences ``[1] ... [n]`` (essay prose) holding 2 facts that
  together answer the question (a keeper and the keeper's badge number); the answer is the number with
  its citations, e.g. ``5531904 [12][30]``. Scored by :func:`answer_citation` (answer correctness and
  citation F1 against the true sentence ids, averaged); :func:`citation_scores` gives both parts.

- ``lookup_chain``: a chain of assignments ``"Let v7 = v6 + 13."`` (small additions and subtractions of
  the previous variable), as many as ``length`` holds; the question asks for the last variable's value,
  which takes one reasoning step per line — a chain longer than any bounded reasoning segment (the
  InftyThink setting). ``reason=True`` asks for the steps to be worked out and scores the number the
  answer ends on (:func:`final_number`).
- ``lookup_chain_reason``: ``lookup_chain`` with ``reason=True`` as a task of its own, so that
  ``longlab eval --tasks lookup_chain_reason`` runs InftyThink's setting (Yan et al., arXiv 2503.06692;
  ``bench/configs/compression-inftythink.toml``).

All are sized in the model's tokens: context + question never exceed ``length``.
"""

from __future__ import annotations

import random
import re

from .haystacks import (
    LengthTooSmall,
    Tokenizer,
    check_length,
    check_num_samples,
    check_seed,
    count_tokens,
    essay_sentences,
    fit_units,
    sample_rng,
    words,
)
from .registry import register_task
from .sample import Sample
from .scoring import Refs, _refs, register_metric

__all__ = ["redundant_niah", "cite_qa", "lookup_chain", "lookup_chain_reason", "answer_citation",
           "citation_scores", "final_number", "frames"]

_PLACES = ("north", "south", "east", "west", "upper", "lower")
_STATES = ("quiet", "empty", "dim", "still", "calm", "silent")
_THINGS = ("lamp", "chair", "crate", "ladder", "bucket", "bench")
_SPOTS = ("door", "window", "wall", "stairs", "corner", "gate")
_TEMPLATES = (
    "The {p} corridor is {s} and the {t} stands by the {o}.",
    "In the {p} hall the {t} rests near the {o} and all is {s}.",
    "Nothing moves in the {p} room; the {t} is by the {o} and the air is {s}.",
)


def frames(rng: random.Random, count: int) -> list[str]:
    """``count`` near-duplicate filler sentences: a template with one slot changed from the previous."""
    slots = {"p": _PLACES, "s": _STATES, "t": _THINGS, "o": _SPOTS}
    state = {k: rng.choice(v) for k, v in slots.items()}
    template = rng.choice(_TEMPLATES)
    out = []
    for _ in range(count):
        key = rng.choice(list(slots))
        state[key] = rng.choice(slots[key])
        if rng.random() < 0.1:
            template = rng.choice(_TEMPLATES)
        out.append(template.format(**state))
    return out


def _keys(rng: random.Random, n: int) -> list[str]:
    w = words()
    out: list[str] = []
    while len(out) < n:
        k = f"{rng.choice(w['adjectives'])}-{rng.choice(w['nouns'])}"
        if k not in out:
            out.append(k)
    return out


def _numbers(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = str(rng.randint(10**6, 10**7 - 1))
        if x not in out:
            out.append(x)
    return out


def _place(rng: random.Random, units: list[str], inserts: list[str]) -> list[str]:
    """``units`` with each insert at a random boundary (inserts keep their relative order)."""
    at = sorted(rng.randint(0, len(units)) for _ in inserts)
    out, j = [], 0
    for i in range(len(units) + 1):
        while j < len(inserts) and at[j] == i:
            out.append(inserts[j])
            j += 1
        if i < len(units):
            out.append(units[i])
    return out


@register_task("redundant_niah", metric="string_match_all")
def redundant_niah(
    tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, *, num_needles: int = 2,
    hops: int = 1,
) -> list[Sample]:
    """Near-duplicate filler with ``num_needles`` needles, one asked; ``hops=2`` chains needle -> needle
    (see the module docstring)."""
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    if isinstance(num_needles, bool) or not isinstance(num_needles, int) or not 1 <= num_needles <= 3:
        raise ValueError(f"num_needles must be an integer in [1, 3], got {num_needles!r}")
    if hops not in (1, 2) or isinstance(hops, bool):
        raise ValueError(f"hops must be 1 or 2, got {hops!r}")
    task = "redundant_niah" if hops == 1 else "redundant_niah_2hop"
    out = []
    for index in range(num_samples):
        rng = sample_rng("redundant_niah", seed, index, num_needles, hops)
        keys = _keys(rng, num_needles + 1)
        values = _numbers(rng, num_needles + 1)
        gold = rng.randrange(num_needles)
        needles = [f"The special magic number for the {k} archive is {v}." for k, v in
                   zip(keys[:num_needles], values[:num_needles])]
        if hops == 2:  # the asked key links to an extra key, whose number is the answer
            needles[gold] = f"The {keys[gold]} archive points to the {keys[-1]} archive."
            needles.append(f"The special magic number for the {keys[-1]} archive is {values[-1]}.")
            answer = values[-1]
            question = (f"Which special magic number belongs to the archive that the {keys[gold]} archive "
                        "points to?")
        else:
            answer = values[gold]
            question = f"What is the special magic number for the {keys[gold]} archive?"
        rng.shuffle(needles)
        pool = frames(rng, 4000)
        order = [rng.random() for _ in needles]

        inserts = [needles[i] for i in sorted(range(len(needles)), key=lambda i: order[i])]

        def build(n: int, pool: list[str] = pool, inserts: list[str] = inserts, index: int = index) -> str:
            return " ".join(_place(random.Random(f"{seed}/{index}/{n}"), pool[:n], inserts))

        budget = length - count_tokens(tokenizer, question)
        try:
            n = fit_units(lambda n: count_tokens(tokenizer, build(n)), budget, 0, guess=budget // 14,
                          max_n=len(pool))
        except LengthTooSmall:
            raise ValueError(f"length {length} is too small for redundant_niah's needles and question") \
                from None
        context = build(n)
        out.append(Sample(
            context=context, question=question, answer_prefix="The special magic number is",
            answers=[answer], max_new_tokens=12, task=task, length=length,
            sample_id=f"{task}-{length}-n{num_needles}-s{seed}-{index}",
            metadata={"num_needles": num_needles, "hops": hops, "frames": n,
                      "context_tokens": count_tokens(tokenizer, context),
                      "question_tokens": count_tokens(tokenizer, question)},
        ))
    return out


@register_task("redundant_niah_2hop", metric="string_match_all")
def redundant_niah_2hop(tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, *,
                        num_needles: int = 2) -> list[Sample]:
    """:func:`redundant_niah` with ``hops=2``."""
    return redundant_niah(tokenizer, length, num_samples, seed, num_needles=num_needles, hops=2)


_CITE = re.compile(r"\[(\d+)\]")


def citation_scores(pred: str, refs: Refs) -> dict[str, float]:
    """``refs = [answer, "[id]", "[id]", ...]``: answer correctness (answer contained in ``pred``) and
    citation precision/recall/F1 of the ``[k]`` markers in ``pred`` against the true ids."""
    answer, *ids = _refs(refs)
    truth = {int(m) for i in ids for m in re.findall(r"\d+", i)}
    cited = {int(m) for m in _CITE.findall(pred)}
    hit = len(cited & truth)
    p = hit / len(cited) if cited else 0.0
    r = hit / len(truth) if truth else 0.0
    f1 = 2 * p * r / (p + r) if p + r else 0.0
    return {"correct": float(answer.lower() in pred.lower()), "precision": p, "recall": r, "f1": f1}


@register_metric("answer_citation")
def answer_citation(pred: str, refs: Refs) -> float:
    """Mean of answer correctness and citation F1 (:func:`citation_scores`)."""
    s = citation_scores(pred, refs)
    return (s["correct"] + s["f1"]) / 2


@register_task("cite_qa", metric="answer_citation")
def cite_qa(tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0) -> list[Sample]:
    """Numbered sentences with a two-fact answer and its citations (see the module docstring)."""
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    _, prose = essay_sentences(None)
    out = []
    for index in range(num_samples):
        rng = sample_rng("cite_qa", seed, index)
        key = _keys(rng, 1)[0]
        person = f"{rng.choice(('Nora', 'Ivan', 'Lena', 'Omar', 'Greta', 'Felix'))} " \
                 f"{rng.choice(('Quint', 'Harlow', 'Brandt', 'Okafor', 'Novak', 'Falk'))}"
        number = _numbers(rng, 1)[0]
        facts = [f"The {key} archive is kept by {person}.", f"{person} has badge number {number}."]
        question = (f"What is the badge number of the keeper of the {key} archive? Answer with the number "
                    "and cite the sentences you used as [k].")
        start = rng.randrange(len(prose))

        def build(n: int, start: int = start, index: int = index, facts: list[str] = facts
                  ) -> tuple[str, list[int]]:
            body = [prose[(start + i) % len(prose)] for i in range(n)]
            r = random.Random(f"cite/{seed}/{index}/{n}")
            a, b = sorted(r.sample(range(n + 2), 2))
            sents = body[:]
            sents.insert(a, facts[0])
            sents.insert(b, facts[1])
            return " ".join(f"[{i + 1}] {s}" for i, s in enumerate(sents)), [a + 1, b + 1]

        budget = length - count_tokens(tokenizer, question)
        try:
            n = fit_units(lambda n: count_tokens(tokenizer, build(n)[0]), budget, 0, guess=budget // 30)
        except LengthTooSmall:
            raise ValueError(f"length {length} is too small for cite_qa") from None
        context, ids = build(n)
        out.append(Sample(
            context=context, question=question, answer_prefix="Answer:",
            answers=[number, *(f"[{i}]" for i in ids)],
            max_new_tokens=48, task="cite_qa", length=length, sample_id=f"cite_qa-{length}-s{seed}-{index}",
            metadata={"cited": ids, "sentences": n + 2, "context_tokens": count_tokens(tokenizer, context),
                      "question_tokens": count_tokens(tokenizer, question)},
        ))
    return out


_NUMBER = re.compile(r"-?\d+")


@register_metric("final_number")
def final_number(pred: str, refs: Refs) -> float:
    """1 if the number a worked answer ends on equals the answer: the first number after the last
    ``Answer:`` when there is one, else the last number in ``pred`` (so an intermediate result that
    happens to equal the answer does not count)."""
    answer = _refs(refs)[0].strip()
    _, mark, tail = pred.rpartition("Answer:")
    found = _NUMBER.findall(tail)[:1] if mark and _NUMBER.search(tail) else _NUMBER.findall(pred)[-1:]
    return float(bool(found) and found[0] == answer)


@register_task("lookup_chain", metric="string_match_all")
def lookup_chain(
    tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, reason: bool = False
) -> list[Sample]:
    """A chain of additions over variables; the answer is the last one's value (module docstring).

    ``reason=True``: the same chain asked to be worked out step by step (no answer prefix, up to
    ``REASON_TOKENS`` new tokens, ending in ``Answer: <number>``), scored by :func:`final_number`: the
    setting where the reasoning, not the input, is long (InftyThink)."""
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    if not isinstance(reason, bool):
        raise ValueError(f"lookup_chain: reason must be true or false, got {reason!r}")
    out = []
    for index in range(num_samples):
        rng = sample_rng("lookup_chain", seed, index)
        start = rng.randint(100, 999)
        steps = [rng.choice((-1, 1)) * rng.randint(2, 19) for _ in range(4000)]

        def build(n: int, start: int = start, steps: list[int] = steps) -> tuple[str, int, str]:
            lines, value = [f"Let v0 = {start}."], start
            for i, d in enumerate(steps[:n]):
                lines.append(f"Let v{i + 1} = v{i} {'+' if d > 0 else '-'} {abs(d)}.")
                value += d
            question = f"What is the value of v{n}?"
            return " ".join(lines), value, question + (REASON_QUESTION if reason else "")

        def size(n: int) -> int:
            context, _, question = build(n)
            return count_tokens(tokenizer, context) + count_tokens(tokenizer, question)

        try:
            n = fit_units(size, length, 1, guess=length // 14, max_n=len(steps))
        except LengthTooSmall:
            raise ValueError(f"length {length} is too small for lookup_chain") from None
        context, value, question = build(n)
        out.append(Sample(
            context=context, question=question, answer_prefix="" if reason else f"v{n} =",
            answers=[str(value)], max_new_tokens=REASON_TOKENS if reason else 16, task="lookup_chain",
            length=length, metric="final_number" if reason else "",
            sample_id=f"lookup_chain{'-reason' if reason else ''}-{length}-s{seed}-{index}",
            metadata={"steps": n, "context_tokens": count_tokens(tokenizer, context),
                      "question_tokens": count_tokens(tokenizer, question)},
        ))
    return out


@register_task("lookup_chain_reason", metric="final_number")
def lookup_chain_reason(
    tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0
) -> list[Sample]:
    """:func:`lookup_chain` with ``reason=True`` (worked out step by step, scored by :func:`final_number`)
    as a task of its own: the samples and their ids are the same, the rows' task is
    ``lookup_chain_reason``."""
    samples = lookup_chain(tokenizer, length, num_samples, seed, reason=True)
    for s in samples:
        s.task = "lookup_chain_reason"
    return samples


# the format example is a placeholder, never a number: a concrete one ('v1 = 905') was sample 0's own v1
REASON_QUESTION = (" Work it out one variable at a time, one short line each (like 'vK = <number>'), and end "
                   "with 'Answer: <number>'.")
REASON_TOKENS = 1024
