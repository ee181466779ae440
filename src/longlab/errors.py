"""longlab's user errors and the checks that raise them (a leaf: imports nothing from longlab).

:class:`LonglabError` is a user error (bad argument, unknown name, empty input): the CLI prints it as one
line without a traceback. :func:`check_range` and :func:`check_choice` are the one place every method's
``validate()`` and every tool's arguments check a value, naming it and its allowed range.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["LonglabError", "LonglabTypeError", "shorten", "check_range", "check_choice", "range_text"]


class LonglabError(ValueError):
    """A user error: bad argument, unknown name, empty input. The CLI prints it without a traceback."""


class LonglabTypeError(LonglabError, TypeError):
    """A user error of the wrong type (``context=None``, ``seed="abc"``): a LonglabError and a TypeError."""


def shorten(text: object, limit: int = 80) -> str:
    """``repr(text)`` cut to about ``limit`` characters with an ellipsis, for echoing user input in errors
    (a 100 KB recipe name is not printed whole)."""
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    return f"{shown[: limit - 1]}\u2026 ({len(str(text))} characters)"


# ---------------------------------------------------------------------------------------------- validators
# One place for the field checks of every method's ``validate()`` and the tools' arguments: each raises
# LonglabError naming the field and its allowed range, and returns the value it accepted.


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def range_text(low: float | None, high: float | None, integer: bool, low_open: bool, high_open: bool) -> str:
    """``[0, 1)`` -> "in [0, 1)", ``(0, inf)`` -> "a positive number", ``[1, inf)`` -> ">= 1";
    integers: "an integer >= 1", "a positive integer"."""
    if low is None and high is None:
        text = ""
    elif high is None and low == 0 and low_open:
        text = "positive"
    elif high is None:
        text = f"{'>' if low_open else '>='} {_num(low)}"
    elif low is None:
        text = f"{'<' if high_open else '<='} {_num(high)}"
    else:
        text = f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if integer:
        return "a positive integer" if text == "positive" else f"an integer {text}".rstrip()
    return "a positive number" if text == "positive" else text or "a number"


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    integer: bool = False,
    low_open: bool = False,
    high_open: bool = False,
) -> Any:
    """Return ``value`` if it is a number (an ``int`` with ``integer=True``; never a bool, NaN or infinity)
    with ``low (<|<=) value (<|<=) high``; else raise :class:`LonglabError` naming ``name`` and the range::

        check_range("snapkv: compression_ratio", 1.5, 0, 1, high_open=True)
        # LonglabError: snapkv: compression_ratio must be in [0, 1), got 1.5
    """
    text = range_text(low, high, integer, low_open, high_open)
    numeric = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not numeric:
        kind = text if text.startswith("a") else f"a number {text}"
        raise LonglabError(f"{name} must be {kind}, got {shorten(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        kind = text.replace("a ", "a finite ", 1) if text.startswith("a ") else f"a finite number {text}"
        raise LonglabError(f"{name} must be {kind}, got {value!r}")
    ok = (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high)
    )
    if not ok:
        raise LonglabError(f"{name} must be {text}, got {shorten(value)}")
    return value


def _choice_text(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, bool) or choice is None else repr(choice)


def check_choice(name: str, value: Any, choices: tuple | list) -> Any:
    """Return ``value`` if it is one of ``choices`` (same type too: ``1`` is not ``true``); else raise
    :class:`LonglabError`: ``kivi2: pooling must be 'avg' or 'max', got 'mean'``."""
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    shown = [_choice_text(c) for c in choices]
    listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    raise LonglabError(f"{name} must be {listed}, got {shorten(value)}")
