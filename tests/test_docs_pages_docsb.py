"""Page generators of attention-bench, layers-lab and models: their statistics on hand-made rows (each
check fails if the rule is inverted) and the drift check of the pages against the committed data."""

from __future__ import annotations

from pathlib import Path

import pytest

from longlab.eval.docs_tables import check_docs
from longlab.eval.pages import attention_bench as ab
from longlab.eval.pages import layers_lab as ll

ROOT = Path(__file__).resolve().parents[1]


def test_median_interval_order_statistics() -> None:
    # n = 9: k = 2 is the largest with coverage >= 95% (1 - 2 * 10/512 = 0.961); k = 3 gives 0.82
    lo, hi, cov = ab.median_interval([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0])
    assert (lo, hi) == (2.0, 8.0) and cov == pytest.approx(1 - 2 * 10 / 512)
    # n = 5: no k reaches 95%, so [min, max] with its own coverage 1 - 2/32
    lo, hi, cov = ab.median_interval([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (lo, hi) == (1.0, 5.0) and cov == pytest.approx(0.9375)


def test_sign_test_and_goal_status() -> None:
    assert ab.sign_test(6, 6) == pytest.approx(2 / 64)  # 6 of 6 one way: p = 0.031
    assert ab.sign_test(0, 6) == pytest.approx(2 / 64)  # symmetric
    assert ab.sign_test(3, 6) == 1.0
    assert ab.goal_status(0.95, 0.85, 1.0) == "firm"
    assert ab.goal_status(0.85, 0.79, 0.90) == "met"  # median above the goal, interval reaches below
    assert ab.goal_status(0.75, 0.70, 0.85) == "missed"  # median below 0.8: missed


def _seeds(means: list[float], n: int = 8) -> dict[int, dict[str, float]]:
    """Per seed, n test scores around the seed's mean (the same sample ids for every seed)."""
    return {s: {str(i): m + (0.01 if i % 2 else -0.01) for i in range(n)} for s, m in enumerate(means)}


def test_seed_difference_sign_and_verdict() -> None:
    hi, lo = _seeds([0.9, 0.92, 0.88]), _seeds([0.3, 0.32, 0.28])
    d = ll.seed_difference(hi, lo)
    assert d.delta == pytest.approx(0.6) and d.welch is not None and d.welch[0] > 0 and d.paired[0] > 0
    assert d.verdict == "significant"
    inv = ll.seed_difference(lo, hi)  # A and B swapped: the difference flips sign, still significant
    assert inv.delta == pytest.approx(-0.6) and inv.welch is not None and inv.welch[1] < 0
    assert inv.verdict == "significant"
    # seed means that straddle: the Welch interval over seeds contains 0, so not significant even though
    # the paired bootstrap over test sequences (which ignores the seed spread) excludes it
    wide = ll.seed_difference(_seeds([0.9, 0.2, 0.6]), _seeds([0.5, 0.45, 0.55]))
    assert wide.welch is not None and wide.welch[0] < 0 < wide.welch[1] and wide.paired[0] > 0
    assert wide.verdict == "not significant"
    one = ll.seed_difference(_seeds([0.9]), _seeds([0.3]))
    assert one.welch is None and one.verdict == "test sequences only (one seed a side): significant"


@pytest.mark.parametrize("page", ["attention-bench", "models"])
def test_docsb_pages_match_their_data(page: str) -> None:
    assert check_docs(ROOT, page=page) == []


@pytest.mark.slow
@pytest.mark.parametrize("page", ["layers-lab"])
def test_docsb_slow_pages_match_their_data(page: str) -> None:
    """Pages whose generators load the lab stores and bootstrap every difference (~15-40 s)."""
    assert check_docs(ROOT, page=page) == []


def test_unpaired_difference_fisher_and_bootstrap() -> None:
    from longlab.eval.pages import models

    d = models.unpaired_difference([1.0] * 6, [0.0] * 6)  # 6/6 against 0/6: Fisher p = 2/924
    assert d.mean == 1.0 and d.p == pytest.approx(2 / 924) and d.significant
    inv = models.unpaired_difference([0.0] * 6, [1.0] * 6)
    assert inv.mean == -1.0 and inv.significant and inv.high <= 0
    half = models.unpaired_difference([1.0] * 6, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # 6/6 against 3/6
    assert half.p == pytest.approx(0.1818, abs=1e-3) and not half.significant
    graded = models.unpaired_difference([0.8, 0.9, 0.7, 0.8, 0.9, 0.8], [0.2, 0.3, 0.4, 0.3, 0.2, 0.4])
    assert graded.p is None and graded.low > 0 and graded.significant
    flat = models.unpaired_difference([0.5, 0.7, 0.3, 0.6], [0.6, 0.4, 0.5, 0.7])
    assert flat.low < 0 < flat.high and not flat.significant
