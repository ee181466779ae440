"""RULER's frequent-words extraction (``fwe``, Hsieh et al. 2024): Zipf-distributed coded words."""

from __future__ import annotations

import math
import random
import string

from ..generator import Built, Plan, run
from ..haystacks import (
    Tokenizer,
)
from ..registry import register_task
from ..sample import Sample

# --------------------------------------------------------------------------- frequent words

_ZETA2 = math.pi**2 / 6


def _zipf_counts(n: int, vocab_size: int, alpha: float) -> list[int]:
    zeta = _ZETA2 if alpha == 2.0 else sum(k**-alpha for k in range(1, 100_000))
    return [int(n * k**-alpha / zeta) for k in range(1, vocab_size + 1)]


@register_task("fwe", metric="string_match_all")
def fwe(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    vocab_size: int = 2000,
    alpha: float = 2.0,
    max_new_tokens: int = 50,
) -> list[Sample]:
    """RULER frequent words extraction (Hsieh et al. 2024): random 6-letter coded words with counts
    proportional to ``k^-alpha / zeta(alpha)``; the rank-1 word is replaced by the noise ``"...."`` and
    the answer is the words of ranks 2-4.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 5:
        raise ValueError(f"vocab_size must be an integer >= 5, got {vocab_size!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 1.0:
        raise ValueError(f"alpha must be a number > 1, got {alpha!r}")
    alpha = float(alpha)
    # smallest size parameter for which ranks 2-4 strictly beat rank 5
    lo = 1
    while True:
        c = _zipf_counts(lo, 5, alpha)
        if c[3] > c[4]:
            break
        lo += 1
    intro = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. "
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the coded text?"
    )
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"

    def plan(rng: random.Random, index: int) -> Plan:
        vocab: list[str] = []
        seen: set[str] = set()
        while len(vocab) < vocab_size:
            wd = "".join(rng.choices(string.ascii_lowercase, k=6))
            if wd not in seen:
                seen.add(wd)
                vocab.append(wd)
        vocab[0] = "...."
        shuffle_key = rng.getrandbits(64)

        def build(n: int) -> Built:
            items = [wd for wd, c in zip(vocab, _zipf_counts(n, vocab_size, alpha)) for _ in range(c)]
            random.Random(f"{shuffle_key}/{n}").shuffle(items)
            body = " ".join(items)
            return Built(
                context=intro + body + "\n",
                metadata={"haystack_span": [len(intro), len(intro) + len(body)], "num_words": len(items)},
            )

        return Plan(
            build=build,
            question=question,
            answer_prefix=prefix,
            answers=vocab[1:4],
            lo=lo,
            metadata={
                "haystack": "coded_words",
                "haystack_source": "random",
                "alpha": alpha,
                "vocab_size": vocab_size,
            },
        )

    return run("fwe", tokenizer, length, num_samples, seed, plan, max_new_tokens)
