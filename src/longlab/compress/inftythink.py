"""InftyThink: iterative segment-and-summarise reasoning with a bounded context.

InftyThink (Yan et al., arXiv 2503.06692, ICLR 2026; code ZJU-REAL/InftyThink), inference loop as in
``specs/architectures-positions-benchmarks.md`` §10, with the model itself as the summariser:

- iteration ``j`` decodes at most ``segment`` tokens (greedy) from a cache holding the prompt (and, for
  ``j > 0``, the history);
- the segment's summary ``s_j`` is the last ``<summary>…</summary>`` block it wrote; with
  ``summarise="ask"`` (below), a segment that stops at its token limit without one is followed by an
  explicit instruction turn (``ask``) and the model's reply (at most ``summary_tokens`` tokens) is ``s_j``;
- **stop rule**: a segment without a summary (with ``"ask"``: one that ended at end of turn, or an empty
  reply to the request) or the ``iterations``-th segment is the final answer (the text after
  ``</think>`` when present);
- otherwise iteration ``j + 1`` starts from a cache holding only ``prompt + history(s_j)``
  (``history``; the paper's ``<history>{summary}</history>`` with ``"tags"``,
  ``My progress so far: {summary}`` with ``"ask"``, read as the start of the model's own answer, since an
  untrained model copies the tags into its answer), so the KV memory is bounded
  by ``prompt + history + segment (+ ask + summary_tokens)`` tokens however long the reasoning runs:
  ``peak_kv_bytes`` records the largest cache of any iteration (``cache.nbytes()``: the entries held),
  ``reasoning_tokens`` the segment tokens generated over all iterations, ``summary_tokens_used`` the
  tokens of asked summaries, ``history_tokens`` each history's length.

The prompt is prefilled **once**: every iteration forks the prompt-only cache (copy on write) and
feeds only its history, the same cache contents as a fresh prefill of ``prompt + history`` (greedy
tokens equal, tested), without re-reading the prompt ``iterations`` times. The prompt-only cache is
kept for the run beside each iteration's (``prompt_kv_bytes``): the memory held is at most
``prompt_kv_bytes + peak_kv_bytes``, still independent of how long the reasoning runs. Under a KV
policy (``inftythink+snapkv@0.5``) every iteration starts from the prompt cache as the pipeline
compressed it, and the history is appended uncompressed (as the question is, query-agnostic).

Two ways to get the summaries:

- ``summarise="tags"`` (default, the paper's format): the prompt adds ``instruction`` asking for
  ``<think>…</think>`` reasoning that ends in ``<summary>…</summary>`` while unfinished. InftyThink's models
  are fine-tuned to write these; with prompting alone no model shipped here does (then it is one
  iteration: plain greedy decoding of the instructed prompt).
- ``summarise="ask"``: a **training-free adaptation** of the paper's trained format (not in the paper).
  The prompt is unchanged (no instruction unless one is given), so the first segment is plain greedy
  decoding, token for token; when a segment is cut at ``segment`` tokens the model is asked, in a new
  user turn of its chat template (``\\n\\n{ask}\\n`` without one), to summarise its progress, and that
  generated text becomes the next iteration's history. The summariser is still the model itself, but the
  summary costs an extra turn (in the same bounded cache) instead of being part of the reasoning.

A ``context`` recipe part that removes nothing (``r`` must be 0): it appends the instruction to the
context and replaces decoding (``guides_decoding``; ``max_new_tokens`` does not apply: the budget is
``iterations * segment``); ``inftythink+snapkv@0.5`` compresses the prompt cache too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, register
from ..registry import MAX_TOKENS, param
from .base import Compressed, ContextCompressor, Prompt, check_prompt

__all__ = ["InftyThink", "ask_turn", "split_summary"]

_SUMMARY = re.compile(r"<summary>(.*?)</summary>", re.S)
_MARK = "\u2063LONGLAB_SEGMENT\u2063"
TAGS_INSTRUCTION = (
    "\n\nReason step by step inside <think> </think>. If you have not finished, stop and write "
    "<summary> the key steps and intermediate results so far </summary>; you will continue from it. "
    "When you have finished, write the final answer after </think>."
)
ASK = ("Stop here. Summarise your progress in one line: copy the most recent intermediate result exactly "
       "as you wrote it. Do not continue the work and do not give the final answer yet.")
HISTORY = "<history>{summary}</history>\n"  # the paper's format
ASK_HISTORY = "My progress so far: {summary}\nContinuing from there:\n"  # read as the model's own words


def split_summary(text: str) -> tuple[str | None, str]:
    """(the last ``<summary>`` body or None, the answer text: after ``</think>`` if present, without
    any summary)."""
    found = _SUMMARY.findall(text)
    summary = found[-1].strip() if found else None
    answer = text.split("</think>", 1)[1] if "</think>" in text else text
    answer = _SUMMARY.sub("", answer).replace("<summary>", "").strip()
    return (summary or None), answer


@register("inftythink")
@dataclass
class InftyThink(ContextCompressor):
    """Iterative segment-and-summarise reasoning (Yan et al., "InftyThink: Breaking the Length Limits of
    Long-Context Reasoning in Large Language Models", arXiv 2503.06692, ICLR 2026); see the module
    docstring. ``summarise="ask"``: the training-free adaptation (the model is asked for its summary)."""

    paper: ClassVar[str] = "InftyThink, Yan et al., arXiv 2503.06692, ICLR 2026"
    guides_decoding: ClassVar[bool] = True

    # the reasoning budget is iterations x segment tokens (max_new_tokens does not apply): at most MAX_TOKENS
    segment: int = param(256, low=1, high=MAX_TOKENS, integer=True)
    iterations: int = param(8, low=1, high=1024, integer=True)
    summarise: str = param("tags", choices=("tags", "ask"))
    instruction: str | None = None  # None: TAGS_INSTRUCTION with "tags", nothing with "ask"
    ask: str = ASK
    summary_tokens: int = param(64, low=1, high=MAX_TOKENS, integer=True)
    history: str | None = None  # None: HISTORY with "tags", ASK_HISTORY with "ask"

    def validate(self) -> None:
        if self.compression_ratio != 0:
            raise LonglabError(f"inftythink: compression_ratio must be 0 (it removes nothing), got "
                               f"{self.compression_ratio!r}")
        if self.iterations * self.segment > MAX_TOKENS:
            raise LonglabError(
                f"inftythink: iterations x segment (the reasoning budget) must be at most {MAX_TOKENS} "
                f"tokens, got {self.iterations} x {self.segment}"
            )
        if self.history is not None and "{summary}" not in self.history:
            raise LonglabError(f"inftythink: history must contain {{summary}}, got {self.history!r}")
        if self.summarise == "ask" and not self.ask.strip():
            raise LonglabError("inftythink: ask must be a non-empty request with summarise='ask'")

    @property
    def prompt_instruction(self) -> str:
        """The text appended to the context: ``instruction``, or the mode's default."""
        if self.instruction is not None:
            return self.instruction
        return TAGS_INSTRUCTION if self.summarise == "tags" else ""

    @property
    def history_template(self) -> str:
        """How a summary opens the next iteration: ``history``, or the mode's default."""
        if self.history is not None:
            return self.history
        return HISTORY if self.summarise == "tags" else ASK_HISTORY

    def compress(self, prompt: Prompt, scorer: Any = None) -> Compressed:
        check_prompt(prompt)
        text = self.prompt_instruction
        extra = prompt.encode(text) if text else []
        n = len(prompt.ids)
        return Compressed(prompt.ids + extra, list(range(n)) + [-1] * len(extra), n)

    @torch.inference_mode()
    def guided_decode(
        self, stream: Any, logits: torch.Tensor, max_new_tokens: int, eos_ids: set[int], tokenizer: Any,
        compressed: Compressed,
    ) -> tuple[list[int], dict[str, Any]]:
        """Run the iterations from ``prompt``, the stream holding the prefilled prompt (and nothing else);
        returns (final tokens, counters).

        The prompt is prefilled once: each iteration decodes in a fork of ``prompt`` (:func:`_branch`;
        ``prompt`` itself is never written), iteration ``j > 0`` after feeding only its history. Each
        iteration's cache thus holds prompt + history + its own tokens, as a fresh prefill of
        prompt + history would (``test_inftythink_equals_a_fresh_prefill_every_iteration``)."""
        prompt = stream
        if prompt.batch_size != 1:
            raise LonglabError("inftythink decodes one row at a time; give a single context")
        stats: dict[str, Any] = {"iterations": 0, "reasoning_tokens": 0, "summary_tokens_used": 0, "asked": 0,
                                 "peak_kv_bytes": 0, "stop": "", "summaries": [], "history_tokens": [],
                                 "prompt_kv_bytes": int(prompt.cache.nbytes())}
        tokens: list[int] = []
        history: list[int] = []  # the previous iteration's history (none before the first)
        for j in range(self.iterations):
            stream = None  # the last iteration's cache goes before the next one is made
            stream, logits = self._iteration_start(prompt, history, logits, compressed)
            tokens = stream.decode(logits, self.segment, eos_ids)[0]  # [<= segment]
            stats["iterations"] = j + 1
            stats["reasoning_tokens"] += len(tokens)
            stats["peak_kv_bytes"] = max(stats["peak_kv_bytes"], int(stream.cache.nbytes()))
            ended = bool(tokens) and tokens[-1] in eos_ids  # the model closed its turn: it has answered
            summary, _ = split_summary(tokenizer.decode(tokens, skip_special_tokens=True))
            last = j == self.iterations - 1
            if summary is None and self.summarise == "ask" and not ended and not last:
                summary = self._asked_summary(stream, tokens[-1], tokenizer, eos_ids, stats)
            if summary is None or last:
                unfinished = summary is not None or (self.summarise == "ask" and not ended)
                # why it stopped: the iteration cap while unfinished, the model closed its turn without a
                # summary, or it wrote (or, asked, gave) none
                stats["stop"] = "iterations" if unfinished else "end of turn" if ended else "no summary"
                break
            stats["summaries"].append(summary[:200])
            history = list(tokenizer(self.history_template.replace("{summary}", summary),
                                     add_special_tokens=False)["input_ids"])
            stats["history_tokens"].append(len(history))
        return tokens, stats

    def _iteration_start(self, prompt: Any, history: list[int], logits: torch.Tensor,
                         compressed: Compressed) -> tuple[Any, torch.Tensor]:
        """The stream an iteration decodes in and its next-token logits ``[1, V]``: a fork of the
        prefilled ``prompt`` (:func:`_branch`) that has read ``history`` (nothing before the first)."""
        stream = _branch(prompt)
        if history:
            logits = stream.feed([history], 1024, compress="none")  # [1, V]
        return stream, logits

    def _asked_summary(
        self, stream: Any, last: int, tokenizer: Any, eos_ids: set[int], stats: dict[str, Any]
    ) -> str | None:
        """``summarise="ask"``: feed the cut segment's last token (not yet cached) and the request turn
        into ``stream``, decode the model's reply greedily; None when it is empty."""
        request = [last, *ask_turn(tokenizer, self.ask)]
        logits = stream.feed([request], 1024, compress="none")
        reply = stream.decode(logits, self.summary_tokens, eos_ids)[0]
        stats["asked"] += 1
        stats["summary_tokens_used"] += len(reply)
        stats["peak_kv_bytes"] = max(stats["peak_kv_bytes"], int(stream.cache.nbytes()))
        text = tokenizer.decode(reply, skip_special_tokens=True).strip()
        return text or None

    def postprocess(self, text: str, prompt: Prompt, compressed: Compressed) -> str:
        return split_summary(text)[1] or text


def ask_turn(tokenizer: Any, ask: str) -> list[int]:
    """Token ids that end the assistant's (cut) turn and open a user turn holding ``ask``, then the
    assistant header, as the tokenizer's chat template renders them; ``\\n\\n{ask}\\n`` without one."""
    turn = f"\n\n{ask}\n"
    if getattr(tokenizer, "chat_template", None):
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": "question"}, {"role": "assistant", "content": _MARK},
                 {"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True,
            )
            if _MARK in rendered:
                turn = rendered.split(_MARK, 1)[1]
        except Exception:  # a template that refuses this conversation: the plain request
            pass
    return list(tokenizer(turn, add_special_tokens=False)["input_ids"])


def _branch(prompt: Any) -> Any:
    """An iteration's stream: a fork of the prefilled ``prompt`` stream that ``prompt`` never sees.

    It reads the prompt's key/value buffers without copying them (``Stream.fork(share=True)``, copy on
    write: its first append copies the prompt's slots into a buffer of its own, so ``cache.nbytes()`` of
    the fork is prompt + what it appended, never more); a deep copy instead when the recipe writes into
    held slots in place (a decode policy such as RetroAttention) or holds outside resources."""
    cache = prompt.cache
    return prompt.fork(share=cache.recipe.decode is None and not cache.resources)
