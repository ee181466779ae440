"""The prompt layout: how a context, a question and an answer prefix become token ids.

A prompt is split into a *context part* (prefilled, and compressed by KV policies in the query-agnostic
mode) and a *question part* (appended after compression). :func:`build_prompt` renders the two texts;
:func:`encode_prompts` tokenizes them per batch row. A leaf of the spine: it imports nothing from longlab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["build_prompt", "encode_prompts", "encode_messages", "continuation_ids"]

_SENTINEL = "\u2063LONGLAB_CONTEXT\u2063"


def build_prompt(
    tokenizer: Any, context: str, question: str | None, answer_prefix: str = "", chat_template: bool = True
) -> tuple[str, str]:
    """Split a prompt into (context part, question part).

    With a chat template (and ``chat_template=True``) the user turn is ``context + "\\n\\n" + question``;
    everything after the context (the question, the assistant header, ``answer_prefix``) is the
    question part. Otherwise the prompt is plain completion text: ``context``, a newline, ``question``,
    then ``answer_prefix`` (completion-style tasks such as the classic pass key use this form).
    Without a question the context is a plain prompt to continue."""
    if question is None:
        return context, answer_prefix
    if chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL + "\n\n" + question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        before, after = rendered.split(_SENTINEL, 1)
        return before + context, after + answer_prefix
    if answer_prefix and not answer_prefix[0].isspace():
        answer_prefix = " " + answer_prefix
    return context, "\n" + question + answer_prefix


def encode_prompts(
    tokenizer: Any,
    contexts: list[str],
    questions: list[str | None],
    answer_prefixes: list[str],
    chat_template: bool | list[bool] = True,
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the context parts and question parts, one list per batch row."""
    ctx_ids, q_ids = [], []
    flags = chat_template if isinstance(chat_template, list) else [chat_template] * len(contexts)
    for context, question, prefix, chat in zip(contexts, questions, answer_prefixes, flags):
        ctx_text, q_text = build_prompt(tokenizer, context, question, prefix, chat)
        templated = chat and question is not None and bool(getattr(tokenizer, "chat_template", None))
        ids = tokenizer(ctx_text, add_special_tokens=not templated)["input_ids"]
        ctx_ids.append(list(ids))
        q_ids.append(list(tokenizer(q_text, add_special_tokens=False)["input_ids"]) if q_text else [])
    return ctx_ids, q_ids


_TURN = "\u2063LONGLAB_LAST_TURN\u2063"


def encode_messages(
    tokenizer: Any, messages: list[dict[str, str]], answer_prefix: str = "", chat_template: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids of a chat's context part (every turn before the last user message's content) and its
    question part (that content, the end of the turn, the assistant header and ``answer_prefix``).
    Without a chat template (or ``chat_template=False``) the turns are plain text joined by blank lines."""
    *before, last = messages
    if chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [*before, {"role": last["role"], "content": _TURN}], tokenize=False, add_generation_prompt=True
        )
        head, tail = rendered.split(_TURN, 1)
        ctx = list(tokenizer(head, add_special_tokens=False)["input_ids"])
        q = list(tokenizer(last["content"] + tail + answer_prefix, add_special_tokens=False)["input_ids"])
        return ctx, q
    head = "\n\n".join(m["content"] for m in before)
    if answer_prefix and not answer_prefix[0].isspace():
        answer_prefix = " " + answer_prefix
    ctx = list(tokenizer(head)["input_ids"]) if head else []
    q = list(tokenizer(("\n\n" if head else "") + last["content"] + answer_prefix,
                       add_special_tokens=not head)["input_ids"])
    return ctx, q


def continuation_ids(
    question_ids: Callable[[str], list[int]], tokenizer: Any, answer_prefix: str, answer: str
) -> list[int]:
    """Token ids of ``" " + answer`` as they continue a prompt's question part: the question part is
    tokenized with ``answer_prefix`` and with ``answer_prefix + " " + answer`` (``question_ids(prefix)``),
    and the second's extra tail is the answer; where tokenization does not split cleanly, the answer's
    own ids."""
    q = question_ids(answer_prefix)
    joined = question_ids(answer_prefix + " " + answer)
    if joined[: len(q)] == q and len(joined) > len(q):
        return joined[len(q) :]
    return list(tokenizer(" " + answer, add_special_tokens=False)["input_ids"])
