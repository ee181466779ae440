"""Verdict rules of the rag-reuse and spec-decode page generators on hand-made rows (each fails when the
comparison is inverted)."""

from __future__ import annotations

import math

from longlab.eval.pages import rag_reuse
from longlab.eval.stats import Difference, paired_difference


def _d(mean: float, low: float, high: float) -> Difference:
    return Difference(mean, low, high, 10)


def test_share_of_full_bisection_equals_the_grid() -> None:
    """The bisected interval is the set of grid points the paired test does not reject (brute force)."""
    full = [1.0] * 14 + [0.0] * 6
    scores = [1.0] * 9 + [0.0] * 5 + [1.0] * 2 + [0.0] * 4
    point, low, high = rag_reuse.share_of_full(scores, full)
    kept = [
        i * 0.01
        for i in range(301)
        if not paired_difference(scores, [i * 0.01 * f for f in full]).significant
    ]
    assert point == sum(scores) / sum(full)
    assert (round(low, 2), round(high, 2)) == (round(min(kept), 2), round(max(kept), 2))
    assert low < point < high
    assert rag_reuse.share_of_full(scores, [0.0] * 20) == (None, 0.0, float("inf"))


def test_ratio_interval_is_a_geometric_mean_with_a_t_interval() -> None:
    g, lo, hi = rag_reuse.ratio_interval([2.0, 2.0, 2.0])
    assert math.isclose(g, 2.0) and math.isclose(lo, 2.0) and math.isclose(hi, 2.0)
    g, lo, hi = rag_reuse.ratio_interval([1.0, 4.0])
    assert math.isclose(g, 2.0) and lo < 1.0 < 4.0 < hi  # t(0.975, 1) = 12.7: very wide with two rounds
    g, lo, hi = rag_reuse.ratio_interval([3.0])
    assert math.isclose(g, 3.0) and math.isnan(lo)


def test_ttft_verdict() -> None:
    inside = (3.0, 2.7, 3.3)
    assert rag_reuse.ttft_verdict([inside, (2.5, 2.3, 2.8)], 2.2, 3.3) == rag_reuse.REPRODUCES
    assert (
        rag_reuse.ttft_verdict([inside, (1.5, 1.2, 1.8)], 2.2, 3.3) == "direction reproduces, size does not"
    )
    assert rag_reuse.ttft_verdict([inside, (0.5, 0.4, 0.6)], 2.2, 3.3) == rag_reuse.FAILS  # slower
    assert rag_reuse.ttft_verdict([inside, (2.5, 0.9, 4.0)], 2.2, 3.3) == rag_reuse.NOT_SIG
    assert rag_reuse.ttft_verdict([(2.5, float("nan"), float("nan"))], 2.2, 3.3) == rag_reuse.NOT_SIG


def test_prophet_claim_and_beats_verdicts() -> None:
    assert rag_reuse.prophet_claim_verdict(_d(-0.14, -0.25, -0.03)) == rag_reuse.FAILS
    assert rag_reuse.prophet_claim_verdict(_d(-0.13, -0.30, 0.04)) == rag_reuse.NOT_SIG
    assert rag_reuse.prophet_claim_verdict(_d(0.02, -0.05, 0.09)) == rag_reuse.REPRODUCES
    up, down, zero = _d(0.17, 0.05, 0.28), _d(-0.17, -0.28, -0.05), _d(0.02, -0.05, 0.09)
    assert rag_reuse.beats_verdict([up, up]) == rag_reuse.REPRODUCES
    assert rag_reuse.beats_verdict([up, down]) == rag_reuse.FAILS
    assert rag_reuse.beats_verdict([down, down]) == rag_reuse.FAILS
    assert rag_reuse.beats_verdict([up, zero]) == rag_reuse.NOT_SIG


def test_summarize_pairs_on_the_same_samples() -> None:
    """Hand-made rows: prophetkv answers 14/20, cacheblend and epic 4/20 on the same samples; the pair is
    positive (the reversed pair would be negative), and 70% of full is significantly below 96%."""

    def row(label: str, i: int, s: float) -> dict:
        extra = {"fidelity": 0.9 if s else 0.7, "recompute_fraction": 0.2, "cost_fraction": 0.3}
        return {"recipe": label, "sample_id": f"s{i}", "score": s, "extra": extra}

    rows = []
    for i in range(20):
        rows += [
            row("full", i, 1.0),
            row("prophetkv@0.2", i, float(i < 14)),
            row("cacheblend@0.2", i, float(i < 4)),
        ]
        rows.append(row("epic@0.2", i, float(i < 4)))
    s = rag_reuse.summarize(rows, "tiny")
    assert s is not None and s.n == 20
    d, _ = s.pairs[("prophetkv", "cacheblend", "0.2")]
    assert math.isclose(d.mean, 0.5) and d.low > 0
    assert s.row("prophetkv@0.2")["k"] == 14 and s.row("cacheblend@0.2")["k"] == 4
    cl = rag_reuse.claims({"smollm2": s}, None)
    beats = next(c for c in cl if c.claim.startswith("ProphetKV beats"))
    assert beats.verdict == rag_reuse.REPRODUCES
    keep = next(c for c in cl if "96–101%" in c.claim)
    assert keep.verdict == rag_reuse.FAILS  # 70% of full, significantly below 96%


def test_spec_decode_verdict_rules() -> None:
    from longlab.eval.pages import spec_decode as sd

    assert sd.lossless_verdict(86, 86) == sd.REPRODUCES
    assert sd.lossless_verdict(85, 86) == sd.FAILS
    assert sd.speed_verdict((1.46, 1.16, 1.85)) == sd.REPRODUCES
    assert sd.speed_verdict((0.41, 0.34, 0.47)) == sd.FAILS  # slower than plain
    assert sd.speed_verdict((1.02, 0.83, 1.27)) == sd.NOT_SIG
    fewer, more = _d(-0.29, -0.37, -0.22), _d(0.29, 0.22, 0.37)
    assert sd.sparse_verify_verdict(fewer, _d(0.12, 0.05, 0.19)) == sd.REPRODUCES
    assert sd.sparse_verify_verdict(fewer, _d(-0.02, -0.05, 0.01)) == sd.REPRODUCES  # acceptance n.s.
    assert sd.sparse_verify_verdict(more, _d(0.12, 0.05, 0.19)) == sd.FAILS  # reads more bytes
    assert sd.sparse_verify_verdict(fewer, _d(-0.12, -0.19, -0.05)) == sd.FAILS  # acceptance drops
    assert sd.ddiff_verdict(_d(-0.1, -0.2, -0.01)) == sd.FAILS
    assert sd.ddiff_verdict(_d(0.0, -0.1, 0.1)) == sd.NOT_SIG
    pages, agree, acc = _d(-17.5, -18.6, -16.5), _d(-0.15, -0.23, -0.04), _d(-0.33, -0.67, 0.0)
    assert (
        sd.losa_verdict({"pages_per_layer_step": pages, "token_agreement": agree, "score": acc}) == sd.FAILS
    )
    fine = _d(0.0, -0.05, 0.05)
    assert sd.losa_verdict({"pages_per_layer_step": pages, "token_agreement": fine, "score": fine}) == (
        sd.REPRODUCES
    )
    more_pages = _d(17.5, 16.5, 18.6)
    assert sd.losa_verdict({"pages_per_layer_step": more_pages, "token_agreement": fine, "score": fine}) == (
        sd.FAILS
    )


def test_spec_decode_grid_commands_and_dustin_budget() -> None:
    from longlab.eval.pages import spec_decode as sd

    def row(task: str, length: int, i: int, spec: str = "plain") -> dict:
        return {"task": task, "length": length, "sample_id": f"{task}-{i}", "extra": {"spec": spec}}

    rows = [row("passkey", 1024, i) for i in range(8)] + [row("vt", 1024, i) for i in range(8)]
    rows += [row("passkey", 4096, i) for i in range(6)] + [row("summ_events", 4096, i) for i in range(4)]
    rows.append(row("passkey", 4096, 0, "lookup;full;gamma=10"))  # not a plain row: not counted
    cmds = sd.grid_commands(rows)
    assert cmds[1024] == [
        "bench/heavy.sh longlab eval --config bench/configs/spec-eval.toml --lengths 1024 --samples 8 "
        "--tasks passkey,vt"
    ]
    assert [c.split("--samples ")[1] for c in cmds[4096]] == ["6 --tasks passkey", "4 --tasks summ_events"]
    assert sd.dustin_budget({"recipe_repr": "SpecConfig(verifier=Dustin(budget=1024, page_size=32))"}) == 1024
    assert sd.dustin_budget({"recipe_repr": "SpecConfig(verifier=FullVerifier())"}) is None


def _speed_run(tmp, name: str, cpu: str, kivi_ms: float, full_ms: float) -> None:
    import json

    rows = [{"length": 32768, "batch": 1, "variant": v, "ms_per_token": ms, "cpu_ms_per_token": ms,
             "ratio_to_full": ms / full_ms, "cpu_ratio_to_full": ms / full_ms, "kv_bytes": 2**20,
             "ratios_to_full_by_round": [ms / full_ms], "uptime": ["load average: 1.0", "load average: 1.0"]}
            for v, ms in (("full", full_ms), ("kivi4", kivi_ms))]
    hw = {"cpu_family_model": cpu, "aten_capability": "AVX2", "git_commit": name}
    (tmp / f"decode_speed_fused_{name}.json").write_text(json.dumps({"hardware": hw, "rows": rows}))


def test_decode_speed_targets_keep_each_run_apart(tmp_path) -> None:
    """Two runs of the same target are two rows, each with its own ratio and verdict (a run that meets it
    does not hide one that does not), and llama.cpp's comparison takes the run of its own CPU."""
    from longlab.eval.pages import decode_speed

    _speed_run(tmp_path, "a", "23/1", kivi_ms=65.0, full_ms=100.0)
    _speed_run(tmp_path, "b", "25/17", kivi_ms=50.0, full_ms=100.0)
    e2e = decode_speed._load_e2e(tmp_path)
    rows = [r for r in decode_speed.targets(e2e) if r.startswith("| 32k, batch 1: kivi4 <= 0.6")]
    assert len(rows) == 2
    assert "`decode_speed_fused_a.json` | 0.65 [0.65, 0.65] | no" in rows[0]
    assert "`decode_speed_fused_b.json` | 0.50 [0.50, 0.50] | yes" in rows[1]
    assert sum(t.startswith("**32,768 tokens, batch 1**") for t in decode_speed.e2e_tables(e2e)) == 2
    llama = {"llama_cpp_python": "x", "gguf": "g", "threads": 1, "hardware": {"cpu_family_model": "25/17"},
             "rows": [{"length": 32768, "kv_type": "f16", "prefill_tokens_per_s": 1.0,
                       "decode_ms_per_token": 9.0}]}
    line = decode_speed.llama_table(llama, e2e)[4]
    assert "| 100.0 | 50.0 | `decode_speed_fused_b.json` |" in line


def test_decode_speed_profile_table_orders_by_time_and_states_shares() -> None:
    """The profile table (``speed --profile``) lists each variant's named functions by cumulative time,
    the largest first, with their share of the profiled step."""
    from longlab.eval.pages import decode_speed

    data = {"hardware": {"cpu_family_model": "25/17", "aten_capability": "AVX512", "git_commit": "abc"},
            "args": {"threads": 1, "steps": 8, "rounds": 3},
            "profiles": [{"length": 32768, "variant": "quest:budget=4096", "ms_per_token": 150.0,
                          "profiled_ms_per_token": 200.0,
                          "named": {"paged kernel": {"calls_per_step": 28, "cum_ms_per_step": 20.0},
                                    "linear (weights)": {"calls_per_step": 211, "cum_ms_per_step": 100.0}}}]}
    lines = decode_speed.profile_table(data)
    body = [x for x in lines if x.startswith("| 32,768") or x.startswith("| | ")]
    assert body[0] == ("| 32,768 | `quest:budget=4096` | 150.0 | 200.0 | linear (weights) | 211 | 100.00 "
                       "| 50% |")
    assert body[1] == "| | | | | paged kernel | 28 | 20.00 | 10% |"
