"""What RULER's generators share: insertion depths, key/value draws and the needle sentence."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence

from ..haystacks import (
    words,
)

DEPTHS: tuple[float, ...] = tuple(i / 39 for i in range(40))
"""RULER's 40 equally spaced insertion depths between 0 and 100 %, as fractions."""

_TYPE_NAMES = {"numbers": "number", "words": "word", "uuids": "uuid"}
_HAYSTACKS = ("noise", "essay", "needle")


# --------------------------------------------------------------------------- keys and values


def _draw(rng: random.Random, kind: str) -> str:
    """One RULER key or value: 7-digit number, adjective-noun word pair, or uuid4."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        w = words()
        return f"{rng.choice(w['adjectives'])}-{rng.choice(w['nouns'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"key/value type must be one of {sorted(_TYPE_NAMES)}, got {kind!r}")


def _draw_unique(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        x = _draw(rng, kind)
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def _needle(type_v: str, key: str, value: str) -> str:
    return f"One of the special magic {type_v} for {key} is: {value}."


def _join_query(keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + ", and " + keys[-1]
