"""The OpenAI wire format: a request body (a parsed JSON object, no pydantic) into a checked
:class:`~longlab.request.Request`, a :class:`~longlab.engine.Result` into a response or stream chunks, and
errors as ``{"error": {message, type, param, code}}``.

OpenAI fields mapped: ``messages`` (chat; content a string or text parts) / ``prompt`` (completions),
``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream``, ``stream_options.include_usage``, ``response_format`` (``text``, ``json_object``,
``json_schema``: structured output, :mod:`longlab.grammar`; a bad one is a 400 naming it).
``temperature`` defaults to 0 (greedy), not OpenAI's 1: a lab server answers reproducibly unless asked to
sample. Unknown fields are ignored (as vLLM does); fields that would change the answer in a way longlab
cannot honour (``n`` > 1, ``logprobs``, ``tools``, penalties, ``logit_bias``) are refused with 400
naming them.
longlab's own fields (the OpenAI client sends them in ``extra_body``): ``recipe``, ``documents`` +
``reuse``, ``speculative`` (+ ``verify``, ``gamma``), ``query_aware``; each is checked by
:meth:`Request.check`. A chat's last user turn is its question part, and OpenAI clients put the whole
document there: chat requests are query-aware by default (the recipe compresses the whole prompt;
``query_aware: false`` compresses only the turns before it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import LonglabError, shorten
from ..request import Request

__all__ = ["ApiError", "Parsed", "parse_chat", "parse_completion", "error_body", "completion_body",
           "chunk", "usage_of", "finish_reason", "longlab_of", "bad_request", "DEFAULT_MAX_TOKENS"]

#: max_tokens when the body gives none (chat, completions: OpenAI's legacy default is 16)
DEFAULT_MAX_TOKENS = {"chat": 128, "completions": 16}
LONGLAB_FIELDS = ("recipe", "documents", "reuse", "speculative", "verify", "gamma", "query_aware")
_OPENAI_NAME = {"max_new_tokens": "max_tokens", "context": "prompt", "question": "messages"}


class ApiError(Exception):
    """An error the server answers with ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Parsed:
    """A body, parsed: the checked request and how to answer it."""

    kind: str  # "chat" or "completions"
    request: Request
    stream: bool
    include_usage: bool
    recipe: str  # the request's recipe, as named in metrics and responses
    fields: dict[str, Any]  # the Request fields the body gave (to name the field of a later error)


def parse_chat(body: Any, model_name: str, default_recipe: str) -> Parsed:
    """``POST /v1/chat/completions``: ``messages`` -> ``Request(messages=...)`` (or, with ``documents``,
    the last user turn as the question)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = [_turn(m, i) for i, m in enumerate(messages)]
    fields = _common(body, model_name, default_recipe, "chat")
    if fields.get("documents") is not None:
        if len(turns) != 1 or turns[0]["role"] != "user":
            raise ApiError(400, "with documents, messages must be one user turn (the question)", "messages")
        fields["question"] = turns[0]["content"]
    else:
        fields["messages"] = turns
        # the last user turn (often the whole document) is the question part: compress it with the rest
        fields.setdefault("query_aware", True)
    return _checked("chat", body, fields)


def parse_completion(body: Any, model_name: str, default_recipe: str) -> Parsed:
    """``POST /v1/completions``: ``prompt`` (one string) -> ``Request(context=prompt)`` continued as
    plain text (no chat template); with ``documents``, the prompt is the question."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, f"prompt must be one non-empty string, got {shorten(prompt)}", "prompt")
    fields = _common(body, model_name, default_recipe, "completions")
    if fields.get("documents") is not None:
        fields["question"] = prompt
    else:
        fields["context"] = prompt
        fields["chat_template"] = False
    return _checked("completions", body, fields)


# ------------------------------------------------------------------------------------------- parsing
def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _turn(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object with role and content", "messages")
    role = m.get("role")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant"):
        raise ApiError(400, f"messages[{i}].role must be system, developer, user or assistant, got "
                            f"{shorten(m.get('role'))}", "messages")
    content = m.get("content")
    if isinstance(content, list):  # text parts
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or text parts, got {shorten(content)}",
                       "messages")
    return {"role": role, "content": content}


def _common(body: dict[str, Any], model_name: str, default_recipe: str, kind: str) -> dict[str, Any]:
    """The fields both endpoints share, as Request fields (not yet checked)."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model {shorten(model)} does not exist; this server serves {model_name!r}",
                       "model", code="model_not_found")
    _refuse_unsupported(body)
    fields: dict[str, Any] = {"recipe": default_recipe}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    fields["max_new_tokens"] = DEFAULT_MAX_TOKENS[kind] if max_tokens is None else max_tokens
    for name in ("temperature", "top_p", "seed"):
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("stop") is not None:
        fields["stop"] = body["stop"]
    if body.get("response_format") is not None:  # checked (and compiled) by Request.check
        fields["response_format"] = body["response_format"]
    for name in LONGLAB_FIELDS:
        if body.get(name) is not None:
            fields[name] = body[name]
    return fields


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {shorten(n)}", "n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if body.get("tools"):
        raise ApiError(400, "tools are not supported", "tools")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")


def _checked(kind: str, body: dict[str, Any], fields: dict[str, Any]) -> Parsed:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {shorten(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    request = Request(**fields)
    try:
        request.check("prompt" if kind == "completions" else "context")
    except LonglabError as exc:
        raise bad_request(exc, fields) from None
    return Parsed(kind, request, stream, include_usage, request.parsed.recipe.name, fields)


def bad_request(exc: LonglabError, fields: dict[str, Any]) -> ApiError:
    """A LonglabError from :meth:`Request.check` (or the engine's size checks) as a 400 naming its field."""
    message = str(exc)
    param = _param_of(message, fields)
    code = "context_length_exceeded" if "max_position_embeddings" in message else None
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return ApiError(400, message, param, code=code)


def _param_of(message: str, fields: dict[str, Any]) -> str | None:
    from ..recipe import parse_recipe
    from ..registry import REGISTRY

    methods = (("recipe", None), ("reuse", "reuse"), ("speculative", "draft"), ("verify", "verify"))
    for name, family in methods:
        value = fields.get(name)
        if value is None:
            continue
        try:
            parse_recipe(value) if family is None else REGISTRY.parse(family, value)
        except (LonglabError, TypeError, ValueError):
            return name
    if "max_position_embeddings" in message or "KV cache" in message:
        return "messages" if "messages" in fields or "question" in fields else "prompt"
    word = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].rstrip(":")
    if word in fields or word in _OPENAI_NAME:
        return _OPENAI_NAME.get(word, word)
    return None


# ------------------------------------------------------------------------------------------ responses
def finish_reason(result: Any) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage_of(result: Any) -> dict[str, Any]:
    """Token counts; ``cached_tokens``: the prompt tokens whose KV was not computed for this request
    (a documents request: ``(1 - cost_fraction)`` of its prompt, what the store's caches saved)."""
    cached = 0
    if result.reuse is not None:
        frac = min(max(1.0 - float(result.reuse.cost_fraction), 0.0), 1.0)
        cached = int(round(frac * result.prompt_tokens))
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def longlab_of(result: Any) -> dict[str, Any]:
    """What longlab adds to a response (clients ignore it): the recipe and what the request cost."""
    return {
        "recipe": result.recipe,
        "kv_bytes_before": result.kv_bytes_before,
        "kv_bytes_after": result.kv_bytes_after,
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
    }


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def completion_body(parsed: Parsed, rid: str, model: str, result: Any) -> dict[str, Any]:
    created = int(time.time())
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": finish_reason(result), "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": finish_reason(result), "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_of(result), "longlab": longlab_of(result)}


def chunk(parsed: Parsed, rid: str, model: str, *, text: str | None = None, role: bool = False,
          finish: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk: a delta (``role``: the first chat chunk carries the assistant role), the final one
    (``finish``), or the usage chunk (no choices)."""
    created = int(time.time())
    if parsed.kind == "chat":
        obj = "chat.completion.chunk"
        if usage is not None:
            choices: list[dict[str, Any]] = []
        else:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        obj = "text_completion"
        choices = [] if usage is not None else [
            {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        ]
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out
