"""The accuracy sweeps that were bench scripts with sample loops of their own, now ``longlab eval`` configs
(issue 30, item 4), each run on a tiny random model through the one driver:

* ``bench/configs/compression-inftythink.toml`` (was ``bench/compression.py inftythink``): the task
  ``lookup_chain_reason``, rows carrying the counters the page's InftyThink table reads
  (:func:`longlab.eval.pages.compression.inftythink_rows`);
* ``bench/configs/indexmem-fidelity.toml`` (was ``bench/kv.py indexmem-fidelity``): teacher-forced rows with
  top-1 agreement and KL against the full cache (:func:`longlab.eval.runner.forced_kl`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from longlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "bench" / "configs"
pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(out: Path) -> list[dict]:
    from longlab.eval.store import ResultStore

    with ResultStore(str(out), readonly=True) as store:
        return list(store.iter_rows())


def test_lookup_chain_reason_is_lookup_chain_with_reason(tokenizer):
    from longlab.tasks import generate_samples

    a = generate_samples("lookup_chain_reason", tokenizer, 256, 2, 3)
    b = generate_samples("lookup_chain", tokenizer, 256, 2, 3, reason=True)
    assert [s.task for s in a] == ["lookup_chain_reason"] * 2
    for x, y in zip(a, b):
        assert (x.context, x.question, x.answers, x.sample_id, x.metric, x.max_new_tokens) == (
            y.context, y.question, y.answers, y.sample_id, y.metric, y.max_new_tokens)
        assert x.metric == "final_number" and x.answer_prefix == ""


def test_inftythink_config_runs_and_feeds_the_page_table(tmp_path, capsys):
    import longlab
    from longlab.eval.pages.compression import inftythink_rows, inftythink_table
    from longlab.models import load_model
    from longlab.tasks import generate_samples

    out = tmp_path / "inftythink"
    rc = main(["eval", "--config", str(CONFIGS / "compression-inftythink.toml"), "--model", "tiny-llama",
               "--lengths", "256", "--samples", "2", "--max-new-tokens", "40", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    stored = _rows(out)
    assert len(stored) == 4 and {r["task"] for r in stored} == {"lookup_chain_reason"}
    rows = inftythink_rows(out)
    by = {(r["recipe"], r["sample_id"]): r for r in rows}
    for r in stored:
        mine = by[(r["recipe"], r["sample_id"])]
        assert mine["steps"] is not None and mine["steps"] >= 1
        if r["recipe"] == "full":
            assert mine["peak_kv_bytes"] == r["extra"]["kv_bytes_end"]
            assert mine["iterations"] == 1 and mine["generated"] == r["extra"]["generated_tokens"]
        else:
            rec = r["extra"]["context"]
            assert mine["iterations"] == rec["iterations"] >= 1
            assert mine["generated"] == rec["reasoning_tokens"] + rec["summary_tokens_used"]
            assert mine["peak_kv_bytes"] == rec["peak_kv_bytes"]
    # what bench/compression.py inftythink measured with longlab.generate: the same tokens, and the full
    # cache after the last token (held tokens: prompt + answer - 1)
    model, tok = load_model("tiny-llama")
    (sample, _) = generate_samples("lookup_chain_reason", tok, 256, 2, 0)
    for recipe in ("full", "inftythink:summarise=ask,segment=48,iterations=10,summary_tokens=32"):
        res = longlab.generate(model, tok, sample.context, sample.question, recipe, max_new_tokens=40,
                               answer_prefix=sample.answer_prefix, compress="end")
        row = next(r for r in stored if r["sample_id"] == sample.sample_id and r["recipe"].split(":")[0]
                   == recipe.split(":")[0])
        assert row["prediction"] == res.text
        mine = by[(row["recipe"], row["sample_id"])]
        if recipe == "full":
            assert mine["peak_kv_bytes"] == res.cache.nbytes()
            assert mine["final_tokens"] == len(res.token_ids[0])
        else:
            assert mine["peak_kv_bytes"] == res.context[0]["peak_kv_bytes"]
    text = inftythink_table(rows)
    assert text.count("| 256 tokens (") == 2 and "InftyThink (ask) | 2 |" in text
    assert "all lengths pooled: n = 2 pairs" in text


def test_inftythink_table_refuses_a_batched_full_row(tmp_path, capsys):
    """A ``full`` row decoded in a batch keeps no cache of its own: its peak is not measured, so the page's
    reader refuses it instead of guessing."""
    from longlab.errors import LonglabError
    from longlab.eval.pages.compression import inftythink_rows

    out = tmp_path / "batched"
    rc = main(["eval", "--config", str(CONFIGS / "compression-inftythink.toml"), "--model", "tiny-llama",
               "--lengths", "256", "--samples", "1", "--max-new-tokens", "8", "--recipes", "full,snapkv@0.5",
               "--batch-decode", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert all("kv_bytes_end" not in r["extra"] for r in _rows(out))
    with pytest.raises(LonglabError, match="kv_bytes_end"):
        inftythink_rows(out)


def test_forced_kl_by_hand():
    from longlab.eval.runner import forced_kl

    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert forced_kl(p, q) == pytest.approx(kl0 / 2, abs=1e-6)
    assert forced_kl(p, p) == pytest.approx(0.0, abs=1e-7)
    assert forced_kl(None, q) is None


def test_answer_nll_by_hand():
    from longlab.eval.runner import answer_nll

    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    assert answer_nll(logprobs, [0, 2]) == pytest.approx(-(math.log(0.5) + math.log(0.8)) / 2, abs=1e-6)
    assert answer_nll(logprobs, [1, 0]) == pytest.approx(-(math.log(0.25) + math.log(0.1)) / 2, abs=1e-6)
    assert answer_nll(None, [0]) is None and answer_nll(logprobs, []) is None


def test_indexmem_fidelity_config_records_agreement_and_kl(tmp_path, capsys):
    out = tmp_path / "fidelity"
    # IndexMem needs trained weights: the tiny run keeps the config's protocol with SnapKV's recipes
    rc = main(["eval", "--config", str(CONFIGS / "indexmem-fidelity.toml"), "--model", "tiny-llama",
               "--tasks", "niah_single_1", "--lengths", "512", "--chunk-size", "128",
               "--recipes", "full,snapkv@0.5,snapkv@0.9", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rows = _rows(out)
    assert len(rows) == 6 and all(r["query_aware"] for r in rows)
    for r in rows:
        extra = r["extra"]
        assert extra["score_mode"] == "forced" and extra["answer_nll"] > 0
        if r["recipe"] == "full":
            assert extra["fidelity"] == 1 and extra["kl_vs_full"] == pytest.approx(0.0, abs=1e-6)
        else:
            assert 0 <= extra["fidelity"] <= 1 and extra["kl_vs_full"] >= 0
            if extra["fidelity"] < 1:  # a different argmax somewhere: the distributions differ there
                assert extra["kl_vs_full"] > 0
    # a cache cut to a tenth changes the next-token distributions: the KL is measured, not a placeholder 0
    assert sum(r["extra"]["kl_vs_full"] for r in rows if r["recipe"] == "snapkv@0.9") > 0


def test_compression_page_tables_from_hand_made_data(tmp_path):
    """The compression page's HiCo-forward and InftyThink-speed blocks read the bench JSON as written: the
    paired interval that excludes 0 is starred, the one that holds 0 is not; the speed ratio is shown."""
    from longlab.eval.pages.compression import hico_forward_table, inftythink_speed_table

    data = {"rows": [{"sample_id": "a"}, {"sample_id": "b"}], "summary": {
        "plain": {"accuracy": [0.5, 0.1, 0.9], "kv_fraction": 1.0, "prefill_s_median": 4.0},
        "hico-forward@0.5": {"accuracy": [0.5, 0.1, 0.9], "kv_fraction": 0.74, "prefill_s_median": 3.0,
                             "time_ratio_median_ci": [0.75, 0.7, 0.8], "minus_plain": [-0.1, -0.3, 0.1]},
        "hico-forward@0.75": {"accuracy": [0.1, 0.0, 0.4], "kv_fraction": 0.59, "prefill_s_median": 2.0,
                              "time_ratio_median_ci": [0.5, 0.45, 0.55], "minus_plain": [-0.4, -0.6, -0.2]}}}
    text = hico_forward_table(data)
    assert text.startswith("n = 2 samples")
    assert "| HiCoForward r = 0.5 | 3.00 | **0.750 [0.700, 0.800]** | 0.740 |" in text
    assert text.count(" * |") == 1 and "-0.40 [-0.60, -0.20] * |" in text
    rows = [{"sample_id": "s", "prompt_tokens": 9, "iterations": 2, "once_s": [2.0, 2.2],
             "refill_s": [3.0, 3.2], "speedup": 1.45, "same_tokens": False, "load": 1.0}]
    assert "| `s` (9) | 2 | 2.0, 2.2 | 3.0, 3.2 | **1.45x** | no | 1.0 |" in inftythink_speed_table(rows)
