"""Confidence intervals of longlab.eval.stats against hand-computed and reference values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from longlab.eval.stats import (
    bootstrap_ci,
    is_binary,
    paired_difference,
    score_estimate,
    stratified_difference,
    stratified_estimate,
    wilson_interval,
)
from longlab.recipe import LonglabError

Z = 1.959963984540054  # two-sided 95% normal quantile


def _wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    p = k / n
    centre = (k + Z * Z / 2) / (n + Z * Z)
    half = Z * math.sqrt(n * p * (1 - p) + Z * Z / 4) / (n + Z * Z)
    return centre - half, centre + half


def test_wilson_known_values() -> None:
    # k = 0: [0, z^2 / (n + z^2)] = [0, 3.8415 / 13.8415]
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(Z * Z / (10 + Z * Z), abs=1e-12)
    assert high == pytest.approx(0.2775, abs=5e-5)
    # k = 5 of 10: symmetric about 0.5; the usual tables give [0.2366, 0.7634]
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.23659, 0.76341), abs=5e-5)
    assert low + high == pytest.approx(1.0, abs=1e-12)
    # k = n mirrors k = 0
    assert wilson_interval(10, 10) == pytest.approx((1 - Z * Z / (10 + Z * Z), 1.0), abs=1e-12)
    assert wilson_interval(10, 10)[1] == 1.0
    for k, n in ((1, 2), (3, 7), (22, 24), (1, 1)):
        assert wilson_interval(k, n) == pytest.approx(_wilson_by_hand(k, n), abs=1e-12)
    # 99% is wider than 95%
    lo99, hi99 = wilson_interval(5, 10, confidence=0.99)
    assert lo99 < 0.23659 and hi99 > 0.76341


def test_wilson_agrees_with_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for k, n in ((0, 10), (5, 10), (17, 24), (24, 24)):
        ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)


@pytest.mark.parametrize("k, n", [(-1, 10), (11, 10), (0, 0), (1.5, 3)])
def test_wilson_rejects_bad_counts(k: float, n: int) -> None:
    with pytest.raises(LonglabError, match="wilson_interval"):
        wilson_interval(k, n)  # type: ignore[arg-type]


def test_paired_bootstrap_identical_lists_zero_width_not_significant() -> None:
    a = [1.0, 0.0, 0.5, 0.25, 1.0, 0.0]
    d = paired_difference(a, list(a))
    assert (d.mean, d.low, d.high, d.n) == (0.0, 0.0, 0.0, 6)
    assert not d.significant


def test_paired_bootstrap_clearly_better_is_significant() -> None:
    better = [1.0] * 22 + [0.0] * 2
    base = [0.0] * 22 + [1.0] * 2
    d = paired_difference(better, base)
    assert d.mean == pytest.approx(20 / 24) and d.significant and d.low > 0.5 and d.high <= 1.0
    worse = paired_difference(base, better)
    assert worse.significant and worse.high < -0.5
    # a small difference on few samples is not significant
    assert not paired_difference([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]).significant


def test_pairing_removes_sample_difficulty() -> None:
    # every sample is 0.1 better under a; sample difficulty varies a lot. Unpaired intervals overlap,
    # the paired difference is exactly +0.1 on every resample.
    base = [0.05, 0.3, 0.5, 0.7, 0.85, 0.1, 0.6, 0.4]
    a = [x + 0.1 for x in base]
    d = paired_difference(a, base)
    assert d.low == pytest.approx(0.1) and d.high == pytest.approx(0.1) and d.significant
    ea, eb = score_estimate(a), score_estimate(base)
    assert ea.low < eb.high  # the two cells' own intervals overlap


def test_bootstrap_matches_reference_percentile_bootstrap() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = rng.uniform(0.0, 1.0, size=30)
    mean, low, high = bootstrap_ci([x])
    ref = stats.bootstrap((x,), np.mean, n_resamples=10_000, method="percentile", random_state=3)
    assert mean == pytest.approx(float(x.mean()))
    ci = ref.confidence_interval
    assert low == pytest.approx(ci.low, abs=0.015) and high == pytest.approx(ci.high, abs=0.015)
    # close to the normal approximation mean ± z sd / sqrt(n) as well
    se = x.std() / math.sqrt(x.size)
    assert (high - low) / 2 == pytest.approx(Z * se, rel=0.1)
    # seeded: the same call gives the same interval, another seed a slightly different one
    assert bootstrap_ci([x]) == (mean, low, high)
    assert bootstrap_ci([x], seed=7) != (mean, low, high)


def test_score_estimate_picks_wilson_for_pass_fail() -> None:
    est = score_estimate([1, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    assert est.method == "wilson" and est.mean == 0.6 and est.n == 10
    assert (est.low, est.high) == wilson_interval(6, 10)
    graded = score_estimate([1.0, 0.5, 0.0, 1.0])
    assert graded.method == "bootstrap" and graded.mean == 0.625 and graded.low < 0.625 < graded.high
    assert is_binary([0.0, 1.0, 1]) and not is_binary([0.0, 0.5])
    with pytest.raises(LonglabError):
        score_estimate([])


def test_stratified_estimate_and_difference_hand_cases() -> None:
    # two strata, each resample mean of a = [0, 1] is 0, 0.5 or 1 (1/4, 1/2, 1/4); b is constant 1:
    # the average takes 0.5, 0.75, 1 -> 95% percentile CI [0.5, 1.0]
    est = stratified_estimate([[0.0, 1.0], [1.0, 1.0]])
    assert (est.mean, est.low, est.high, est.n, est.method) == (0.75, 0.5, 1.0, 4, "bootstrap")
    # one stratum with pass/fail scores is the Wilson cell
    assert stratified_estimate([[0.0, 1.0]]).method == "wilson"
    # weights: 3/4 on a stratum with difference +1 everywhere, 1/4 on one with 0
    d = stratified_difference([([1, 1], [0, 0]), ([0, 1], [0, 1])], weights=[0.75, 0.25])
    assert (d.mean, d.low, d.high, d.n) == (0.75, 0.75, 0.75, 4) and d.significant
    with pytest.raises(LonglabError, match="differ in length"):
        paired_difference([1.0, 0.0], [1.0])
    with pytest.raises(LonglabError, match="finite"):
        bootstrap_ci([[1.0, float("nan")]])
    with pytest.raises(LonglabError, match="confidence"):
        bootstrap_ci([[1.0]], confidence=1.5)

