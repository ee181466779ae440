"""Shared formatting and verdict rules of the KV-eviction, KV-quantization and sparse-prefill pages.

* :func:`sign_test`: the exact two-sided binomial sign test on the samples where two recipes differ
  (ties dropped): ``p = min(1, 2 Σ_{k ≤ min(up, down)} C(up + down, k) / 2^(up + down))``.
* :func:`call`: the verdict of one paired difference ``method − baseline`` with its 95% interval
  ``[low, high]``: *better* / *worse* when the interval excludes 0 and (when given) the sign test agrees
  at p < 0.05; *a lean* when the interval excludes 0 but the sign test does not (few samples differ, so
  the bootstrap may be too narrow); *not significant* when the interval contains 0.
* :func:`log_ratio_interval`: geometric mean of ratios with a two-sided 95% Student-t interval on the logs
  (each ratio paired: both timings from the same round or sample).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALPHA", "Claim", "call", "fmt_ci", "fmt_p", "log_ratio_interval", "sign_test"]

ALPHA = 0.05


def sign_test(up: int, down: int) -> float:
    """Exact two-sided sign test on ``up`` samples better and ``down`` worse (1.0 when none differ)."""
    if up < 0 or down < 0:
        raise ValueError(f"sign_test: counts must be >= 0, got up={up}, down={down}")
    n = up + down
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(up, down) + 1)) / 2**n)


def call(low: float, high: float, sign_p: float | None = None) -> str:
    """The verdict of a paired difference with 95% interval ``[low, high]`` (and its sign test p)."""
    if low > high:
        raise ValueError(f"call: interval [{low}, {high}] has low > high")
    if low <= 0 <= high:
        return "not significant"
    word = "better" if low > 0 else "worse"
    if sign_p is not None and sign_p >= ALPHA:
        return f"a lean ({word}), not established (sign test p ≥ {ALPHA})"
    return f"significantly {word}"


def fmt_p(p: float) -> str:
    """A p-value: two significant digits below 0.1, else three (``0.031``, ``0.125``, ``1``)."""
    return f"{p:.2g}" if p < 0.1 else f"{p:.3g}"


def fmt_ci(mean: float, low: float, high: float, nd: int = 1, sign: bool = False) -> str:
    """``mean [low, high]`` with ``nd`` decimals (``sign``: always show + or −); ``−0.0`` prints as 0."""

    def f(x: float) -> str:
        s = f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"
        if float(s) == 0:
            s = f"{0:.{nd}f}"
        return s.replace("-", "−")

    return f"{f(mean)} [{f(low)}, {f(high)}]"


def log_ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95% t-interval (on the logs); NaN bounds for one ratio."""
    from scipy import stats

    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"log_ratio_interval: need positive ratios, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    m = statistics.mean(logs)
    if len(logs) < 2:
        return math.exp(m), float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, len(logs) - 1)) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


@dataclass
class Claim:
    """One row of a page's verdict table: the paper's claim, what was measured here, the verdict, and the
    command that reproduces the measurement."""

    claim: str
    here: str
    verdict: str
    command: str
