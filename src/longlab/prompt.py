"""The prompt layout: how a context, a question and an answer prefix become token ids.

A prompt is split into a *context part* (prefilled, and compressed by KV policies in the query-agnostic
mode) and a *question part* (appended after compression). :func:`build_prompt` renders the two texts;
:func:`encode_prompts` tokenizes them per batch row. A leaf of the spine: it imports nothing from longlab.

Layouts (``chat_template=`` takes ``True`` for the default, ``False`` for ``"plain"``, or a name):

- ``"chat"`` (the default): NVIDIA kvpress's pipeline layout (``KVPressTextGenerationPipeline.preprocess``,
  kvpress 0.5): one user turn whose content is the context followed directly by the question, then the
  assistant header, then the answer prefix. The context part is everything before the question (the
  chat template's system turn and user header included); the question part is the question, the end of
  the user turn, the assistant header and the answer prefix.
- ``"chat-sep"``: longlab's layout before 0.x: the same with ``"\\n\\n"`` between context and question.
- ``"plain"``: completion text without the chat template: the context, a newline, the question, then the
  answer prefix after a space (completion-style tasks such as the classic pass key use this form).

A tokenizer without a chat template always gets ``"plain"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_LAYOUT", "LAYOUTS", "build_prompt", "encode_prompts", "resolve_layout", "encode_messages",
           "continuation_ids"]

_SENTINEL = "\u2063LONGLAB_CONTEXT\u2063"
LAYOUTS: dict[str, str] = {  # layout -> what goes between the context and the question
    "chat": "",
    "chat-sep": "\n\n",
    "plain": "\n",
}
DEFAULT_LAYOUT = "chat"


def resolve_layout(chat_template: bool | str, tokenizer: Any = None) -> str:
    """The layout name of a ``chat_template`` argument: ``True`` -> :data:`DEFAULT_LAYOUT`, ``False`` ->
    ``"plain"``, a name of :data:`LAYOUTS` -> itself; ``"plain"`` whenever ``tokenizer`` has no chat
    template. Raises ``ValueError`` naming the allowed values otherwise."""
    if isinstance(chat_template, bool):
        layout = DEFAULT_LAYOUT if chat_template else "plain"
    elif isinstance(chat_template, str) and chat_template in LAYOUTS:
        layout = chat_template
    else:
        allowed = ", ".join(map(repr, LAYOUTS))
        raise ValueError(f"chat_template must be True, False or one of {allowed}, got {chat_template!r}")
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        return "plain"
    return layout


def build_prompt(
    tokenizer: Any,
    context: str,
    question: str | None,
    answer_prefix: str = "",
    chat_template: bool | str = True,
) -> tuple[str, str]:
    """Split a prompt into (context part, question part) under the layout ``chat_template`` names
    (module docstring). Without a question the context is a plain prompt to continue, followed by
    ``answer_prefix``."""
    if question is None:
        return context, answer_prefix
    layout = resolve_layout(chat_template, tokenizer)
    separator = LAYOUTS[layout]
    if layout == "plain":
        if answer_prefix and not answer_prefix[0].isspace():
            answer_prefix = " " + answer_prefix
        return context, separator + question + answer_prefix
    if layout == "chat-sep":  # the question inside the rendered user turn, as longlab did
        before, after = _render(tokenizer, _SENTINEL + separator + question)
        return before + context, after + answer_prefix
    # kvpress: render the context alone in the user turn, split there, put the question after it
    before, after = _render(tokenizer, _SENTINEL)
    return before + context, question + after + answer_prefix


def _render(tokenizer: Any, content: str) -> tuple[str, str]:
    """The chat template around one user turn holding ``content``, split at the context sentinel."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    before, after = rendered.split(_SENTINEL, 1)
    return before, after


def encode_prompts(
    tokenizer: Any,
    contexts: list[str],
    questions: list[str | None],
    answer_prefixes: list[str],
    chat_template: bool | str | list[bool | str] = True,
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the context parts and question parts, one list per batch row; ``chat_template`` is
    one layout for every row or a list with one per row (:func:`resolve_layout`)."""
    ctx_ids, q_ids = [], []
    flags = chat_template if isinstance(chat_template, list) else [chat_template] * len(contexts)
    for context, question, prefix, chat in zip(contexts, questions, answer_prefixes, flags):
        ctx_text, q_text = build_prompt(tokenizer, context, question, prefix, chat)
        templated = question is not None and resolve_layout(chat, tokenizer) != "plain"
        ids = tokenizer(ctx_text, add_special_tokens=not templated)["input_ids"]
        ctx_ids.append(list(ids))
        q_ids.append(list(tokenizer(q_text, add_special_tokens=False)["input_ids"]) if q_text else [])
    return ctx_ids, q_ids


_TURN = "\u2063LONGLAB_LAST_TURN\u2063"


def encode_messages(
    tokenizer: Any, messages: list[dict[str, str]], answer_prefix: str = "", chat_template: bool | str = True
) -> tuple[list[int], list[int]]:
    """Token ids of a chat's context part (every turn before the last user message's content) and its
    question part (that content, the end of the turn, the assistant header and ``answer_prefix``).
    Without a chat template (or ``chat_template=False``) the turns are plain text joined by blank lines."""
    *before, last = messages
    if resolve_layout(chat_template, tokenizer) != "plain":
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
    if not head:  # one turn, plain text: a prompt to continue (the context part is never empty)
        return list(tokenizer(last["content"])["input_ids"]), (
            list(tokenizer(answer_prefix, add_special_tokens=False)["input_ids"]) if answer_prefix else []
        )
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
