"""Classic retrieval probes: pass-key retrieval and the depth x length needle grid.

* ``passkey`` follows Mohtashami & Jaggi (2023, Landmark Attention): a 5-digit-or-less key in
  repeated filler, scored by exact match of the first generated integer.
* ``niah_grid`` is the gkamradt needle-in-a-haystack sweep, here with RULER's needle format by
  default (Hsieh et al. 2024; ``niah_single_2`` at a fixed depth) or the original San Francisco needle.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .generator import Built, Plan, run
from .haystacks import NOISE, Tokenizer, check_depth, check_length, essay_sentences, join_with_inserts
from .registry import register_task
from .ruler import niah
from .sample import Sample

__all__ = ["passkey", "niah_grid", "CLASSIC_NEEDLE"]

_PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n"
)

CLASSIC_NEEDLE = (
    "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
)


@register_task("passkey", metric="first_int_match")
def passkey(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    depth: float | None = None,
    max_new_tokens: int = 10,
) -> list[Sample]:
    """Pass-key retrieval (Mohtashami & Jaggi 2023): ``"The pass key is {k}. Remember it. {k} is the
    pass key."`` with ``k ~ U{1..50000}`` hidden in repeated filler at ``depth`` (uniform when None)."""
    if depth is not None:
        depth = check_depth(depth)

    def plan(rng: random.Random, index: int) -> Plan:
        key = rng.randint(1, 50_000)
        d = depth if depth is not None else rng.random()
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."

        def build(n: int) -> Built:
            hay, (offset,) = join_with_inserts([NOISE] * n, [(d, needle)], " ")
            base = len(_PASSKEY_INTRO)
            return Built(
                context=_PASSKEY_INTRO + hay + "\n",
                metadata={"needle_offsets": [base + offset], "haystack_span": [base, base + len(hay)]},
                depth=d,
            )

        return Plan(
            build=build,
            question="What is the pass key?",
            answer_prefix=" The pass key is",
            answers=[str(key)],
            lo=1,
            # The protocol is a completion prompt ("... What is the pass key? The pass key is"), not a chat
            # turn: SmolLM2-135M finds 6/6 keys at 1k tokens this way and 2/6 inside its chat template
            # (passkey(tok, 1024, 6, 0) through generate(..., "full", chat_template=False / True)).
            metadata={
                "haystack": "noise", "haystack_source": "noise", "needle_depths": [d], "prompt": "plain"
            },
        )

    return run("passkey", tokenizer, length, num_samples, seed, plan, max_new_tokens)


def _classic(
    tokenizer: Tokenizer, length: int, num_samples: int, seed: int, depth: float, essay_source: str | None
) -> list[Sample]:
    source, sentences = essay_sentences(essay_source)

    def plan(rng: random.Random, index: int) -> Plan:
        start = rng.randrange(len(sentences))

        def build(n: int) -> Built:
            units = [sentences[(start + j) % len(sentences)] for j in range(n)]
            hay, (offset,) = join_with_inserts(units, [(depth, CLASSIC_NEEDLE)], " ")
            return Built(
                context=hay + "\n\n",
                metadata={"needle_offsets": [offset], "haystack_span": [0, len(hay)]},
                depth=depth,
            )

        return Plan(
            build=build,
            question="What is the best thing to do in San Francisco? Answer using only the text above.",
            answer_prefix=" The best thing to do in San Francisco is",
            answers=["sandwich", "Dolores Park"],
            lo=1,
            metadata={
                "haystack": "essay",
                "haystack_source": source,
                "needle": "classic",
                "needle_depths": [depth],
            },
        )

    return run("niah_grid", tokenizer, length, num_samples, seed, plan, 64)


@register_task("niah_grid", metric="string_match_all", kind="grid")
def niah_grid(
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    num_samples: int = 1,
    seed: int = 0,
    *,
    needle: str = "ruler",
    haystack: str = "essay",
    essay_source: str | None = None,
) -> list[Sample]:
    """A depth x length grid of single-needle samples (gkamradt NIAH; RULER needle by default).

    Returns ``len(lengths) * len(depths) * num_samples`` samples, length-major, each with ``depth``
    set (fraction of the haystack in [0, 1]) and ``task="niah_grid"``. A given sample index uses the
    same needle in every cell, so cells differ only by length and depth. ``needle="classic"`` uses the
    San Francisco needle in the essay haystack (answers: "sandwich", "Dolores Park").
    """
    if needle not in ("ruler", "classic"):
        raise ValueError(f"needle must be 'ruler' or 'classic', got {needle!r}")
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise ValueError(f"lengths must be a non-empty sequence of integers >= 1, got {lengths!r}")
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence) or not depths:
        raise ValueError(f"depths must be a non-empty sequence of numbers in [0, 1], got {depths!r}")
    lengths = [check_length(x, "lengths") for x in lengths]
    depths = [check_depth(d, "depths") for d in depths]
    if needle == "classic" and haystack != "essay":
        raise ValueError(f"haystack must be 'essay' with needle='classic', got {haystack!r}")
    out: list[Sample] = []
    for length in lengths:
        for depth in depths:
            if needle == "classic":
                cell = _classic(tokenizer, length, num_samples, seed, depth, essay_source)
            else:
                cell = niah(
                    tokenizer,
                    length,
                    num_samples,
                    seed,
                    haystack=haystack,
                    depth=depth,
                    essay_source=essay_source,
                    task="niah_grid",
                )
            for s in cell:
                s.sample_id = f"niah_grid-{length}-d{depth:.4f}-s{seed}-{s.metadata['index']}"
                s.metadata["needle"] = needle
            out.extend(cell)
    return out
