"""Scorers for generated answers, each returning a float in [0, 1].

* ``string_match_all`` / ``string_match_part``: RULER's case-insensitive containment metrics (Hsieh et
  al. 2024); RULER reports the mean over samples times 100.
* ``exact_match`` / ``token_f1``: SQuAD-style (Rajpurkar et al. 2016) with its answer normalisation.
* ``rouge_l``: ROUGE-L F-measure (Lin 2004) from the maintained ``rouge-score`` package.
* ``first_int_match``: pass-key accuracy (Mohtashami & Jaggi 2023), the first integer generated.

Which metric a task is scored with is recorded where the task is registered
(:mod:`longlab.tasks.registry`: ``metric_for``, ``score``); :func:`register_metric` adds a metric.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

__all__ = [
    "string_match_all",
    "string_match_part",
    "exact_match",
    "token_f1",
    "rouge_l",
    "first_int_match",
    "normalize_answer",
    "METRICS",
    "register_metric",
]

Refs = str | Sequence[str]


def _refs(refs: Refs) -> list[str]:
    if isinstance(refs, str):
        refs = [refs]
    refs = [str(r) for r in refs]
    if not refs:
        raise ValueError("refs must contain at least one reference answer, got an empty list")
    return refs


def string_match_all(pred: str, refs: Refs) -> float:
    """Fraction of references contained in ``pred``, case-insensitive (RULER, NIAH/vt/cwe/fwe)."""
    refs = _refs(refs)
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Refs) -> float:
    """1.0 if any reference is contained in ``pred``, case-insensitive (RULER, QA)."""
    p = pred.lower()
    return float(any(r.lower() in p for r in _refs(refs)))


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(pred: str, refs: Refs) -> float:
    """1.0 if the normalised prediction equals any normalised reference (SQuAD)."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(r) for r in _refs(refs)))


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    if not pred_tokens or not ref_tokens:
        return float(pred_tokens == ref_tokens)
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str, refs: Refs) -> float:
    """Max over references of the bag-of-tokens F1 after SQuAD normalisation."""
    p = normalize_answer(pred).split()
    return max(_f1(p, normalize_answer(r).split()) for r in _refs(refs))


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:  # pragma: no cover - rouge-score is a declared dependency
        raise ImportError("rouge_l needs the 'rouge-score' package: pip install rouge-score") from err
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(pred: str, refs: Refs) -> float:
    """Max over references of the ROUGE-L F-measure (``rouge-score``'s tokenizer, no stemming)."""
    scorer = _rouge_scorer()
    return max(scorer.score(r, pred)["rougeL"].fmeasure for r in _refs(refs))


_INT = re.compile(r"\d+")


def first_int_match(pred: str, refs: Refs) -> float:
    """1.0 if the first integer in ``pred`` equals any reference integer (pass-key accuracy)."""
    m = _INT.search(pred)
    if m is None:
        return 0.0
    got = int(m.group())
    out = 0.0
    for r in _refs(refs):
        r = r.strip()
        if r.isdigit() and int(r) == got:
            out = 1.0
    return out


METRICS: dict[str, Callable[[str, Refs], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "exact_match": exact_match,
    "token_f1": token_f1,
    "rouge_l": rouge_l,
    "first_int_match": first_int_match,
}


def register_metric(name: str) -> Callable[[Callable[[str, Refs], float]], Callable[[str, Refs], float]]:
    """Decorator: make ``fn(prediction, refs) -> float in [0, 1]`` available as metric ``name``."""

    def wrap(fn: Callable[[str, Refs], float]) -> Callable[[str, Refs], float]:
        if name in METRICS and METRICS[name] is not fn:
            raise ValueError(f"metric {name!r} registered twice")
        METRICS[name] = fn
        return fn

    return wrap
