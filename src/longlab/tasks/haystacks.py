"""Shared pieces of the task generators: token counting, argument checks, haystack text, fitting.

Everything here is offline and seeded. Haystacks follow RULER (Hsieh et al. 2024): ``noise`` is the
repeated sentence group below, ``essay`` is real English prose, ``needle`` is distractor needles
(built by the NIAH generator itself).

Essay source. RULER uses Paul Graham's essays, which cannot ship here. No PyPI package was found
that installs public-domain prose usable offline (the Gutenberg packages on PyPI download books at
run time), so the default is ``src/longlab/data/tasks_essay.txt``: original, neutral prose written
for longlab (about 2k words, repeated as needed). ``essay_source`` (or the environment variable
``LONGLAB_ESSAY_SOURCE``) may instead name a UTF-8 text file (for example the PG essays concatenated)
or ``"nltk"`` for NLTK's Gutenberg prose when its corpus is already on disk (never downloaded).
``"auto"`` (the default) takes NLTK's Gutenberg prose when present, else the built-in file. The
source used is recorded in every sample's ``metadata["haystack_source"]``.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import random
import re
import sys
import zipfile
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "NOISE",
    "Tokenizer",
    "count_tokens",
    "check_tokenizer",
    "check_length",
    "check_num_samples",
    "check_seed",
    "check_depth",
    "sample_rng",
    "essay_sentences",
    "words",
    "join_with_inserts",
    "fit_units",
    "LengthTooSmall",
]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's noise haystack unit (also the passkey filler of Mohtashami & Jaggi 2023)."""

ESSAY_ENV = "LONGLAB_ESSAY_SOURCE"
_NLTK_PROSE = (
    "austen-emma.txt",
    "austen-persuasion.txt",
    "austen-sense.txt",
    "chesterton-ball.txt",
    "chesterton-brown.txt",
    "chesterton-thursday.txt",
    "melville-moby_dick.txt",
)


class Tokenizer(Protocol):
    """Anything with ``encode(text, add_special_tokens=False) -> list[int]`` (e.g. a HF tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class LengthTooSmall(ValueError):
    """``length`` cannot hold the task's fixed parts (template, question, needles)."""


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # tokenizers without the keyword (e.g. tiktoken-like objects)
        ids = tokenizer.encode(text)
    return len(ids)


def check_tokenizer(tokenizer: Any) -> None:
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            "tokenizer must have an encode(text, add_special_tokens=False) method, "
            f"got {type(tokenizer).__name__}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_length(length: Any, name: str = "length") -> int:
    if not _is_int(length) or length < 1:
        raise ValueError(f"{name} must be an integer >= 1 (tokens), got {length!r}")
    return length


def check_num_samples(num_samples: Any) -> int:
    if not _is_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    return num_samples


def check_seed(seed: Any) -> int:
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return seed


def check_depth(depth: Any, name: str = "depth") -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1] (fraction of the haystack), got {depth!r}")
    return float(depth)


def sample_rng(task: str, seed: int, index: int, *extra: object) -> random.Random:
    """The RNG of one sample: a pure function of (task, seed, index), independent of ``num_samples``.

    String seeds are hashed with SHA-512 by :class:`random.Random`, so this is stable across runs and
    ``PYTHONHASHSEED``.
    """
    key = "/".join(str(p) for p in ("longlab.tasks", task, seed, index, *extra))
    return random.Random(key)


# --------------------------------------------------------------------------- data files


def _data_text(name: str) -> str:
    return resources.files("longlab").joinpath("data", name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def words() -> dict[str, tuple[str, ...]]:
    """Common English words (``adjectives``, ``nouns``, ``verbs``) shipped in ``tasks_words.json``."""
    data = json.loads(_data_text("tasks_words.json"))
    return {k: tuple(data[k]) for k in ("adjectives", "nouns", "verbs")}


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
_BANNED = ("special magic", "pass key", "passkey")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: paragraphs split on blank lines, headings dropped, whitespace normalised."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para or para[-1] not in ".!?\"'":  # headings and titles have no final stop
            continue
        for sent in _SENTENCE_END.split(para):
            sent = sent.strip()
            if (
                len(sent.split()) >= 3
                and not any(ch.isdigit() for ch in sent)  # numbers stay unique to the needles
                and not any(b in sent.lower() for b in _BANNED)
            ):
                out.append(sent)
    return out


def _nltk_data_dirs() -> list[Path]:
    """NLTK's data search path, computed without importing nltk (its import takes seconds)."""
    dirs = [Path(p) for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p]
    dirs.append(Path.home() / "nltk_data")
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        dirs += [
            Path(prefix) / "nltk_data",
            Path(prefix) / "share" / "nltk_data",
            Path(prefix) / "lib" / "nltk_data",
        ]
    dirs += [
        Path(p)
        for p in (
            "/usr/share/nltk_data",
            "/usr/local/share/nltk_data",
            "/usr/lib/nltk_data",
            "/usr/local/lib/nltk_data",
        )
    ]
    return dirs


def _nltk_prose() -> str | None:
    """NLTK's Gutenberg prose (public domain) when the corpus is already on disk; never downloads."""
    for root in _nltk_data_dirs():
        folder = root / "corpora" / "gutenberg"
        texts = [(folder / f).read_text(encoding="latin-1") for f in _NLTK_PROSE if (folder / f).is_file()]
        if not texts and (root / "corpora" / "gutenberg.zip").is_file():
            with zipfile.ZipFile(root / "corpora" / "gutenberg.zip") as zf:
                names = set(zf.namelist())
                texts = [
                    zf.read(f"gutenberg/{f}").decode("latin-1")
                    for f in _NLTK_PROSE
                    if f"gutenberg/{f}" in names
                ]
        if texts:
            return "\n\n".join(texts)
    return None


@functools.lru_cache(maxsize=8)
def essay_sentences(source: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(label, sentences) of the essay haystack; ``source`` is ``auto``, ``builtin``, ``nltk`` or a path."""
    source = source or os.environ.get(ESSAY_ENV) or "auto"
    if source in ("auto", "nltk"):
        text = _nltk_prose()
        if text is not None:
            return "nltk:gutenberg", tuple(split_sentences(text))
        if source == "nltk":
            raise ValueError(
                "essay_source='nltk' needs NLTK's Gutenberg corpus on disk (python -m nltk.downloader "
                "gutenberg); choose 'auto', 'builtin' or a text file path instead"
            )
        source = "builtin"
    if source == "builtin":
        return "builtin:tasks_essay.txt", tuple(split_sentences(_data_text("tasks_essay.txt")))
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"essay_source must be 'auto', 'builtin', 'nltk' or the path of a UTF-8 text file, got {source!r}"
        )
    sentences = tuple(split_sentences(path.read_text(encoding="utf-8")))
    if len(sentences) < 10:
        raise ValueError(
            f"essay_source {source!r} yields only {len(sentences)} usable sentences (need >= 10)"
        )
    return f"file:{path.name}", sentences


# --------------------------------------------------------------------------- assembling


def join_with_inserts(
    units: Sequence[str], inserts: Sequence[tuple[float, str]], sep: str
) -> tuple[str, list[int]]:
    """Join ``units`` with ``sep`` and insert each ``(depth, text)`` at the unit boundary nearest to
    ``depth`` (fraction of the haystack's characters), keeping the inserts' relative order.

    Returns the text and each insert's character offset (in the order given).
    """
    lengths = [len(u) for u in units]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n + len(sep))
    total = max(starts[-1] - len(sep), 0)
    starts[-1] = total  # boundary after the last unit
    at: dict[int, list[int]] = {}
    for k, (depth, _) in enumerate(inserts):
        target = depth * total
        j = bisect.bisect_left(starts, target)
        if j == len(starts) or (j > 0 and target - starts[j - 1] <= starts[j] - target):
            j -= 1
        at.setdefault(max(j, 0), []).append(k)
    pieces: list[str] = []
    piece_of_insert: dict[int, int] = {}
    for j in range(len(units) + 1):
        for k in at.get(j, ()):
            piece_of_insert[k] = len(pieces)
            pieces.append(inserts[k][1])
        if j < len(units):
            pieces.append(units[j])
    offsets_by_piece = []
    pos = 0
    for p in pieces:
        offsets_by_piece.append(pos)
        pos += len(p) + len(sep)
    return sep.join(pieces), [offsets_by_piece[piece_of_insert[k]] for k in range(len(inserts))]


def fit_units(
    measure: Callable[[int], int],
    budget: int,
    lo: int,
    guess: int | None = None,
    slack: int = 0,
    max_n: int | None = None,
) -> int:
    """Largest ``n >= lo`` with ``measure(n) <= budget`` for a non-decreasing ``measure``.

    Interpolation search alternating with bisection (RULER binary-searches the haystack size the
    same way). With ``slack > 0`` it stops early once a fitting ``n`` is within ``slack`` tokens of
    the budget. Raises :class:`LengthTooSmall` when even ``lo`` does not fit.
    """
    seen: dict[int, int] = {}

    def m(n: int) -> int:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    if m(lo) > budget:
        raise LengthTooSmall(m(lo))
    good, bad = lo, None
    if max_n is not None and max_n <= lo:
        return lo
    n = max(guess if guess is not None else lo + 8, lo + 1)
    if max_n is not None:
        n = min(n, max_n)
    interpolate = True
    prev = lo
    for _ in range(200):
        if m(n) <= budget:
            good = max(good, n)
        else:
            bad = n if bad is None else min(bad, n)
        if (bad is not None and bad - good <= 1) or (max_n is not None and good >= max_n):
            return good
        if slack and good > lo and budget - m(good) <= slack:
            return good
        slope = max((m(n) - m(prev)) / (n - prev), 1e-6) if n != prev else 1.0  # secant
        prev = n
        if interpolate or bad is None:
            room = (budget - m(good)) / slope
            cand = good + (math.ceil(room) if bad is None else int(room))
        else:
            cand = (good + bad) // 2
        interpolate = not interpolate
        cand = max(cand, good + 1)
        if bad is not None:
            cand = min(cand, bad - 1)
        if max_n is not None:
            cand = min(cand, max_n)
        n = cand
    return good
