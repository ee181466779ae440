"""Verdict rules of the kv-eviction / kv-quant / sparse-prefill page generators on hand-made rows (each
check fails if the comparison were inverted)."""

from __future__ import annotations

import math

import pytest

from longlab.eval.pages.kv_eviction import claim_verdict, parse_report_table
from longlab.eval.pages.paired import call, fmt_ci, log_ratio_interval, sign_test


def test_sign_test_exact_values() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(0, 4) == pytest.approx(2 / 16)  # 2 · (1/2)^4
    assert sign_test(6, 0) == pytest.approx(2 / 64)
    assert sign_test(1, 7) == pytest.approx(2 * (1 + 8) / 256)
    assert sign_test(3, 3) == 1.0
    with pytest.raises(ValueError, match="counts must be >= 0"):
        sign_test(-1, 2)


def test_call_direction_and_sign_test() -> None:
    assert call(0.5, 2.0) == "significantly better"
    assert call(-2.0, -0.5) == "significantly worse"
    assert call(-1.0, 1.0) == "not significant"
    assert call(0.0, 0.0) == "not significant"  # identical scores: zero-width interval
    assert call(-3.0, 0.0) == "not significant"  # an end at 0 does not exclude it
    assert call(-25.8, -4.2, 0.125).startswith("a lean (worse)")
    assert call(4.2, 25.8, 0.125).startswith("a lean (better)")
    assert call(-25.8, -4.2, 0.031) == "significantly worse"
    with pytest.raises(ValueError):
        call(1.0, -1.0)


def test_claim_verdict_over_ratios() -> None:
    def row(lo: float, hi: float, p: float) -> dict:
        return {"diff": [(lo + hi) / 2, lo, hi], "sign_test_p": p}

    assert claim_verdict([row(-1, 1, 1.0), row(2, 9, 0.01)]) == "reproduces"
    assert claim_verdict([row(2, 9, 0.01), row(-9, -2, 0.01)]) == "does not reproduce"
    assert claim_verdict([row(-1, 1, 1.0), row(-9, -2, 0.2)]) == "not shown; leans against"
    assert claim_verdict([row(-1, 1, 1.0), row(2, 9, 0.2)]) == "not shown; leans for"
    assert claim_verdict([row(-1, 1, 1.0)]).startswith("not shown (not significant")
    # a claimed gain above every interval: does not reproduce; inside one interval: not shown
    assert claim_verdict([row(-5, 4, 1.0), row(-3, 12, 1.0)], claimed=15.2).startswith("does not reproduce")
    assert claim_verdict([row(-5, 4, 1.0), row(-3, 20, 1.0)], claimed=15.2).startswith("not shown")


def test_log_ratio_interval_and_fmt() -> None:
    g, lo, hi = log_ratio_interval([0.8, 0.9, 0.85, 0.82])
    assert lo < g < hi < 1  # every round faster: the interval lies below 1
    g, lo, hi = log_ratio_interval([1.5, 1.6, 1.55])
    assert 1 < lo < g < hi  # every round slower: the interval lies above 1
    assert g == pytest.approx((1.5 * 1.6 * 1.55) ** (1 / 3))
    _, lo, hi = log_ratio_interval([0.7, 1.4, 1.0])
    assert lo < 1 < hi  # mixed rounds: not significant
    assert math.isnan(log_ratio_interval([2.0])[1])
    with pytest.raises(ValueError):
        log_ratio_interval([1.0, 0.0])
    assert fmt_ci(-0.01, -5.0, 2.0, sign=True) == "0.0 [−5.0, +2.0]"


def test_parse_report_table() -> None:
    text = "# r\n\n### model · length 2k · score ×100 [95% CI]\n\n| recipe | a | avg |\n|---|---:|---:|\n" \
           "| full | 1.0 | 2.0 |\n| x | 3.0 | 4.0 |\n\nafter\n| other | table |\n"
    rows = parse_report_table(text, "### model · length 2k")
    assert rows == [{"recipe": "full", "a": "1.0", "avg": "2.0"}, {"recipe": "x", "a": "3.0", "avg": "4.0"}]
    with pytest.raises(ValueError, match="no heading"):
        parse_report_table(text, "### nope")


def test_kv_quant_compare_is_method_minus_baseline() -> None:
    from longlab.eval.pages.kv_quant import compare, short_recipe

    def rows(scores: list[float]) -> dict:
        return {f"s{i}": {"score": x} for i, x in enumerate(scores)}

    data = {"base": rows([0, 0, 0, 1, 1, 1]), "meth": rows([1, 1, 1, 1, 1, 1])}
    c = compare(data, "base", "meth")
    assert c["diff"][0] == pytest.approx(50.0) and c["diff"][1] > 0  # method − baseline, ×100
    assert (c["better"], c["worse"], c["n"]) == (3, 0, 6)
    assert c["sign_test_p"] == pytest.approx(0.25)
    assert compare(data, "meth", "base")["diff"][0] == pytest.approx(-50.0)
    assert short_recipe("pmkvq:allocation=runs/x/a.json") == "pmkvq:allocation"
    assert short_recipe("pmkvq:budget_mb=11.71") == "pmkvq:budget_mb=11.71"


def test_sparse_prefill_parsers_and_goal() -> None:
    from longlab.eval.pages.sparse_prefill import goal_rows, parse_diff, speed_call

    assert parse_diff("+6.2 [+0.0, +18.8] (n=7) n.s.") == (6.2, 0.0, 18.8, 7)
    assert parse_diff("-49.2 [-60.8, -39.2]") == (-49.2, -60.8, -39.2, None)
    assert parse_diff("-") is None
    assert speed_call(0.68, 0.77) == "faster" and speed_call(1.05, 1.2) == "slower"
    assert speed_call(0.9, 1.1) == "not significant"
    rows = [
        {"T": 32768, "method": "dense-sdpa", "speedup": 1.0, "recall": 1.0},
        {"T": 32768, "method": "a", "speedup": 3.6, "recall": 0.61},  # fast, low recall
        {"T": 32768, "method": "b", "speedup": 1.1, "recall": 0.96},  # recall, not fast
        {"T": 16384, "method": "c", "speedup": 2.5, "recall": 0.97},  # meets it, but not at the top length
    ]
    assert goal_rows(rows) == []
    rows.append({"T": 32768, "method": "d", "speedup": 2.1, "recall": 0.95})
    assert [r["method"] for r in goal_rows(rows)] == ["d"]
