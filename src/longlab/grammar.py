"""Structured output: a request's ``response_format`` as a token mask applied at every decode step.

Constrained decoding (Willard & Louf 2023, "Efficient Guided Generation for LLMs"; Earley-parser masks as
in llguidance): at step ``t`` the grammar's parser state gives the set ``A_t`` of tokens that keep the
output a prefix of a sentence of the grammar, and the row samples from ``logits[A_t]`` (the others set to
``-inf``), so greedy picks ``argmax_{v in A_t} logits[v]``. EOS belongs to ``A_t`` only when the output so
far is a whole sentence (the JSON document is complete); when no other token can follow, EOS is the only
choice.

The library is **llguidance** (bench/structured_output.py, docs/results/serve-load.md#structured-output: it
reads every tokenizer longlab ships, its JSON never holds a raw control character, and it has no
dependencies).
Shapes (OpenAI's ``response_format``):

- ``{"type": "text"}``: free text (no mask);
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: a document
  that validates against ``schema`` (``strict: false`` ignores keywords the library does not implement
  instead of refusing the schema).

Documents are written with fixed separators (``", "`` and ``": "``, no other whitespace), so a model cannot
spend its tokens on whitespace. Caches: the tokenizer's prepared vocabulary per (tokenizer, model vocab,
EOS ids) and compiled matchers by schema text (a bounded LRU); each row decodes with its own copy.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from .errors import LonglabError, shorten

__all__ = ["MAX_SCHEMA_BYTES", "INSTALL", "grammar_of", "GrammarMask", "grammar_mask", "unpack_bits"]

MAX_SCHEMA_BYTES = 64 << 10  # a json_schema's JSON text larger than this is refused
INSTALL = "pip install 'longlab[structured]' (or pip install llguidance)"
_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TYPES = ("text", "json_object", "json_schema")
_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(V, eos): LLTokenizer}
_matchers: OrderedDict[tuple[int, str], Any] = OrderedDict()  # (id of LLTokenizer, grammar) -> LLMatcher
MAX_CACHED = 64


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise LonglabError(f"response_format (structured output) needs llguidance: {INSTALL}") from None
    return llguidance


def grammar_of(response_format: Any) -> str | None:
    """Check ``response_format`` and return its grammar (llguidance's grammar text; None: free text).
    Raises a LonglabError naming ``response_format`` for an unknown type, a missing or oversized schema,
    or a schema the library cannot compile."""
    fmt = response_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in _TYPES:
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise LonglabError(
            f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got type "
            f"{shorten(got)}"
        )
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema, strict = {"type": "object"}, True
    else:
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise LonglabError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}} with the "
                f"schema a JSON object, got json_schema={shorten(spec)}"
            )
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 64):
            raise LonglabError(f"response_format json_schema.name must be a string of <= 64 characters, "
                               f"got {shorten(name)}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise LonglabError(
                f"response_format json_schema.strict must be true or false, got {shorten(strict)}"
            )
        schema, strict = spec["schema"], strict is not False
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LonglabError(f"response_format schema is not JSON-serialisable: {exc}") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise LonglabError(
            f"response_format schema has {len(text.encode()):,} bytes of JSON, beyond the limit of "
            f"{MAX_SCHEMA_BYTES:,}"
        )
    return _compile(text, strict)


_grammars: OrderedDict[tuple[str, bool], str] = OrderedDict()


def _compile(schema_text: str, strict: bool) -> str:
    key = (schema_text, strict)
    with _lock:
        if key in _grammars:
            _grammars.move_to_end(key)
            return _grammars[key]
    llg = _llguidance()
    options = dict(_OPTIONS, lenient=not strict)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema_text, defaults=options)
        error = llg.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise LonglabError(f"response_format schema cannot be compiled: {error[:300]}")
    with _lock:
        _grammars[key] = grammar
        while len(_grammars) > MAX_CACHED:
            _grammars.popitem(last=False)
    return grammar


def _prepared(tokenizer: Any, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of ``tokenizer`` whose model has ``vocab`` logits (ids past the tokenizer's map
    to no string and are never allowed; a tokenizer with more ids than logits keeps them all, and the
    mask is cut to the logits), cached per tokenizer."""
    llg = _llguidance()
    width = max(vocab, len(tokenizer))
    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        key = (width, eos)
        if key not in per:
            per[key] = llg.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=list(eos))
        return per[key]


class GrammarMask:
    """One row's grammar state. :meth:`apply` masks ``logits [V]``; :meth:`accept` advances the parser
    by the token the row took."""

    def __init__(self, matcher: Any, vocab: int, eos: set[int], width: int | None = None) -> None:
        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        width = vocab if width is None else width  # the tokenizer view's ids (>= vocab)
        self._bits = torch.zeros((width + 31) // 32, dtype=torch.int32)  # [ceil(W / 32)], bit v: v allowed

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows now: bool ``[V]``."""
        # llguidance writes the packed mask into our buffer (what llguidance.torch does, without its
        # torch.compile'd apply, whose import alone costs seconds)
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return unpack_bits(self._bits, self.vocab)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [V]`` (fp32, CPU) with the tokens the grammar forbids now set to ``-inf``: a new
        tensor (rows of one prompt may share their first logits)."""
        if self.matcher.is_error():  # cannot happen for tokens the mask allowed; end the row cleanly
            out = torch.full_like(logits, float("-inf"))
            out[min(self.eos)] = 0.0
            return out
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def accept(self, token: int) -> None:
        if token not in self.eos:
            self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The output so far is a whole document of the grammar."""
        return self.matcher.is_accepting()


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed mask ``[ceil(V / 32)]`` int32 (bit ``v % 32`` of word ``v // 32``) -> bool ``[V]``."""
    return ((bits[:, None] >> _SHIFTS) & 1).reshape(-1)[:vocab].bool()


def grammar_mask(tokenizer: Any, grammar: str, vocab: int, eos: set[int]) -> GrammarMask:
    """A fresh :class:`GrammarMask` for one row: ``grammar`` from :func:`grammar_of`, ``vocab`` the
    width of the model's logits, ``eos`` the ids that end the row."""
    if not eos:
        raise LonglabError("response_format needs the tokenizer's EOS token (the model has none)")
    llg = _llguidance()
    lltok = _prepared(tokenizer, vocab, tuple(sorted(eos)))
    key = (id(lltok), grammar)
    with _lock:
        entry = _matchers.get(key)  # (lltok, matcher): holding lltok keeps its id unique
        template = entry[1] if entry is not None else None
        if entry is not None:
            _matchers.move_to_end(key)
    if template is None:
        template = llg.LLMatcher(lltok, grammar, log_level=0)  # errors are read with is_error(), not printed
        if template.is_error():
            raise LonglabError(f"response_format schema cannot be compiled: {template.get_error()[:300]}")
        with _lock:
            _matchers[key] = (lltok, template)
            while len(_matchers) > MAX_CACHED:
                _matchers.popitem(last=False)
    return GrammarMask(template.deep_copy(), vocab, eos, lltok.vocab_size)
