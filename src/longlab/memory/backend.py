"""Chat backends for memory systems: the local engine or any OpenAI-compatible endpoint, one protocol.

Every memory system (HGMem, its RAG baselines, C-DIC's judge side) talks to a language model only through
:class:`ChatBackend`::

    backend = LocalBackend.load("qwen2.5-0.5b", recipe="full")            # longlab's Engine
    backend = OpenAIBackend("http://127.0.0.1:8000/v1", model="tiny-llama")  # longlab serve, vLLM, ...
    text = backend.chat([{"role": "user", "content": "Hi"}], max_tokens=16)
    obj = chat_json(backend, messages, schema)                           # a dict valid under schema

Structured output: ``json_schema`` is passed as the OpenAI ``response_format`` (``{"type": "json_schema",
"json_schema": {"name": ..., "schema": ...}}``) — to the server, or to :class:`~longlab.request.Request` when
the engine has grammar-constrained decoding. Where neither has it (an older longlab, a server that answers
400 on ``response_format``), the backend logs one warning and :func:`chat_json` falls back to
parse-and-retry: extract the first JSON value of the reply, validate it against the schema
(:func:`validate_json`), and ask again with the error appended, at most ``retries`` times. Small models
break free-form extraction formats (HippoRAG #64: ~10% empty extractions at 8B); the counters
(:attr:`BackendStats.json_failures`) make that visible in every row.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import LonglabError, LonglabTypeError, check_range, shorten

__all__ = [
    "ChatBackend",
    "BackendStats",
    "LocalBackend",
    "OpenAIBackend",
    "check_schema",
    "validate_json",
    "extract_json",
    "repair_json",
    "chat_json",
    "response_format_of",
    "check_messages",
    "MAX_CHAT_TOKENS",
    "MAX_BATCH",
    "MAX_URL_CHARS",
    "check_base_url",
]

log = logging.getLogger(__name__)

MAX_CHAT_TOKENS = 8192  # generated tokens of one chat call
MAX_BATCH = 256  # chats of one LocalBackend.chat_many call
MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 2_000_000
_ROLES = ("system", "developer", "user", "assistant")
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_KEYWORDS = {
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "minItems",
    "maxItems",
    "maxLength",
    "minLength",
    "additionalProperties",
    "description",
    "title",
    "minimum",
    "maximum",
}


@runtime_checkable
class ChatBackend(Protocol):
    """A chat model: ``messages`` (``[{"role", "content"}]``) -> the assistant's text."""

    name: str

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 256,
        json_schema: dict | None = None,
        temperature: float = 0.0,
    ) -> str: ...


@dataclass
class BackendStats:
    """What a backend spent: calls, prompt and generated tokens, wall seconds, and structured-output
    failures (a reply that was not valid JSON under its schema, before any retry)."""

    calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    json_calls: int = 0
    json_failures: int = 0
    json_repaired: int = 0  # replies cut at max_tokens whose complete prefix was valid (see repair_json)
    constrained: bool | None = None  # None: no json_schema call yet; False: parse-and-retry fallback

    def snapshot(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        """Counters spent since ``before`` (a :meth:`snapshot`)."""
        return {
            k: (v - before[k] if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in self.__dict__.items()
        }


# -------------------------------------------------------------------------------------------- schemas
def check_schema(schema: Any, where: str = "json_schema") -> dict:
    """Check that ``schema`` is a JSON schema in the subset both constrained decoders and
    :func:`validate_json` support (type, properties, required, items, enum, min/maxItems, min/maxLength,
    minimum/maximum, additionalProperties); a clear :class:`LonglabError` naming the bad part."""
    if not isinstance(schema, dict):
        raise LonglabTypeError(f"{where} must be a JSON schema object (a dict), got {shorten(schema)}")
    unknown = sorted(set(schema) - _KEYWORDS)
    if unknown:
        raise LonglabError(
            f"{where}: unsupported schema keyword(s) {', '.join(unknown)}; supported: "
            f"{', '.join(sorted(_KEYWORDS))}"
        )
    kind = schema.get("type")
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise LonglabError(f"{where}.enum must be a non-empty list, got {shorten(schema['enum'])}")
    elif kind not in _TYPES:
        raise LonglabError(f"{where}.type must be one of {', '.join(_TYPES)}, got {shorten(kind)}")
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise LonglabError(f"{where}.properties must be an object, got {shorten(props)}")
        for key, sub in props.items():
            check_schema(sub, f"{where}.properties.{key}")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise LonglabError(f"{where}.required must list names of properties, got {shorten(required)}")
    if kind == "array":
        if "items" not in schema:
            raise LonglabError(f"{where}: an array schema needs items")
        check_schema(schema["items"], f"{where}.items")
    return schema


def validate_json(value: Any, schema: dict, where: str = "$") -> None:
    """Raise ``ValueError`` naming the first place where ``value`` breaks ``schema`` (the
    :func:`check_schema` subset)."""
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{where} must be one of {schema['enum']}, got {shorten(value)}")
    kind = schema.get("type")
    ok = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        None: lambda v: True,
    }[kind]
    if not ok(value):
        raise ValueError(f"{where} must be of type {kind}, got {shorten(value)}")
    if kind == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{where} lacks the required key {key!r}")
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                raise ValueError(f"{where} has keys not in the schema: {', '.join(extra)}")
        for key, sub in props.items():
            if key in value:
                validate_json(value[key], sub, f"{where}.{key}")
    elif kind == "array":
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 1 << 30):
            raise ValueError(
                f"{where} must have {schema.get('minItems', 0)}..{schema.get('maxItems', 'any')} "
                f"items, got {len(value)}"
            )
        for i, item in enumerate(value):
            validate_json(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
            raise ValueError(f"{where} has length {len(value)} outside the schema's bounds")
    elif kind in ("integer", "number"):
        if value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf):
            raise ValueError(f"{where} = {value} is outside the schema's bounds")


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def extract_json(text: str) -> Any:
    """The first JSON value in ``text`` (inside a ``` fence if there is one, else from the first ``{`` or
    ``[``); ``ValueError`` if there is none."""
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    decoder = json.JSONDecoder()
    for i, ch in enumerate(body):
        if ch in "{[":
            try:
                return decoder.raw_decode(body, i)[0]
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON value in the reply {shorten(text)}")


def repair_json(text: str, schema: dict, max_cuts: int = 400) -> Any | None:
    """The longest complete prefix of an unfinished JSON value in ``text`` that is valid under ``schema``,
    or ``None``: cut after the last complete element (at a ``,`` or after a closing bracket, outside
    strings), close the open brackets, parse, validate; earlier cuts are tried until one is valid (at most
    ``max_cuts``). A small model's extraction that runs past ``max_tokens`` keeps its finished items; a
    required array property of the top-level object that the cut reply never reached (``relations`` after
    a long ``entities``) is filled with ``[]`` when the schema lets it be empty."""
    start = next((i for i, ch in enumerate(text) if ch in "{["), None)
    if start is None:
        return None
    stack: list[str] = []
    cuts: list[tuple[int, str]] = []  # (end index, closing brackets) after which the value can be closed
    in_str = esc = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            if not stack:
                break  # a complete value: extract_json's business, not a truncation
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
    else:
        for end, closing in reversed(cuts[-max_cuts:]):
            try:
                value = _fill_unreached_arrays(json.loads(text[start:end] + closing), schema)
                validate_json(value, schema)
                return value
            except ValueError:
                continue
    return None


def _fill_unreached_arrays(value: Any, schema: dict) -> Any:
    """``value`` with the top-level object's missing required array properties (minItems 0) set to
    ``[]`` (for :func:`repair_json`: a cut reply never reached them)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            sub = props.get(key, {})
            if key not in value and sub.get("type") == "array" and sub.get("minItems", 0) == 0:
                value[key] = []
    return value


def response_format_of(schema: dict, name: str = "output") -> dict:
    """The OpenAI ``response_format`` for ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a checked list of ``{"role", "content"}`` (roles system/developer/user/assistant)."""
    if not isinstance(messages, list) or not messages:
        raise LonglabError(f"messages must be a non-empty list of {{role, content}}, got {shorten(messages)}")
    if len(messages) > MAX_MESSAGES:
        raise LonglabError(f"messages takes at most {MAX_MESSAGES} turns, got {len(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise LonglabError(
                f"messages[{i}] must be {{role: one of {', '.join(_ROLES)}, content: str}}, got {shorten(m)}"
            )
        if len(m["content"]) > MAX_MESSAGE_CHARS:
            raise LonglabError(
                f"messages[{i}].content has {len(m['content'])} characters, more than {MAX_MESSAGE_CHARS}"
            )
    return messages


def _check_call(max_tokens: int, temperature: float, json_schema: dict | None) -> None:
    check_range("max_tokens", max_tokens, 1, MAX_CHAT_TOKENS, integer=True)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature <= 2
    ):
        raise LonglabError(f"temperature must be a number in [0, 2], got {shorten(temperature)}")
    if json_schema is not None:
        check_schema(json_schema)


def chat_json(
    backend: ChatBackend,
    messages: list[dict[str, str]],
    schema: dict,
    *,
    max_tokens: int = 256,
    retries: int = 2,
    temperature: float = 0.0,
) -> Any | None:
    """A JSON value valid under ``schema`` from ``backend``, or ``None`` after ``retries`` failed re-asks.

    A reply cut at ``max_tokens`` (an unfinished JSON value) is first repaired by :func:`repair_json`
    (counted in ``stats.json_repaired``). Each failure (no JSON, or a value that breaks the schema) is
    counted in ``stats.json_failures`` and re-asked with the error appended (parse-and-retry); with
    grammar-constrained decoding the first reply is valid unless it was cut at ``max_tokens``."""
    check_schema(schema)
    check_range("retries", retries, 0, 8, integer=True)
    stats = getattr(backend, "stats", None)
    turn = list(messages)
    for _ in range(retries + 1):
        text = backend.chat(turn, max_tokens=max_tokens, json_schema=schema, temperature=temperature)
        if stats is not None:
            stats.json_calls += 1
        try:
            value = extract_json(text)
            validate_json(value, schema)
            return value
        except ValueError as exc:
            value = repair_json(text, schema)
            if value is not None:
                if stats is not None:
                    stats.json_repaired += 1
                return value
            if stats is not None:
                stats.json_failures += 1
            turn = list(messages) + [
                {"role": "assistant", "content": text[:2000]},
                {
                    "role": "user",
                    "content": f"That was not valid: {exc}. Reply with only a JSON value "
                    f"matching this schema: {json.dumps(schema)}",
                },
            ]
    return None


# ----------------------------------------------------------------------------------------- local engine
class LocalBackend:
    """longlab's :class:`~longlab.engine.Engine` as a chat model: each call is one
    ``Request(messages=..., recipe=...)`` (:meth:`chat_many`: one engine run of several, decoded as one
    batch); ``json_schema`` goes in ``Request.response_format`` when the engine has structured output,
    else (logged once) :func:`chat_json` parses and retries."""

    def __init__(
        self, model: Any, tokenizer: Any, *, recipe: str = "full", name: str = "local", chunk_size: int = 1024
    ) -> None:
        from ..request import Request

        Request(messages=[{"role": "user", "content": "x"}], recipe=recipe, chunk_size=chunk_size).check()
        self.model, self.tokenizer, self.recipe, self.chunk_size = model, tokenizer, recipe, chunk_size
        self.name = name
        self.stats = BackendStats()
        self.structured = "response_format" in Request.__dataclass_fields__
        self._warned = False

    @classmethod
    def load(cls, model_name: str, *, recipe: str = "full", dtype: str = "float32") -> LocalBackend:
        """A backend on ``load_model(model_name)``."""
        from ..models import load_model

        model, tokenizer = load_model(model_name, dtype=dtype)
        return cls(model, tokenizer, recipe=recipe, name=model_name)

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 256,
        json_schema: dict | None = None,
        temperature: float = 0.0,
    ) -> str:
        """One chat turn through the engine (greedy at temperature 0)."""
        from ..engine import Engine

        check_messages(messages)
        _check_call(max_tokens, temperature, json_schema)
        request = self._request(messages, max_tokens, json_schema, temperature)
        start = time.perf_counter()
        results = Engine(self.model, self.tokenizer).run([request])
        self._count(results, start)
        return results[0].text

    def chat_many(
        self,
        batch: list[list[dict[str, str]]],
        *,
        max_tokens: int = 256,
        json_schema: dict | None = None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list[str]:
        """One answer per chat of ``batch`` (``len(batch)`` chats, at most :data:`MAX_BATCH`), run by one
        engine call that decodes them together (``Request.batch_decode``); chat ``i`` samples with seed
        ``seed + i`` (greedy at temperature 0: the same tokens as :meth:`chat` one by one)."""
        from ..engine import Engine

        if not isinstance(batch, list) or not batch:
            raise LonglabError(
                f"batch must be a non-empty list of chats (message lists), got {shorten(batch)}"
            )
        if len(batch) > MAX_BATCH:
            raise LonglabError(f"batch takes at most {MAX_BATCH} chats, got {len(batch)}")
        check_range("seed", seed, 0, 2**63 - 1, integer=True)
        for i, messages in enumerate(batch):
            try:
                check_messages(messages)
            except LonglabError as exc:
                raise LonglabError(f"batch[{i}]: {exc}") from None
        _check_call(max_tokens, temperature, json_schema)
        requests = [
            self._request(m, max_tokens, json_schema, temperature, seed=seed + i, batch_decode=len(batch) > 1)
            for i, m in enumerate(batch)
        ]
        start = time.perf_counter()
        results = Engine(self.model, self.tokenizer).run(requests)
        self._count(results, start)
        return [r.text for r in results]

    def _request(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        json_schema: dict | None,
        temperature: float,
        **extra: Any,
    ) -> Any:
        from ..request import Request

        fields: dict[str, Any] = dict(extra)
        if json_schema is not None:
            if self.structured:
                fields["response_format"] = response_format_of(json_schema)
                self.stats.constrained = True
            else:
                self.stats.constrained = False
                if not self._warned:
                    log.warning(
                        "longlab.memory: this engine has no Request.response_format (structured "
                        "output); JSON replies are parsed and retried instead"
                    )
                    self._warned = True
        return Request(
            messages=messages,
            recipe=self.recipe,
            max_new_tokens=max_tokens,
            temperature=float(temperature),
            query_aware=True,
            chunk_size=self.chunk_size,
            strict=False,
            **fields,
        )

    def _count(self, results: list[Any], start: float) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += len(results)
        for result in results:
            self.stats.prompt_tokens += int(result.prompt_tokens)
            self.stats.generated_tokens += len(result.token_ids)


# ------------------------------------------------------------------------------------------ OpenAI API
MAX_URL_CHARS = 2000


def check_base_url(base_url: Any, *, loopback_only: bool = False, flag: str = "base_url") -> str:
    """An OpenAI-compatible base URL: ``http(s)://host[:port][/path]`` (``http://127.0.0.1:8000/v1``) with
    no credentials, query or fragment, at most :data:`MAX_URL_CHARS` characters; returned stripped of
    surrounding blanks and a trailing ``/``. ``loopback_only``: the host must be 127.0.0.1, ::1 (any
    loopback address) or ``localhost`` (what the tests use). Errors name ``flag`` (the CLI's ``--base-url``,
    ``--judge-url``, or the API's ``base_url``)."""
    if not isinstance(base_url, str) or not base_url.strip() or len(base_url) > MAX_URL_CHARS:
        raise LonglabError(
            f"{flag} must be an http(s) URL such as http://127.0.0.1:8000/v1 (at most {MAX_URL_CHARS} "
            f"characters), got {shorten(base_url)}"
        )
    url = base_url.strip()
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise LonglabError(f"{flag} is not a valid URL ({exc}): {shorten(base_url)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LonglabError(
            f"{flag} must start with http:// or https:// and name a host (e.g. "
            f"http://127.0.0.1:8000/v1), got {shorten(base_url)}"
        )
    if parts.username or parts.password:
        raise LonglabError(
            f"{flag} must not carry credentials; give the key as api_key (the CLI reads OPENAI_API_KEY)"
        )
    if parts.query or parts.fragment:
        raise LonglabError(f"{flag} must not have a query or fragment, got {shorten(base_url)}")
    if port is not None and not 1 <= port <= 65535:
        raise LonglabError(f"{flag} port must be in [1, 65535], got {shorten(base_url)}")
    if loopback_only:
        host = parts.hostname
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise LonglabError(f"{flag}: only a loopback host is allowed here, got {host!r}")
    return url.rstrip("/")


@dataclass
class OpenAIBackend:
    """Any OpenAI-compatible ``/v1/chat/completions`` (``longlab serve``, vLLM, llama.cpp) through the
    official ``openai`` client; ``timeout`` (seconds, per call) and ``max_retries`` bounded;
    ``loopback_only``: refuse a ``base_url`` whose host is not a loopback address (:func:`check_base_url`).
    The PersistBench judge is one of these (:func:`longlab.memory.persist.openai_judge`)."""

    base_url: str
    model: str
    api_key: str = "none"
    timeout: float = 120.0
    max_retries: int = 0
    name: str = ""
    stats: BackendStats = field(default_factory=BackendStats)
    loopback_only: bool = False

    def __post_init__(self) -> None:
        self.base_url = check_base_url(self.base_url, loopback_only=self.loopback_only)
        if not isinstance(self.model, str) or not self.model.strip():
            raise LonglabError(
                f"model must be the endpoint's model name (a non-empty string), got {shorten(self.model)}"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not 0 < self.timeout <= 3600
        ):
            raise LonglabError(f"timeout must be seconds in (0, 3600], got {shorten(self.timeout)}")
        check_range("max_retries", self.max_retries, 0, 5, integer=True)
        try:
            import openai
        except ImportError:
            raise LonglabError(
                "OpenAIBackend needs the openai client: pip install 'longlab[serve]'"
            ) from None
        self._openai = openai
        self.client = openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key or "none",
            timeout=float(self.timeout),
            max_retries=self.max_retries,
        )
        self.name = self.name or f"{self.model}@{self.base_url}"
        self.structured = True  # until the server refuses response_format once

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 256,
        json_schema: dict | None = None,
        temperature: float = 0.0,
    ) -> str:
        """One chat completion; a refused ``response_format`` switches to parse-and-retry (logged)."""
        check_messages(messages)
        _check_call(max_tokens, temperature, json_schema)
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": float(temperature),
        }
        if json_schema is not None and self.structured:
            kwargs["response_format"] = response_format_of(json_schema)
        start = time.perf_counter()
        try:
            out = self._create(kwargs)
        except self._openai.BadRequestError as exc:
            if "response_format" in kwargs and "response_format" in str(exc):
                log.warning(
                    "longlab.memory: %s refused response_format (%s); JSON replies are parsed and "
                    "retried instead",
                    self.base_url,
                    shorten(str(exc), 200),
                )
                self.structured = False
                kwargs.pop("response_format")
                out = self._create(kwargs)
            else:
                raise LonglabError(f"{self.base_url} refused the request: {shorten(str(exc), 300)}") from None
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        if json_schema is not None:
            self.stats.constrained = "response_format" in kwargs
        usage = getattr(out, "usage", None)
        if usage is not None:
            self.stats.prompt_tokens += int(usage.prompt_tokens or 0)
            self.stats.generated_tokens += int(usage.completion_tokens or 0)
        if not out.choices:
            raise LonglabError(f"{self.base_url} returned no choices")
        return out.choices[0].message.content or ""

    def _create(self, kwargs: dict[str, Any]) -> Any:
        openai = self._openai
        try:
            return self.client.chat.completions.create(**kwargs)
        except openai.APITimeoutError:
            raise LonglabError(f"{self.base_url} did not answer within timeout={self.timeout} s") from None
        except openai.APIConnectionError as exc:
            raise LonglabError(
                f"cannot reach base_url {self.base_url}: {shorten(str(exc), 200)} (is the "
                f"server running? e.g. longlab serve --model NAME --port 8000)"
            ) from None
        except openai.NotFoundError:
            raise LonglabError(
                f"{self.base_url}/chat/completions was not found (404): base_url must end in "
                f"the API root, e.g. http://127.0.0.1:8000/v1, and model must be one the "
                f"server lists"
            ) from None
        except openai.AuthenticationError:
            raise LonglabError(f"{self.base_url} refused the api_key (401)") from None
