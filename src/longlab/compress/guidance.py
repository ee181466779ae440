"""Guidance: sentence-level citation enforcement by prefix-tail guided decoding.

Reconstructed from the abstract of "Sentence-Level Citation Enforcement via Prefix-Tail Guidance"
(ICML 2026 poster; code marlcplhra/Guidance was not retrievable), as specified in
``specs/prefill-reuse-decoding.md`` §8:

- **Pool**: every context sentence (:func:`~longlab.compress.merge.sentences`) of at least ``min_tokens``
  tokens gives (prefix = the words of its first units covering ``prefix_tokens`` tokens, tail = the
  rest, cite = its id: the ``[k]`` marker that opens it in a numbered context, else its 1-based index).
- **Decoding** (greedy, batch 1): at a boundary (the first step, after a token ending a sentence or a
  line, after a forced sentence) a **lookahead** of ``lookahead`` greedy tokens runs on a fork of the
  stream; when its words match a pool prefix with word-F1 >= ``threshold`` (best F1 wins, then the
  earliest sentence), the whole sentence and its citation marker (``marker``, ``{id}`` filled in) are
  **force-decoded** into the real stream (teacher-forced: the KV cache holds exactly the tokens emitted)
  and the sentence leaves the pool; otherwise the lookahead is discarded and the normal next token is
  emitted. With an empty pool this is plain greedy decoding, token for token.

It is a ``context`` recipe part that removes nothing (``r`` must be 0), so ``guidance+snapkv@0.5``
guides decoding over any KV recipe; it does not combine with a compressing context method.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_TOKENS, param
from .base import Compressed, ContextCompressor, Prompt, check_prompt
from .merge import sentences

__all__ = ["Guidance", "PoolEntry", "build_pool", "word_f1"]

_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def word_f1(a: list[str], b: list[str]) -> float:
    """Token F1 of two word lists (multiset overlap)."""
    common = sum((Counter(a) & Counter(b)).values())
    if not common:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


@dataclass
class PoolEntry:
    """One sentence of the pool: its token ids (prefix + tail), prefix words and citation id."""

    ids: list[int]
    prefix: list[str]
    cite: int


def build_pool(prompt: Prompt, prefix_tokens: int, min_tokens: int) -> list[PoolEntry]:
    U = prompt.units
    pool: list[PoolEntry] = []
    for index, sent in enumerate(sentences(U)):
        cite = index + 1
        # a numbered context ("[12] The ..."): the marker units open the sentence
        text_units = [U[k] for k in sent if U[k].text is not None]
        head = "".join(u.text or "" for u in text_units[:4])
        m = re.match(r"^\s*\[(\d+)\]", head)
        if m:
            cite = int(m.group(1))
            consumed, skip = "", 0
            for u in text_units:
                if len(consumed.strip()) >= len(m.group(0).strip()):
                    break
                consumed += u.text or ""
                skip += 1
            text_units = text_units[skip:]
        ids = [t for u in text_units for t in prompt.ids[u.start : u.end]]
        if len(ids) < min_tokens:
            continue
        lead, size = "", 0  # the prefix: whole units covering the first prefix_tokens tokens
        for u in text_units:
            if size >= prefix_tokens:
                break
            lead += u.text or ""
            size += u.size
        words = _words(lead)
        if words:
            pool.append(PoolEntry(ids, words, cite))
    return pool


_BOUNDARY = (".", "!", "?", "\n", "]")


@register("guidance")
@dataclass
class Guidance(ContextCompressor):
    """Prefix-tail guided decoding with sentence citations (see the module docstring; ICML 2026 poster
    "Sentence-Level Citation Enforcement via Prefix-Tail Guidance", reconstructed from the abstract)."""

    paper: ClassVar[str] = "Sentence-Level Citation Enforcement via Prefix-Tail Guidance, ICML 2026 (abs)"
    guides_decoding: ClassVar[bool] = True

    prefix_tokens: int = param(6, low=1, high=MAX_TOKENS, integer=True)
    lookahead: int = param(6, low=1, high=MAX_TOKENS, integer=True)  # greedy tokens (max_new_tokens caps it)
    threshold: float = param(0.8, low=0, high=1, low_open=True)
    min_tokens: int = param(8, low=1, high=MAX_TOKENS, integer=True)
    marker: str = " [{id}]"
    # no sentence enters the pool: plain greedy decoding (the identity test)
    empty_pool: bool = param(False, choices=(True, False))

    def validate(self) -> None:
        if self.compression_ratio != 0:
            raise LonglabError(
                f"guidance: compression_ratio must be 0 (it removes nothing; write guidance+snapkv@r to "
                f"compress the KV cache), got {self.compression_ratio!r}"
            )

    def compress(self, prompt: Prompt, scorer: Any = None) -> Compressed:
        check_prompt(prompt)
        out = self.identity(prompt)
        pool = [] if self.empty_pool else build_pool(prompt, self.prefix_tokens, self.min_tokens)
        out.state = pool
        out.info = {"pool_sentences": len(pool)}
        return out

    def match(self, words: list[str], pool: list[PoolEntry]) -> int | None:
        """Index of the pool entry whose prefix best matches ``words`` (F1 >= threshold), else None."""
        best, where = 0.0, None
        for i, entry in enumerate(pool):
            f1 = word_f1(words[: len(entry.prefix)], entry.prefix)
            if f1 >= self.threshold and f1 > best:
                best, where = f1, i
        return where

    @torch.inference_mode()
    def guided_decode(
        self, stream: Any, logits: torch.Tensor, max_new_tokens: int, eos_ids: set[int], tokenizer: Any,
        compressed: Compressed,
    ) -> tuple[list[int], dict[str, int]]:
        """Greedy decoding of one row with guidance; returns (tokens, counters)."""
        if stream.batch_size != 1:
            raise LonglabError("guidance decodes one row at a time; give a single context")
        pool = list(compressed.state or [])
        out: list[int] = []
        stats = {"lookaheads": 0, "forced_sentences": 0, "forced_tokens": 0}
        boundary = True
        last = logits.to(device="cpu", dtype=torch.float32)
        while len(out) < max_new_tokens:
            if boundary and pool:
                stats["lookaheads"] += 1
                fork = stream.fork()
                ahead = fork.decode(last, min(self.lookahead, max_new_tokens - len(out)), eos_ids)[0]
                del fork
                k = self.match(_words(tokenizer.decode(ahead, skip_special_tokens=True)), pool)
                if k is not None:
                    entry = pool.pop(k)
                    forced = entry.ids + list(tokenizer(self.marker.format(id=entry.cite),
                                                        add_special_tokens=False)["input_ids"])
                    forced = forced[: max_new_tokens - len(out)]
                    out.extend(forced)
                    stats["forced_sentences"] += 1
                    stats["forced_tokens"] += len(forced)
                    if len(out) >= max_new_tokens:
                        break
                    last = stream.feed([forced], compress="none").float().cpu()
                    boundary = True
                    continue
            token = int(last[0].argmax())
            out.append(token)
            if token in eos_ids or len(out) >= max_new_tokens:
                break
            boundary = tokenizer.decode([token]).rstrip(" ").endswith(_BOUNDARY)
            last = stream.feed([[token]], compress="none").float().cpu()
        return out, stats
