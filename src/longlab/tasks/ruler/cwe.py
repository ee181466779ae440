"""RULER's common-words extraction (``cwe``, Hsieh et al. 2024)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..generator import Built, Plan, run
from ..haystacks import (
    Tokenizer,
    check_length,
    words,
)
from ..registry import register_task
from ..sample import Sample

# --------------------------------------------------------------------------- common words


def _pseudo_words(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """Pronounceable made-up words, used once the shipped word list runs out."""
    onsets = "b d f g h k l m n p r s t v z br dr gl pl st tr".split()
    vowels = "a e i o u".split()
    out = []
    while len(out) < count:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(3))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def _numbered(items: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)


@register_task("cwe", metric="string_match_all")
def cwe(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    num_cw: int = 10,
    freq_cw: int | None = None,
    freq_ucw: int | None = None,
    max_new_tokens: int = 120,
) -> list[Sample]:
    """RULER common words extraction (Hsieh et al. 2024): a numbered list where ``num_cw`` words appear
    ``freq_cw`` times and every other word ``freq_ucw`` times (30 and 3; 6 and 1 below 4K tokens); the
    answer is the ``num_cw`` common words. One solved example (its own words) is prepended.
    """
    check_length(length)
    if freq_cw is None:
        freq_cw = 30 if length >= 4096 else 6
    if freq_ucw is None:
        freq_ucw = 3 if length >= 4096 else 1
    for name, value in (("num_cw", num_cw), ("freq_cw", freq_cw), ("freq_ucw", freq_ucw)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if freq_ucw >= freq_cw:
        raise ValueError(f"freq_ucw must be in [1, freq_cw={freq_cw}), got {freq_ucw}")
    w = words()
    vocab = sorted(set(w["adjectives"]) | set(w["nouns"]) | set(w["verbs"]))
    question = f"Question: What are the {num_cw} most common words in the above list?"
    prefix = f" Answer: The top {num_cw} words that appear most often in the list are:"
    ex_ucw = 2 * num_cw
    if len(vocab) < 2 * num_cw + ex_ucw + 1:
        raise ValueError(f"num_cw must be in [1, {(len(vocab) - 1) // 4}], got {num_cw}")

    def plan(rng: random.Random, index: int) -> Plan:
        order = list(vocab)
        rng.shuffle(order)
        common, ex_common, ex_rare = (
            order[:num_cw],
            order[num_cw : 2 * num_cw],
            order[2 * num_cw : 2 * num_cw + ex_ucw],
        )
        rare = order[2 * num_cw + ex_ucw :]
        taken = set(vocab)
        extra_rng = random.Random(rng.getrandbits(64))
        ex_items = ex_common * 3 + ex_rare
        rng.shuffle(ex_items)
        example = (
            _CWE_INTRO + _numbered(ex_items) + "\n" + question + prefix + " " + " ".join(ex_common) + "\n\n"
        )
        shuffle_key = rng.getrandbits(64)

        def build(n: int) -> Built:
            if n > len(rare):
                rare.extend(_pseudo_words(extra_rng, n - len(rare), taken))
            items = common * freq_cw + rare[:n] * freq_ucw
            random.Random(f"{shuffle_key}/{n}").shuffle(items)
            body = _numbered(items)
            base = len(example) + len(_CWE_INTRO)
            return Built(
                context=example + _CWE_INTRO + body + "\n",
                metadata={"haystack_span": [base, base + len(body)], "num_words": len(items)},
            )

        return Plan(
            build=build,
            question=question,
            answer_prefix=prefix,
            answers=list(common),
            lo=0,
            metadata={
                "haystack": "words",
                "haystack_source": "builtin:tasks_words.json",
                "freq_cw": freq_cw,
                "freq_ucw": freq_ucw,
                "num_cw": num_cw,
            },
        )

    return run("cwe", tokenizer, length, num_samples, seed, plan, max_new_tokens)
