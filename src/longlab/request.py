"""A :class:`Request`: what to read, what to ask, which methods to use — one validated dataclass.

Every entry point builds requests (``generate``, ``longlab eval``, the server) and hands them to the one
:class:`~longlab.engine.Engine`. A new family of methods adds a field here and a runner in the engine,
never a ``generate`` parameter or a driver. :meth:`Request.check` validates every field (a
:class:`~longlab.errors.LonglabError` naming it and its allowed range) and parses the method strings with
the one registry, before any model runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import LonglabError, LonglabTypeError, check_choice, check_range, shorten
from .recipe import Recipe, parse_recipe
from .registry import REGISTRY

__all__ = ["Request", "Parsed", "MAX_CONTEXT_CHARS", "MAX_NEW_TOKENS"]

#: Inputs are bounded before any work: a context longer than this is refused (a tokenizer takes minutes
#: on tens of megabytes; ~4 characters a token makes this ~2M tokens, beyond every model longlab loads).
MAX_CONTEXT_CHARS = 8_000_000
MAX_NEW_TOKENS = 1_000_000
MAX_CHUNK = 1 << 20


@dataclass
class Parsed:
    """A request's method strings, parsed once: the recipe, the reuse method (None: no documents), the
    speculative config (None: plain decoding), the position method (None: the model's own) and the
    ``response_format``'s grammar (None: free text)."""

    recipe: Recipe
    reuse: Any = None
    draft: Any = None
    verifier: Any = None
    position: Any = None
    grammar: str | None = None  # the response_format's grammar (None: free text)


@dataclass
class Request:
    """One generation. The prompt is ``context`` + ``question`` (+ ``answer_prefix``), or ``messages``
    (a chat; the last user turn is the question), or ``documents`` (a RAG prompt whose KV is assembled from
    per-document caches by ``reuse``). Fields by family:

    - ``recipe``: prefill attention, KV policies, decode attention and context compressor (``+`` chains);
      ``query_aware`` (the question inside the compressed prompt), ``compress`` (``"chunk"``: policies cut
      the cache after every prefill chunk of ``chunk_size`` tokens; ``"end"``: once, after the prompt);
    - ``reuse``: with ``documents``, the reuse method (``cacheblend:recompute=0.15``; default full prefill);
    - ``speculative`` / ``verify`` / ``gamma``: speculative decoding (draft, verifier, tokens per step);
    - ``position``: a position method applied to the model while this request runs;
    - decoding: ``max_new_tokens``, ``temperature`` / ``top_p`` / ``seed`` (each request samples from its
      own generator, so its tokens do not depend on the batch it runs in), ``stop`` strings;
    - ``response_format``: structured output in OpenAI's shapes: ``{"type": "text"}`` (free text),
      ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name":
      ..., "schema": {...}, "strict": ...}}`` (a document valid against ``schema``, at most 64 KiB of
      JSON). Every decode step masks the tokens the grammar forbids (:mod:`longlab.grammar`,
      llguidance), per row, so constrained and free rows share a batch; EOS is allowed only once the
      document is complete (finish ``"length"`` when ``max_new_tokens`` ends it first). Works with
      ``messages=`` (``Request(messages=[...], response_format={"type": "json_schema", ...})``),
      ``context=`` and ``documents=``, through :class:`~longlab.engine.Engine` and ``longlab.generate``;
      not with ``continuation=`` or ``speculative=``, nor a context method that guides decoding;
    - ``continuation``: score this answer text by teacher forcing instead of decoding (the result holds
      the argmax at every answer position);
    - ``batch_decode``: may decode in one batch with other requests (rows that emit EOS leave it);
    - ``strict``: a prompt + answer beyond the model's ``max_position_embeddings`` is refused (False: a
      warning, and it runs; a position method lifts the refusal);
    - ``prefill_metrics``: sparse-prefill quality rows sampled per chunk (0: off).
    """

    context: str | None = None
    question: str | None = None
    answer_prefix: str = ""
    messages: list[dict[str, str]] | None = None
    documents: list[str] | None = None
    recipe: Any = "full"
    reuse: Any = None
    speculative: Any = None
    verify: Any = None
    gamma: int | None = None
    position: Any = None
    query_aware: bool = False
    compress: str = "chunk"
    chunk_size: int = 1024
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] | None = None
    chat_template: bool | str = True  # True: the default layout; False: plain text; or a layout name
    strict: bool = True
    continuation: str | None = None
    response_format: dict[str, Any] | None = None
    batch_decode: bool = True
    prefill_metrics: int = 0
    id: str = ""
    parsed: Parsed | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------------------------------ checks
    def check(self, name: str = "context") -> Request:
        """Validate every field and parse the method strings (``self.parsed``); return ``self``. ``name``:
        how errors call the context (``context[2]`` for the third row of a batch)."""
        self._check_prompt(name)
        for name, low, high in (
            ("max_new_tokens", 1, MAX_NEW_TOKENS),
            ("chunk_size", 1, MAX_CHUNK),
            ("prefill_metrics", 0, 1 << 16),
        ):
            check_range(name, getattr(self, name), low, high, integer=True)
        if self.gamma is not None:
            check_range("gamma (draft tokens per step)", self.gamma, 1, 1024, integer=True)
        _number(self.temperature, "temperature", 0, None, "(0 = greedy)")
        _number(self.top_p, "top_p", 0, 1, "", low_open=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise LonglabTypeError(f"seed must be an integer in [0, 2**64 - 1], got {_type_name(self.seed)}")
        if not 0 <= self.seed < 2**64:
            raise LonglabError(f"seed must be an integer in [0, 2**64 - 1], got {shorten(self.seed)}")
        check_choice("compress", self.compress, ("chunk", "end"))
        from .prompt import resolve_layout

        try:
            resolve_layout(self.chat_template)
        except ValueError as exc:
            raise LonglabError(str(exc)) from None
        for name in ("query_aware", "strict", "batch_decode"):
            if not isinstance(getattr(self, name), bool):
                raise LonglabTypeError(f"{name} must be True or False, got {shorten(getattr(self, name))}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise LonglabError(f"stop must be a list of non-empty strings, got {shorten(self.stop)}")
            if len(self.stop) > 16:
                raise LonglabError(f"stop takes at most 16 strings, got {len(self.stop)}")
        if self.continuation is not None and (
            not isinstance(self.continuation, str) or not self.continuation
        ):
            raise LonglabError(f"continuation must be a non-empty string, got {shorten(self.continuation)}")
        self.parsed = self._parse_methods()
        return self

    def _check_prompt(self, name: str) -> None:
        given = [n for n in ("context", "messages", "documents") if getattr(self, n) is not None]
        if not given:
            raise LonglabTypeError(
                "context must be a string or UTF-8 bytes (or give messages= or documents=), got None"
            )
        if len(given) > 1:
            raise LonglabError(
                f"give the prompt as context=, messages= or documents= (docs=, with reuse=), not both: "
                f"got {' and '.join(given)}"
            )
        self.answer_prefix = _text(self.answer_prefix, "answer_prefix")
        if self.context is not None:
            self.context = _text(self.context, name)
            if not self.context.strip():
                where = f" ({name})" if name != "context" else ""
                raise LonglabError(f"context is empty{where}: every context must be a non-empty string")
            _bounded(self.context, name)
            if self.question is not None:
                self.question = _text(self.question, "question")
                _bounded(self.question, "question")
        elif self.messages is not None:
            self._check_messages()
        else:
            docs = self.documents
            if isinstance(docs, str) or not isinstance(docs, (list, tuple)) or not docs:
                raise LonglabTypeError(f"documents must be a non-empty list of strings, got {shorten(docs)}")
            for i, d in enumerate(docs):
                if not isinstance(d, str) or not d.strip():
                    raise LonglabError(f"documents[{i}] must be a non-empty string, got {shorten(d)}")
            _bounded("".join(docs), "documents")
            self.documents = list(docs)
            if not isinstance(self.question, str) or not self.question.strip():
                raise LonglabError(f"documents= needs a non-empty question, got {shorten(self.question)}")

    def _check_messages(self) -> None:
        msgs = self.messages
        if not isinstance(msgs, list) or not msgs:
            raise LonglabTypeError(
                f"messages must be a non-empty list of {{role, content}}, got {shorten(msgs)}"
            )
        for i, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise LonglabError(
                    f"messages[{i}] must be an object with string role and content, got {shorten(m)}"
                )
            check_choice(f"messages[{i}].role", m["role"], ("system", "user", "assistant"))
        if msgs[-1]["role"] != "user":
            raise LonglabError("messages must end with a user turn (the question)")
        _bounded("".join(m["content"] for m in msgs), "messages")
        if self.question is not None:
            raise LonglabError("with messages=, the last user turn is the question: do not give question=")

    def _parse_methods(self) -> Parsed:
        recipe = parse_recipe(self.recipe)
        parsed = Parsed(recipe)
        spec = self.speculative is not None or self.verify is not None or self.gamma is not None
        if spec:
            if self.speculative is None:
                raise LonglabError(
                    "verify= and gamma= need speculative= (a draft: 'lookup', 'self:KVRECIPE', 'model:NAME')"
                )
            if isinstance(self.speculative, str) and not self.speculative.strip():
                raise LonglabError(
                    "speculative is empty: name a draft ('lookup', 'self:KVRECIPE', 'model:NAME')"
                )
            parsed.draft = REGISTRY.parse("draft", self.speculative)
            parsed.verifier = REGISTRY.parse("verify", "full" if self.verify is None else self.verify)
            from .spec.rollback import check_target_recipe  # what a speculative target's cache may hold

            check_target_recipe(recipe)
        if self.documents is not None:
            parsed.reuse = REGISTRY.parse("reuse", "full-prefill" if self.reuse is None else self.reuse)
            if spec:
                raise LonglabError("speculative= does not combine with docs= (documents, reuse) yet")
            if recipe.context is not None:
                raise LonglabError(
                    "a context compressor (e.g. llmlingua@0.5) does not combine with docs= (documents) yet"
                )
            if self.position is not None:
                raise LonglabError(
                    "position= does not combine with docs= (documents) yet (stored KV has the model's RoPE)"
                )
            if self.query_aware or self.compress != "chunk":
                raise LonglabError(
                    "with documents=, the recipe compresses the assembled cache once, query-aware, at the "
                    "end "
                    "of the prompt: query_aware= and compress= do not apply"
                )
            from .reuse.compose import reuse_recipe  # which recipe parts may follow a reuse prefill

            reuse_recipe(recipe, parsed.reuse)
        elif self.reuse is not None:
            raise LonglabError("reuse= needs documents=: the documents whose stored KV is reused")
        parsed.position = REGISTRY.parse("position", self.position)
        parsed.grammar = self._check_response_format(spec, recipe)
        if self.continuation is not None and spec:
            raise LonglabError(
                "continuation= scores an answer by teacher forcing: it does not decode, so "
                "speculative= does not apply"
            )
        return parsed

    def _check_response_format(self, spec: bool, recipe: Recipe) -> str | None:
        if self.response_format is None:
            return None
        from .grammar import grammar_of

        grammar = grammar_of(self.response_format)
        if grammar is None:  # {"type": "text"}
            return None
        if self.continuation is not None:
            raise LonglabError(
                "response_format does not combine with continuation= (teacher forcing scores a given "
                "answer; it decodes nothing to constrain)"
            )
        if spec:
            raise LonglabError(
                "response_format does not combine with speculative= yet (the draft's tokens are not masked)"
            )
        if recipe.context is not None and recipe.context.guides_decoding:
            name = REGISTRY.format(recipe.context)
            raise LonglabError(
                f"response_format does not combine with the context method {name!r}: it guides decoding "
                "itself"
            )
        return grammar

    def with_fields(self, **changes: Any) -> Request:
        """A copy with ``changes`` (not yet checked)."""
        return dataclasses.replace(self, parsed=None, **changes)


def _type_name(value: Any) -> str:
    return "None" if value is None else value.__class__.__name__


def _text(value: Any, name: str) -> str:
    """A text field: ``str``, or ``bytes`` decoded as UTF-8 (strictly)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise LonglabError(
                f"{name} is bytes that are not valid UTF-8 (byte {err.start}: {err.reason}); "
                "decode it yourself, e.g. data.decode('latin-1')"
            ) from None
    if not isinstance(value, str):
        raise LonglabTypeError(f"{name} must be a string or UTF-8 bytes, got {_type_name(value)}")
    return value


def _bounded(text: str, name: str) -> None:
    if len(text) > MAX_CONTEXT_CHARS:
        raise LonglabError(
            f"{name} has {len(text):,} characters, beyond longlab's input limit of {MAX_CONTEXT_CHARS:,} "
            "(~2M tokens; no model longlab loads reads that far)"
        )


def _number(
    value: Any, name: str, low: float | None, high: float | None, note: str, low_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LonglabTypeError(f"{name} must be a number, got {_type_name(value)} {shorten(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise LonglabError(f"{name} must be a finite number, got {shorten(value)}")
    ok = (low is None or (number > low if low_open else number >= low)) and (high is None or number <= high)
    if not ok:
        rng = (
            f"in ({low:g}, {high:g}]"
            if low_open
            else (f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]")
        )
        raise LonglabError(f"{name} must be {rng}{' ' + note if note else ''}, got {value!r}")
    return number
