"""``summ_events``: a summarisation-like free-text task with a reference summary, scored by ROUGE-L.

A short story of ``num_events`` sentences (``"Event 2: Mara decided to admire the active acorn."``, names,
verbs, adjectives and nouns drawn from longlab's word lists) is spread in order over an essay haystack
(the sentences of :func:`~longlab.tasks.haystacks.essay_sentences`, at sorted random depths). The question
asks for a summary of the story; the reference is the events' sentences joined in order, and the score is
ROUGE-L F (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries"; longest common subsequence
of words, ``F = (1 + β²) R P / (R + β² P)`` with ``β = 1`` as in ``rouge-score``) of the generated text
against it. Free text, long enough to exercise decoding (48 new tokens by default), but with a reference:
the generation tasks of LongBench (GovReport, QMSum) are scored the same way. Offline and seeded like every
other generator (same ``(task, seed, index)`` -> same sample).
"""

from __future__ import annotations

import random

from .generator import Built, Plan, run
from .haystacks import Tokenizer, essay_sentences, join_with_inserts, words
from .registry import register_task
from .sample import Sample

__all__ = ["summ_events"]

_NAMES = (
    "Mara", "Tobin", "Ilse", "Ravi", "Nadia", "Oskar", "Lena", "Hugo", "Priya", "Felix", "Anouk", "Basil",
)  # fmt: skip
_INTRO = "Read the text below. A short story is told in the sentences that start with 'Event'.\n\n"
_QUESTION = (
    "Summarize the story told by the sentences that start with 'Event' in the text above, "
    "in order, in one or two sentences."
)


def _event(rng: random.Random) -> str:
    w = words()
    return (
        f"{rng.choice(_NAMES)} decided to {rng.choice(w['verbs'])} the "
        f"{rng.choice(w['adjectives'])} {rng.choice(w['nouns'])}."
    )


@register_task("summ_events", metric="rouge_l")
def summ_events(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    num_events: int = 4,
    max_new_tokens: int = 48,
    essay_source: str | None = None,
) -> list[Sample]:
    """A story of ``num_events`` sentences hidden in order in an essay haystack; summarise it (ROUGE-L
    against the story's sentences joined)."""
    if isinstance(num_events, bool) or not isinstance(num_events, int) or not 1 <= num_events <= 12:
        raise ValueError(f"num_events must be an integer in [1, 12], got {num_events!r}")
    source, sentences = essay_sentences(essay_source)

    def plan(rng: random.Random, index: int) -> Plan:
        events = [_event(rng) for _ in range(num_events)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in events)
        inserts = [(d, f"Event {k + 1}: {e}") for k, (d, e) in enumerate(zip(depths, events))]
        start = rng.randrange(len(sentences))

        def build(n: int) -> Built:
            units = [sentences[(start + j) % len(sentences)] for j in range(n)]
            hay, offsets = join_with_inserts(units, inserts, " ")
            base = len(_INTRO)
            return Built(
                context=_INTRO + hay + "\n\n",
                metadata={
                    "event_offsets": [base + o for o in offsets],
                    "haystack_span": [base, base + len(hay)],
                },
            )

        return Plan(
            build=build,
            question=_QUESTION,
            answer_prefix=" Summary:",
            answers=[" ".join(events)],
            lo=1,
            metadata={
                "haystack": "essay",
                "haystack_source": source,
                "events": events,
                "event_depths": depths,
            },
        )

    return run("summ_events", tokenizer, length, num_samples, seed, plan, max_new_tokens)
