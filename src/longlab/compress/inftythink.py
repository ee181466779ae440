"""InftyThink: iterative segment-and-summarise reasoning with a bounded context.

InftyThink (Yan et al., arXiv 2503.06692, ICLR 2026; code ZJU-REAL/InftyThink), inference loop as in
``specs/architectures-positions-benchmarks.md`` §10, with the model itself as the summariser:

- the prompt is the context, an ``instruction`` asking for ``<think>…</think>`` reasoning that ends in
  ``<summary>…</summary>`` while unfinished, and the question;
- iteration ``j`` decodes at most ``segment`` tokens (greedy); if the output holds no
  ``<summary>…</summary>`` (or ``iterations`` is reached) it is the final answer (the text after
  ``</think>`` when present);
- otherwise the next iteration starts from a **fresh cache** holding only
  ``prompt + <history>{latest summary}</history>``, so the KV memory is bounded by
  ``prompt + history + segment`` tokens however long the reasoning runs (``peak_kv_bytes`` records the
  largest cache of any iteration, ``reasoning_tokens`` the tokens generated over all iterations).

A ``context`` recipe part that removes nothing (``r`` must be 0): it appends the instruction to the
context and replaces decoding (``guides_decoding``); ``inftythink+snapkv@0.5`` compresses each
iteration's prompt cache too. With a model that never writes a summary it is one iteration: plain
greedy decoding of the instructed prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..recipe import LonglabError, register
from .base import Compressed, ContextCompressor, Prompt, check_prompt

__all__ = ["InftyThink", "split_summary"]

_SUMMARY = re.compile(r"<summary>(.*?)</summary>", re.S)


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
    docstring."""

    paper: ClassVar[str] = "InftyThink, Yan et al., arXiv 2503.06692, ICLR 2026"
    guides_decoding: ClassVar[bool] = True

    segment: int = 256
    iterations: int = 8
    instruction: str = (
        "\n\nReason step by step inside <think> </think>. If you have not finished, stop and write "
        "<summary> the key steps and intermediate results so far </summary>; you will continue from it. "
        "When you have finished, write the final answer after </think>."
    )

    def validate(self) -> None:
        if self.compression_ratio != 0:
            raise LonglabError(f"inftythink: compression_ratio must be 0 (it removes nothing), got "
                               f"{self.compression_ratio!r}")
        self.check("segment", 1, None, integer=True)
        self.check("iterations", 1, None, integer=True)

    def compress(self, prompt: Prompt, scorer: Any = None) -> Compressed:
        check_prompt(prompt)
        extra = prompt.encode(self.instruction) if self.instruction else []
        n = len(prompt.ids)
        out = Compressed(prompt.ids + extra, list(range(n)) + [-1] * len(extra), n)
        out.state = {"question_ids": list(prompt.question_ids)}
        return out

    @torch.inference_mode()
    def guided_decode(
        self, stream: Any, logits: torch.Tensor, max_new_tokens: int, eos_ids: set[int], tokenizer: Any,
        compressed: Compressed,
    ) -> tuple[list[int], dict[str, Any]]:
        """Run the iterations from the prefilled ``stream``; returns (final tokens, counters)."""
        if stream.batch_size != 1:
            raise LonglabError("inftythink decodes one row at a time; give a single context")
        prompt_ids = compressed.ids + compressed.state["question_ids"]
        stats: dict[str, Any] = {"iterations": 0, "reasoning_tokens": 0, "peak_kv_bytes": 0, "summaries": []}
        tokens: list[int] = []
        for j in range(self.iterations):
            tokens = stream.decode(logits, self.segment, eos_ids)[0]
            stats["iterations"] = j + 1
            stats["reasoning_tokens"] += len(tokens)
            stats["peak_kv_bytes"] = max(stats["peak_kv_bytes"], int(stream.cache.nbytes()))
            summary, _ = split_summary(tokenizer.decode(tokens, skip_special_tokens=True))
            if summary is None or j == self.iterations - 1:
                break
            stats["summaries"].append(summary[:200])
            history = tokenizer(f"<history>{summary}</history>\n", add_special_tokens=False)["input_ids"]
            stream = _fresh(stream)
            logits = stream.feed([prompt_ids + list(history)], 1024, compress="chunk")
        return tokens, stats

    def postprocess(self, text: str, prompt: Prompt, compressed: Compressed) -> str:
        return split_summary(text)[1] or text


def _fresh(stream: Any) -> Any:
    """An empty stream of the same kind, model and recipe (the bounded context of the next iteration)."""
    cache = type(stream.cache)(stream.cache.recipe)
    new = type(stream)(stream.model, cache, stream.batch_size)
    new.pad_id = stream.pad_id
    return new
