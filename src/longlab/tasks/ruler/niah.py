"""RULER's needle-in-a-haystack family (Hsieh et al. 2024): :func:`niah` and its 8 configurations."""

from __future__ import annotations

import random
from collections.abc import Callable

from ..generator import Built, Plan, run
from ..haystacks import (
    NOISE,
    Tokenizer,
    check_depth,
    essay_sentences,
    join_with_inserts,
)
from ..registry import register_task
from ..sample import Sample
from .common import _HAYSTACKS, _TYPE_NAMES, DEPTHS, _draw_unique, _join_query, _needle

# --------------------------------------------------------------------------- NIAH


def niah(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    haystack: str = "essay",
    key_type: str = "words",
    value_type: str = "numbers",
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    depth: float | None = None,
    essay_source: str | None = None,
    task: str = "niah",
    max_new_tokens: int = 128,
) -> list[Sample]:
    """RULER needle-in-a-haystack (Hsieh et al. 2024): ``num_keys`` keys with ``num_values`` values each
    are hidden as ``"One of the special magic {type_v} for {key} is: {value}."``; ``num_queries`` keys
    are asked and the answers are all their values.

    Needles go to depths drawn from RULER's 40 equally spaced depths (distinct per needle), or all at
    ``depth`` (fraction in [0, 1]) when given; in essays they sit at sentence boundaries.
    """
    if haystack not in _HAYSTACKS:
        raise ValueError(f"haystack must be one of {list(_HAYSTACKS)}, got {haystack!r}")
    for name, kind in (("key_type", key_type), ("value_type", value_type)):
        if kind not in _TYPE_NAMES:
            raise ValueError(f"{name} must be one of {sorted(_TYPE_NAMES)}, got {kind!r}")
    for name, value in (("num_keys", num_keys), ("num_values", num_values), ("num_queries", num_queries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if num_queries > num_keys:
        raise ValueError(f"num_queries must be in [1, num_keys={num_keys}], got {num_queries}")
    if num_keys * num_values > len(DEPTHS) and depth is None:
        raise ValueError(f"num_keys * num_values must be <= {len(DEPTHS)}, got {num_keys * num_values}")
    if depth is not None:
        depth = check_depth(depth)
    source, sentences = essay_sentences(essay_source) if haystack == "essay" else (haystack, ())

    type_v = value_type
    plural = num_values * num_queries > 1
    tv = type_v if plural else _TYPE_NAMES[type_v]
    if plural:
        intro = (
            f"Some special magic {tv} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {tv} afterwards.\n"
        )
    else:
        intro = (
            f"A special magic {tv} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {tv} afterwards.\n"
        )
    sep = " " if haystack == "essay" else "\n"

    def plan(rng: random.Random, index: int) -> Plan:
        taken: set[str] = set()
        keys = _draw_unique(rng, key_type, num_keys, taken)
        values = {k: _draw_unique(rng, value_type, num_values, taken) for k in keys}
        needles = [(k, v) for k in keys for v in values[k]]
        rng.shuffle(needles)
        queries = rng.sample(keys, num_queries)
        answers = [v for k in queries for v in values[k]]
        depths = [depth] * len(needles) if depth is not None else rng.sample(DEPTHS, len(needles))
        texts = [_needle(type_v, k, v) for k, v in needles]
        query = _join_query(queries)
        if plural:
            question = f"What are all the special magic {tv} for {query} mentioned in the provided text?"
            prefix = f" The special magic {tv} for {query} mentioned in the provided text are"
        else:
            question = f"What is the special magic {tv} for {query} mentioned in the provided text?"
            prefix = f" The special magic {tv} for {query} mentioned in the provided text is"

        start = rng.randrange(len(sentences)) if sentences else 0
        distractors: list[str] = []
        dist_rng = random.Random(rng.getrandbits(64))

        def units(n: int) -> list[str]:
            if haystack == "noise":
                return [NOISE] * n
            if haystack == "essay":
                return [sentences[(start + j) % len(sentences)] for j in range(n)]
            while len(distractors) < n:  # distractor needles, prefix-stable in n
                k = _draw_unique(dist_rng, key_type, 1, taken)[0]
                distractors.append(_needle(type_v, k, _draw_unique(dist_rng, value_type, 1, taken)[0]))
            return distractors[:n]

        def build(n: int) -> Built:
            hay, offsets = join_with_inserts(units(n), list(zip(depths, texts)), sep)
            base = len(intro)
            return Built(
                context=intro + hay + "\n",
                metadata={
                    "needle_offsets": [base + o for o in offsets],
                    "needle_depths": list(depths),
                    "haystack_span": [base, base + len(hay)],
                },
                depth=depths[0] if len(needles) == 1 else None,
            )

        return Plan(
            build=build,
            question=question,
            answer_prefix=prefix,
            answers=answers,
            lo=1,
            metadata={
                "haystack": haystack,
                "haystack_source": source,
                "key_type": key_type,
                "value_type": value_type,
                "num_keys": num_keys,
                "num_values": num_values,
                "num_queries": num_queries,
                "keys": keys,
                "query_keys": queries,
                "needles": texts,
            },
        )

    return run(task, tokenizer, length, num_samples, seed, plan, max_new_tokens)


def _niah_task(name: str, **config: object) -> Callable[..., list[Sample]]:
    def generate(
        tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, **options
    ) -> list[Sample]:
        return niah(tokenizer, length, num_samples, seed, task=name, **{**config, **options})

    generate.__name__ = generate.__qualname__ = name
    cfg = ", ".join(f"{k}={v!r}" for k, v in config.items())
    generate.__doc__ = f"RULER ``{name}`` (Hsieh et al. 2024): :func:`niah` with {cfg}."
    return register_task(name, metric="string_match_all")(generate)


niah_single_1 = _niah_task("niah_single_1", haystack="noise", key_type="words", value_type="numbers")
niah_single_2 = _niah_task("niah_single_2", haystack="essay", key_type="words", value_type="numbers")
niah_single_3 = _niah_task("niah_single_3", haystack="essay", key_type="words", value_type="uuids")
niah_multikey_1 = _niah_task(
    "niah_multikey_1", haystack="essay", key_type="words", value_type="numbers", num_keys=4
)
niah_multikey_2 = _niah_task("niah_multikey_2", haystack="needle", key_type="words", value_type="numbers")
niah_multikey_3 = _niah_task("niah_multikey_3", haystack="needle", key_type="uuids", value_type="uuids")
niah_multivalue = _niah_task(
    "niah_multivalue", haystack="essay", key_type="words", value_type="numbers", num_values=4
)
# RULER's synthetic.yaml asks 4 of 4 keys (the spec table's k=1 cannot hold 4 distinct queries).
niah_multiquery = _niah_task(
    "niah_multiquery", haystack="essay", key_type="words", value_type="numbers", num_keys=4, num_queries=4
)
