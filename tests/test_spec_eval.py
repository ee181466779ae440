"""``longlab eval --speculative`` summaries (longlab.eval.spec_grid) and the summarisation-like task
``summ_events`` (longlab.tasks.summary)."""

from __future__ import annotations

import pytest

from longlab.eval.spec_tables import spec_markdown
from longlab.eval.stats import bootstrap_ci, paired_difference, wilson_interval
from longlab.tasks import TASKS, generate_samples, metric_for, score_sample


def _row(label: str, spec: str, sample: int, score: float, *, acc=None, tpf=1.0, same=True, speed=1.0):
    return {
        "recipe": label,
        "method": "full",
        "task": "passkey",
        "length": 1024,
        "sample_id": f"s{sample}",
        "seed": 0,
        "score": score,
        "extra": {
            "spec": spec,
            "acceptance_rate": acc,
            "tokens_per_forward": tpf,
            "speed_vs_plain": speed,
            "bytes_vs_plain": 1.0 if spec == "plain" else 0.5,
            "same_as_plain": same,
            "load_1m": 2.0 + sample,
        },
    }


def test_spec_markdown_intervals_and_paired_difference():
    plain = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    lossy = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # loses two samples plain decoding got right
    acc = [0.2, 0.4, 0.5, 0.1, 0.9, 0.3]
    rows = [_row("full", "plain", i, s) for i, s in enumerate(plain)]
    rows += [
        _row("full~a", "a", i, s, acc=acc[i], tpf=1 + acc[i], speed=0.5 + i) for i, s in enumerate(plain)
    ]
    rows += [_row("full~b", "b", i, s, acc=acc[i], same=s == plain[i]) for i, s in enumerate(lossy)]
    md = spec_markdown(rows)
    by_label = {line.split(" | ")[2]: line for line in md.splitlines() if line.startswith("| passkey |")}
    low, high = wilson_interval(4, 6)
    assert f"66.7 [{100 * low:.1f}, {100 * high:.1f}]" in by_label["full"]  # as every score table writes it
    assert "identical tokens (6/6)" in by_label["full~a"]
    d = paired_difference(lossy, plain)
    assert f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" in by_label["full~b"]
    mean, lo, hi = bootstrap_ci([acc])
    assert f"{mean:.2f} [{lo:.2f}, {hi:.2f}]" in by_label["full~a"]
    pooled = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| 1024 |")}
    assert "3.00 (1.75-4.25)" in pooled["full~a"]  # median and quartiles of 0.5 .. 5.5
    assert pooled["full~b"].rstrip(" |").endswith("2.0-7.0") and "4/6" in pooled["full~b"]
    assert spec_markdown([{"recipe": "full", "extra": {}}]) is None


def test_paired_cell_says_not_significant():
    rows = [_row("full", "plain", i, s) for i, s in enumerate([1.0, 0.0, 1.0])]
    rows += [_row("full~x", "x", i, s, acc=0.5, same=False) for i, s in enumerate([0.0, 1.0, 1.0])]
    line = next(x for x in spec_markdown(rows).splitlines() if "| full~x |" in x)
    assert "+0.0" in line and "n.s." in line


def test_summ_events_is_registered_seeded_and_scored_by_rouge(tokenizer):
    assert "summ_events" in TASKS and metric_for("summ_events") == "rouge_l"
    a = generate_samples("summ_events", tokenizer, 600, 2, 0)
    b = generate_samples("summ_events", tokenizer, 600, 2, 0)
    assert [s.context for s in a] == [s.context for s in b] and a[0].context != a[1].context
    s = a[0]
    assert len(tokenizer(s.context + s.question)["input_ids"]) <= 600 + 2
    events = s.metadata["events"]
    positions = [s.context.index(f"Event {k + 1}: {e}") for k, e in enumerate(events)]
    assert positions == sorted(positions)  # the story is told in order
    assert s.answers == [" ".join(events)]
    assert score_sample(s, s.answers[0]) == pytest.approx(1.0)
    half = " ".join(events[: len(events) // 2])
    assert 0.2 < score_sample(s, half) < 0.9
    assert score_sample(s, "The weather was nice.") < 0.2
    with pytest.raises(ValueError, match="num_events"):
        generate_samples("summ_events", tokenizer, 600, 1, 0, num_events=0)


def test_cli_eval_grid_drafts_x_verifiers(tmp_path, capsys):
    """The issue's grid on a tiny model: 2 drafts x 2 verifiers next to plain decoding, one row each per
    sample, acceptance / tokens per forward / K/V bytes stored and summarised with intervals."""
    from longlab.cli import main
    from longlab.eval.store import ResultStore

    out = tmp_path / "grid"
    args = ["eval", "--model", "tiny-llama", "--tasks", "passkey", "--lengths", "400", "--samples", "1"]
    args += ["--speculative", "lookup", "self:streaming:budget=48", "--verify", "full", "dustin:budget=2048"]
    args += ["--max-new-tokens", "5", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "5 new rows" in text and "| full~self:streaming:budget=48;full;gamma=4 |" in text
    store = ResultStore(str(out))
    rows = store.rows()
    store.close()
    assert len(rows) == 5 and {r["extra"]["spec"] for r in rows} >= {"plain", "lookup;full;gamma=10"}
    for r in rows:
        e = r["extra"]
        assert e["same_as_plain"], r["recipe"]  # full, and Dustin with a budget over the context: exact
        assert e["kv_bytes_read_per_token"] > 0 and e["tokens_per_forward"] >= 1.0
        if e["spec"] != "plain":
            assert 0.0 <= e["acceptance_rate"] <= 1.0 and e["target_forwards"] >= 1
    self_rows = [r for r in rows if r["extra"]["spec"].startswith("self:")]
    assert all(r["extra"]["draft_forwards"] > 0 for r in self_rows)
    assert "identical tokens (1/1)" in text and "load (1 min)" in text


@pytest.mark.slow  # reads the cached tokenizers of the shipped real models (skipped where they are absent)
def test_shipped_real_models_do_not_share_a_tokenizer():
    """No shipped real pair can be a ``model:NAME`` draft for another (smollm2-135m: 49 152 tokens,
    qwen2.5-0.5b: 151 936; gemma3-270m: 262 144): the draft check refuses the pair, naming the argument."""
    from transformers import AutoTokenizer

    from longlab.paths import cache_dir
    from longlab.recipe import LonglabError
    from longlab.spec.drafts import check_same_tokenizer

    root = cache_dir() / "models"
    shipped = ("smollm2-135m", "qwen2.5-0.5b", "gemma3-270m")
    names = [n for n in shipped if (root / n / "config.json").exists()]
    if len(names) < 2:
        pytest.skip("fewer than two real models cached")
    toks = {n: AutoTokenizer.from_pretrained(root / n) for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            with pytest.raises(LonglabError, match=rf"speculative=.model:{b}.: .*another tokenizer"):
                check_same_tokenizer(toks[a], toks[b], b)
