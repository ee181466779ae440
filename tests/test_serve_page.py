"""The serve-load page generator (:mod:`longlab.eval.pages.serve_load`): the compute bound and the budget
ratios by hand on made-up results."""

from __future__ import annotations

import pytest

from longlab.eval.pages import serve_load


def _profile() -> dict:
    # 4 requests one at a time: 16 s of prefill (P = 4 s), 60 tokens of which 56 decoded in 5.6 s (d_1 = 0.1)
    return {
        "one_at_a_time": {"requests": 4, "prefill_s": 16.0, "decode_s": 5.6, "generated_tokens": 60},
        "batched": {"requests": 8, "admissions_s": [4.0] * 8, "decode_s": 3.0, "decode_steps": 20,
                    "decode_by_rows": {"2": {"steps": 20, "step_median_s": 0.15, "per_row_s": 0.075,
                                             "forward_median_s": 0.14}}},
        "admit_all_then_decode": {"requests": 8, "admissions_s": [4.0] * 8, "generated_tokens": 120,
                                  "decode_by_rows": {
                                      "1": {"steps": 2, "step_median_s": 0.1, "per_row_s": 0.1},
                                      "8": {"steps": 10, "step_median_s": 0.16, "per_row_s": 0.02}}},
    }


def test_compute_bound_by_hand():
    c = serve_load.compute_bound(_profile())
    assert c["P"] == 4.0 and c["T"] == 15.0 and c["d1"] == pytest.approx(0.1) and c["B"] == 8
    assert c["bound_at_B"] == pytest.approx((4 + 15 * 0.1) / (4 + 15 * 0.02))  # 1.279
    assert c["bound_free_decode"] == pytest.approx(1 + 15 * 0.1 / 4)  # 1.375
    assert serve_load.compute_bound(_profile(), rows=1)["bound_at_B"] == pytest.approx(1.0)  # no batching
    assert "**1.28x**" in serve_load.profile_table(_profile())


def test_budget_ratios_by_hand():
    mib = 2**20
    rows = [
        {"recipe": "full", "budget_bytes": 200 * mib, "requests": 12, "peak_running": 3,
         "peak_kv_bytes": 180 * mib, "tokens_per_s": 1.0, "kv_bytes_after_median": {"full": 50 * mib}},
        {"recipe": "snapkv@0.5", "budget_bytes": 200 * mib, "requests": 12, "peak_running": 6,
         "peak_kv_bytes": 162 * mib, "tokens_per_s": 1.0, "kv_bytes_after_median": {"snapkv@0.5": 26 * mib}},
    ]
    text = serve_load.budget_table(rows)
    assert "cache after prefill: **0.52**" in text  # 26 / 50
    assert "per running row at the peak: **0.45**" in text  # (162 / 6) / (180 / 3) = 27 / 60
    assert "**6 vs 3** (2.00x)" in text
