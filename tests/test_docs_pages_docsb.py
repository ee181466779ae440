"""Page generators of attention-bench, layers-lab and models: their statistics on hand-made rows (each
check fails if the rule is inverted) and the drift check of the pages against the committed data."""

from __future__ import annotations

from pathlib import Path

import pytest

from longlab.eval.docs_tables import check_docs
from longlab.eval.pages import attention_bench as ab

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
    assert ab.goal_status(0.75, 0.70, 0.85) == "missed"  # median below: not met even if the interval reaches 0.8


@pytest.mark.parametrize("page", ["attention-bench"])
def test_docsb_pages_match_their_data(page: str) -> None:
    assert check_docs(ROOT, page=page) == []
