"""The loop every generator shares: plan a sample, fit its haystack to the token budget, emit it.

A task describes one sample as a :class:`Plan` whose ``build(n)`` renders the context with ``n``
haystack units; :func:`run` finds the largest ``n`` whose context + question fits in ``length``
tokens (RULER, Hsieh et al. 2024, binary-searches the haystack size the same way), never above it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .haystacks import (
    LengthTooSmall,
    Tokenizer,
    check_length,
    check_num_samples,
    check_seed,
    check_tokenizer,
    count_tokens,
    fit_units,
    sample_rng,
)
from .sample import Sample

__all__ = ["Built", "Plan", "run"]


@dataclass
class Built:
    """A rendered context and what is known about it (offsets, counts, ...)."""

    context: str
    metadata: dict[str, Any] = field(default_factory=dict)
    depth: float | None = None


@dataclass
class Plan:
    """One sample before its haystack size is known.

    ``build(n)`` must be deterministic and its token count non-decreasing in ``n``; ``lo`` is the
    smallest allowed ``n`` and ``max_n`` an optional cap.
    """

    build: Callable[[int], Built]
    question: str
    answer_prefix: str
    answers: list[str]
    lo: int = 1
    max_n: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def run(
    task: str,
    tokenizer: Tokenizer,
    length: int,
    num_samples: int,
    seed: int,
    plan: Callable[[random.Random, int], Plan],
    max_new_tokens: int,
) -> list[Sample]:
    """Generate ``num_samples`` samples of ``task`` whose context + question is at most ``length`` tokens."""
    check_tokenizer(tokenizer)
    check_length(length)
    check_num_samples(num_samples)
    check_seed(seed)
    samples: list[Sample] = []
    hint: int | None = None
    for i in range(num_samples):
        p = plan(sample_rng(task, seed, i), i)
        q_tokens = count_tokens(tokenizer, p.question)
        built: dict[int, Built] = {}
        tokens: dict[int, int] = {}

        def measure(
            n: int, p: Plan = p, built: dict = built, tokens: dict = tokens, q: int = q_tokens
        ) -> int:
            if n not in tokens:
                built[n] = p.build(n)
                tokens[n] = count_tokens(tokenizer, built[n].context) + q
            return tokens[n]

        try:
            # Sample 0 gets an exact search; the others start from its size and stop within 0.5 %.
            n = fit_units(
                measure,
                length,
                p.lo,
                guess=hint,
                slack=0 if hint is None else max(1, length // 200),
                max_n=p.max_n,
            )
        except LengthTooSmall as err:
            need = err.args[0]
            raise ValueError(
                f"length={length} is too small for task {task!r}: with this tokenizer it must be at least "
                f"{need} tokens (template, question and needles); allowed range is [{need}, inf)"
            ) from None
        if hint is None:
            hint = n
        b = built[n]
        ctx_tokens = tokens[n] - q_tokens
        metadata = {
            **p.metadata,
            **b.metadata,
            "haystack_units": n,
            "context_tokens": ctx_tokens,
            "question_tokens": q_tokens,
            "seed": seed,
            "index": i,
        }
        samples.append(
            Sample(
                context=b.context,
                question=p.question,
                answer_prefix=p.answer_prefix,
                answers=list(p.answers),
                max_new_tokens=max_new_tokens,
                task=task,
                length=length,
                depth=b.depth,
                sample_id=f"{task}-{length}-s{seed}-{i}",
                metadata=metadata,
            )
        )
    return samples
