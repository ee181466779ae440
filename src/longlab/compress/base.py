"""The context-compressor contract: ``ContextCompressor.compress(prompt, scorer) -> Compressed``.

A compressor reads the context's token ids (and, when query-aware, the question) and returns a shorter
prompt: token ids, the original index each kept token came from, and for merging methods input
embeddings that replace those ids' embeddings (``Compressed.embeds``, ``[T', D]``) with the number of
original tokens each one stands for (``sizes``).

Deleting methods act on **units**, never on single tokens (:func:`units`): a unit is a word with its
sub-word pieces, a whole number (digits and the ``,``/``.`` between digits) or the bytes of one multi-byte
character, so a compressed prompt never splits a number, a word or a UTF-8 character — the corrupted ids
and merged words LLMLingua's users report. :func:`select_units` keeps the highest-scoring units within a
token budget ``ceil((1 - r) n)`` and returns them in their original order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, Method
from ..registry import param

__all__ = ["ContextCompressor", "Compressed", "Prompt", "Unit", "units", "select_units", "token_bytes",
           "split_documents", "keep_budget"]


@dataclass
class Prompt:
    """What a compressor reads: the context ids of one row, its question text (``None`` if absent),
    the question part's ids (chat header and answer prefix included) and the tokenizer."""

    ids: list[int]
    question: str | None
    question_ids: list[int]
    tokenizer: Any
    _units: list[Unit] | None = field(default=None, repr=False)

    @property
    def units(self) -> list[Unit]:
        if self._units is None:
            self._units = units(self.tokenizer, self.ids)
        return self._units

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Compressed:
    """A compressed context. ``ids``: the prompt's tokens; ``source[i]``: the original index of token
    ``i`` (``-1`` for an inserted token, e.g. a TPP reference marker); ``embeds`` (``[T', D]`` or None):
    input embeddings replacing ``ids``' own (merging methods), ``sizes[i]`` the original tokens position
    ``i`` stands for; ``seconds``: the compression time; ``info``: method-specific facts (scores, ranks)."""

    ids: list[int]
    source: list[int]
    original_tokens: int
    embeds: torch.Tensor | None = None
    sizes: list[int] | None = None
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    state: Any = field(default=None, repr=False)  # what a method keeps for decoding (Guidance's pool)

    @property
    def kept_tokens(self) -> int:
        return len(self.ids)

    @property
    def kept_spans(self) -> list[tuple[int, int]]:
        """Runs ``[start, end)`` of consecutive original indices kept (in prompt order)."""
        spans: list[tuple[int, int]] = []
        for s in self.source:
            if s < 0:
                continue
            if spans and spans[-1][1] == s:
                spans[-1] = (spans[-1][0], s + 1)
            else:
                spans.append((s, s + 1))
        return spans

    def record(self) -> dict[str, Any]:
        """What a result row stores (``extra["context"]``): tokens before/after, time, spans."""
        return {
            "original_tokens": self.original_tokens, "kept_tokens": self.kept_tokens,
            "kept_fraction": self.kept_tokens / max(self.original_tokens, 1), "context_s": self.seconds,
            "merged": self.embeds is not None, "kept_spans": self.kept_spans[:512],
            **{k: v for k, v in self.info.items() if isinstance(v, (int, float, str, bool, list))},
        }


@dataclass
class ContextCompressor(Method):
    """Base of the ``context`` methods: shorten the prompt before prefill.

    ``compression_ratio`` r is the fraction of context tokens removed, in [0, 1), as for KV policies;
    r = 0 returns the prompt unchanged. Subclasses implement :meth:`compress`."""

    kind: ClassVar[str] = "context"
    batch_select_safe: ClassVar[bool] = True  # acts before prefill; nothing at decode
    query_aware: ClassVar[bool] = False  # reads the question

    compression_ratio: float = param(0.0, low=0, high=1, high_open=True)

    def compress(self, prompt: Prompt, scorer: Any) -> Compressed:  # pragma: no cover - abstract
        raise NotImplementedError

    def postprocess(self, text: str, prompt: Prompt, compressed: Compressed) -> str:
        """The answer as the user sees it (LongLLMLingua's subsequence recovery); default unchanged."""
        return text

    def identity(self, prompt: Prompt) -> Compressed:
        n = len(prompt.ids)
        return Compressed(list(prompt.ids), list(range(n)), n)


def keep_budget(n: int, ratio: float) -> int:
    """Tokens kept of ``n`` at removed fraction ``ratio``: ``ceil((1 - r) n)``, at least 1."""
    return max(1, math.ceil((1.0 - ratio) * n - 1e-9))


# ------------------------------------------------------------------------------------------------- units
_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes | None]:
    """The raw bytes of each token (``None`` for a special token such as BOS).

    Byte-level BPE pieces (GPT-2 alphabet) and SentencePiece pieces (``▁``, ``<0xNN>``) are mapped
    exactly; any other piece falls back to ``decode([id])``."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    table = _byte_decoder()
    out: list[bytes | None] = []
    for i, piece in zip(ids, pieces):
        if i in special or piece is None:
            out.append(None)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif "\u2581" in piece:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
        elif all(c in table for c in piece):
            out.append(bytes(table[c] for c in piece))
        else:
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out


@dataclass
class Unit:
    """Tokens ``[start, end)`` of the context that are kept or dropped together; ``text`` their bytes
    decoded (``None`` for a special token)."""

    start: int
    end: int
    text: str | None

    @property
    def size(self) -> int:
        return self.end - self.start


def _complete(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.reason != "unexpected end of data"  # invalid bytes are final; only a cut char waits
    return True


def _joins(prev: bytes, piece: bytes) -> bool:
    """Does ``piece`` continue the unit ending in ``prev``? Yes for the rest of a cut UTF-8 character,
    a word's next sub-word piece, a number's next digits (also across ``,``/``.`` between digits)."""
    if not prev or not piece:
        return False
    if not _complete(prev):
        return True
    if prev.isspace() and b"\n" not in prev and not piece[:1].isspace():
        return True  # a space token (byte-level vocabularies) leads the word after it
    a, b = prev.decode("utf-8", "replace")[-1], piece.decode("utf-8", "replace")[0]
    if a.isalnum() and (b.isalnum() or b == "\ufffd" or piece[0] >= 0x80):
        return True
    if a.isdigit() and b in ",." and len(piece) > 1 and piece[1:2].isdigit():
        return True
    return prev[-1:] in (b",", b".") and len(prev) > 1 and prev[-2:-1].isdigit() and b.isdigit()


def units(tokenizer: Any, ids: Sequence[int]) -> list[Unit]:
    """Split ``ids`` into :class:`Unit` s: words (with sub-word pieces), whole numbers, whole UTF-8
    characters; a special token is a unit of its own."""
    out: list[Unit] = []
    buf = b""
    start = 0
    for i, data in enumerate(token_bytes(tokenizer, ids)):
        if data is None:
            if i > start:
                out.append(Unit(start, i, buf.decode("utf-8", "replace")))
            out.append(Unit(i, i + 1, None))
            buf, start = b"", i + 1
            continue
        if i > start and not _joins(buf, data):
            out.append(Unit(start, i, buf.decode("utf-8", "replace")))
            buf, start = b"", i
        buf += data
    if len(ids) > start:
        out.append(Unit(start, len(ids), buf.decode("utf-8", "replace")))
    return out


def select_units(
    unit_list: Sequence[Unit], scores: Sequence[float], budget: int, forced: Sequence[int] = ()
) -> list[int]:
    """Indices of the units kept: ``forced`` ones, then the highest ``scores`` while their tokens fit in
    ``budget`` (a unit too large to fit is skipped, a smaller one may still fit); in original order."""
    keep = set(forced)
    used = sum(unit_list[k].size for k in keep)
    for k in sorted(range(len(unit_list)), key=lambda k: (-scores[k], k)):
        if k in keep:
            continue
        if used + unit_list[k].size <= budget:
            keep.add(k)
            used += unit_list[k].size
        if used >= budget:
            break
    return sorted(keep)


def gather(prompt: Prompt, unit_list: Sequence[Unit], chosen: Sequence[int]) -> Compressed:
    """The Compressed prompt holding the tokens of ``chosen`` units, in the order given."""
    ids, source = [], []
    for k in chosen:
        u = unit_list[k]
        ids.extend(prompt.ids[u.start : u.end])
        source.extend(range(u.start, u.end))
    return Compressed(ids, source, len(prompt.ids))


def split_documents(unit_list: Sequence[Unit], max_tokens: int = 256) -> list[list[int]]:
    """Unit indices of each document: split at blank lines (a unit holding ``"\\n\\n"``, which ends its
    document); a context without blank lines is cut at sentence ends into pieces of about
    ``max_tokens``."""
    docs: list[list[int]] = [[]]
    for k, u in enumerate(unit_list):
        docs[-1].append(k)
        if u.text is not None and "\n\n" in u.text:
            docs.append([])
    docs = [d for d in docs if d]
    if len(docs) > 1:
        return docs
    docs, size = [[]], 0
    for k, u in enumerate(unit_list):
        docs[-1].append(k)
        size += u.size
        if size >= max_tokens and u.text is not None and u.text.rstrip().endswith((".", "!", "?")):
            docs.append([])
            size = 0
    return [d for d in docs if d]


def check_prompt(prompt: Prompt) -> None:
    """Bad input: an empty context, or one made of a single repeated token."""
    if not prompt.ids:
        raise LonglabError("context compression: the context is empty (no tokens to compress)")
    if len(prompt.ids) > 1 and len(set(prompt.ids)) == 1:
        raise LonglabError(
            f"context compression: the context is one token repeated {len(prompt.ids)} times; "
            "there is no information to rank tokens by (give a real context or leave the compressor out)"
        )
