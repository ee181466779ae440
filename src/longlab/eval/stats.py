"""Confidence intervals for result tables: Wilson for pass/fail cells, bootstrap for graded ones, and a
paired bootstrap for differences between two recipes on the same samples.

* **Wilson score interval** (Wilson 1927, "Probable inference, the law of succession, and statistical
  inference", JASA 22) for ``k`` successes in ``n`` trials, with ``z`` the two-sided normal quantile
  (1.95996 for 95%) and ``p = k / n``::

      centre = (p + z²/(2n)) / (1 + z²/n)
      half   = z / (1 + z²/n) · sqrt(p(1 - p)/n + z²/(4n²))
      CI     = [centre - half, centre + half]

  It stays inside [0, 1] and is not degenerate at ``k = 0`` or ``k = n`` (unlike the normal
  approximation): ``k = 0, n = 10`` gives ``[0, 0.2775]``.
* **Percentile bootstrap** (Efron & Tibshirani 1993, ch. 13) of a weighted mean of stratum means
  ``θ = Σ_s w_s · mean(x_s)``: each of ``R`` resamples draws ``n_s`` values with replacement inside
  every stratum ``s`` (drawn as multinomial counts of the distinct values, the same distribution)
  and recomputes ``θ``; the CI is the ``α/2`` and ``1 - α/2`` quantiles of the
  ``R`` values. One stratum with weight 1 is the ordinary bootstrap of a mean. Seeded: the same data
  give the same interval.
* **Paired bootstrap** of a difference: the same, applied to the per-sample differences
  ``d_i = a_i - b_i`` (both recipes scored on sample ``i``), so sample difficulty cancels. The
  difference is *significant* at the chosen level when its CI excludes 0; two identical score lists
  give ``d = 0`` everywhere, a zero-width CI ``[0, 0]`` and "not significant".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from ..recipe import LonglabError

__all__ = [
    "CONFIDENCE",
    "RESAMPLES",
    "SEED",
    "Difference",
    "Estimate",
    "bootstrap_ci",
    "is_binary",
    "paired_difference",
    "score_estimate",
    "stratified_difference",
    "stratified_estimate",
    "wilson_interval",
]

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
_MAX_DRAWS = 4_000_000  # multinomial counts drawn at once (bounds memory: 32 MB of int64)


@dataclass(frozen=True)
class Estimate:
    """A mean with its confidence interval: ``mean`` in ``[low, high]`` over ``n`` samples.

    ``method`` is ``"wilson"`` or ``"bootstrap"``."""

    mean: float
    low: float
    high: float
    n: int
    method: str


@dataclass(frozen=True)
class Difference:
    """A paired difference ``mean(a - b)`` with its bootstrap CI over ``n`` paired samples."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def significant(self) -> bool:
        """Whether the CI excludes 0 (a zero-width CI at 0 is not significant)."""
        return self.low > 0.0 or self.high < 0.0


def _check_confidence(confidence: float) -> float:
    if not isinstance(confidence, (int, float)) or not 0.0 < float(confidence) < 1.0:
        raise LonglabError(f"confidence must be a number in (0, 1), got {confidence!r}")
    return float(confidence)


def _z(confidence: float) -> float:
    return NormalDist().inv_cdf(0.5 + _check_confidence(confidence) / 2.0)


def wilson_interval(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes out of ``n`` (see the module docstring).

    ``k = 0`` gives a lower end of exactly 0 and ``k = n`` an upper end of exactly 1."""
    if isinstance(k, bool) or isinstance(n, bool) or int(k) != k or int(n) != n:
        raise LonglabError(f"wilson_interval: k and n must be integers, got k={k!r}, n={n!r}")
    k, n = int(k), int(n)
    if n <= 0 or not 0 <= k <= n:
        raise LonglabError(f"wilson_interval: need n >= 1 and 0 <= k <= n, got k={k}, n={n}")
    z = _z(confidence)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2.0 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n))
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return low, high


def is_binary(values: Sequence[float]) -> bool:
    """Whether every value is 0 or 1 (a pass/fail score)."""
    return all(v == 0.0 or v == 1.0 for v in values)


def _strata(strata: Sequence[Sequence[float]]) -> list[np.ndarray]:
    arrays = [np.asarray(s, dtype=np.float64).reshape(-1) for s in strata]
    if not arrays or any(a.size == 0 for a in arrays):
        raise LonglabError("bootstrap: every stratum needs at least one value")
    if any(not np.isfinite(a).all() for a in arrays):
        raise LonglabError("bootstrap: values must be finite (no NaN or inf)")
    return arrays


def _weights(weights: Sequence[float] | None, count: int) -> np.ndarray:
    if weights is None:
        return np.full(count, 1.0 / count)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != count or not np.isfinite(w).all() or (w < 0).any():
        raise LonglabError(f"bootstrap: need {count} finite non-negative weights, got {list(weights)!r}")
    return w


def bootstrap_ci(
    strata: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """``(θ, low, high)``: the weighted mean of stratum means ``θ = Σ_s w_s mean(x_s)`` and its
    seeded percentile-bootstrap CI, resampling inside each stratum (default weights ``1/S``).

    ``strata``: S sequences of values (one per stratum, each non-empty)."""
    arrays = _strata(strata)
    w = _weights(weights, len(arrays))
    alpha = 1.0 - _check_confidence(confidence)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise LonglabError(f"bootstrap: resamples must be a positive integer, got {resamples!r}")
    point = float(sum(wi * a.mean() for wi, a in zip(w, arrays)))
    rng = np.random.default_rng(seed)
    stats = np.zeros(resamples)  # [R]
    for wi, a in zip(w, arrays):
        # A resample of n_s values drawn with replacement is, in distribution, a multinomial count of
        # the distinct values (binomial for two): O(R x distinct) instead of O(R x n_s) per stratum.
        values, counts = np.unique(a, return_counts=True)
        n = a.size
        if values.size == 1:  # constant stratum: every resample has the same mean
            stats += wi * values[0]
        elif values.size == 2:
            ones = rng.binomial(n, counts[1] / n, size=resamples)  # [R] draws of the larger value
            stats += wi * (values[0] + (values[1] - values[0]) * ones / n)
        else:
            step = max(1, _MAX_DRAWS // values.size)
            for start in range(0, resamples, step):
                stop = min(resamples, start + step)
                draws = rng.multinomial(n, counts / n, size=stop - start)  # [r, distinct]
                stats[start:stop] += wi * (draws @ values) / n
    low, high = np.quantile(stats, [alpha / 2.0, 1.0 - alpha / 2.0])
    # the quantiles of a constant vector are that constant: keep them exact (no rounding drift)
    if stats.min() == stats.max():
        low = high = stats[0]
    return point, float(low), float(high)


def score_estimate(
    values: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED
) -> Estimate:
    """Mean of ``values`` with a CI: Wilson when every value is 0 or 1, else a percentile bootstrap."""
    vals = [float(v) for v in values]
    if not vals:
        raise LonglabError("score_estimate: no values")
    if is_binary(vals):
        k = int(sum(vals))
        low, high = wilson_interval(k, len(vals), confidence)
        return Estimate(k / len(vals), low, high, len(vals), "wilson")
    mean, low, high = bootstrap_ci([vals], confidence=confidence, resamples=resamples, seed=seed)
    return Estimate(mean, low, high, len(vals), "bootstrap")


def stratified_estimate(
    strata: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Estimate:
    """Weighted mean of stratum means (e.g. the average over tasks) with its stratified bootstrap CI;
    one stratum is :func:`score_estimate` (Wilson when pass/fail)."""
    if len(strata) == 1 and (weights is None or float(np.asarray(weights).reshape(-1)[0]) == 1.0):
        return score_estimate(strata[0], confidence=confidence, resamples=resamples, seed=seed)
    mean, low, high = bootstrap_ci(strata, weights, confidence=confidence, resamples=resamples, seed=seed)
    return Estimate(mean, low, high, sum(len(s) for s in strata), "bootstrap")


def stratified_difference(
    pairs: Sequence[tuple[Sequence[float], Sequence[float]]],
    weights: Sequence[float] | None = None,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Difference:
    """Paired bootstrap of ``Σ_s w_s mean(a_s - b_s)``: each stratum ``s`` holds two equally long
    score lists of the same samples (``a_s[i]`` and ``b_s[i]`` scored on sample ``i``)."""
    diffs = []
    for a, b in pairs:
        if len(a) != len(b):
            raise LonglabError(f"paired bootstrap: the score lists differ in length ({len(a)} vs {len(b)})")
        diffs.append([float(x) - float(y) for x, y in zip(a, b)])
    mean, low, high = bootstrap_ci(diffs, weights, confidence=confidence, resamples=resamples, seed=seed)
    return Difference(mean, low, high, sum(len(d) for d in diffs))


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Difference:
    """Paired bootstrap of ``mean(a - b)``; ``a[i]`` and ``b[i]``: two recipes' scores on sample ``i``."""
    return stratified_difference([(a, b)], confidence=confidence, resamples=resamples, seed=seed)
