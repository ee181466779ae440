"""Layers-lab trainer, checkpoints, resume, evaluation into the results store, report and CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from longlab.cli import main as cli_main
from longlab.eval.store import ResultStore
from longlab.lab import MIXERS, LabConfig, LabLM, match_mlp_hidden
from longlab.lab import train as train_mod
from longlab.lab.evaluate import evaluate
from longlab.lab.plot import extrapolation_table, lab_rows, plot_results
from longlab.lab.train import TrainConfig, load_checkpoint, train
from longlab.recipe import LonglabError

TINY = dict(dim=16, n_layers=1, n_heads=2, batch=4, ckpt_every=3)


def _cfg(**kw) -> TrainConfig:
    base = dict(mixer="softmax", task="mqar:queries=2", train_len=24, steps=6, **TINY)
    base.update(kw)
    return TrainConfig(**base)


def test_train_writes_safetensors_and_manifest(tmp_path):
    manifest = train(_cfg(), tmp_path / "run", progress=False, log=None)
    assert manifest["step"] == 6 and manifest["train_tokens"] == 6 * 4 * 24
    ck = tmp_path / "run" / manifest["checkpoint"]
    assert (ck / "model.safetensors").is_file() and (ck / "optimizer.safetensors").is_file()
    assert len(list((tmp_path / "run").glob("checkpoint-*"))) == 1
    state = load_file(str(ck / "model.safetensors"))
    model, cfg, _ = load_checkpoint(tmp_path / "run")
    assert cfg == _cfg()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    on_disk = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert on_disk["params"] == model.n_params() and len(on_disk["history"]) == 2


def test_resume_after_interruption_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    full = train(_cfg(mixer="l2a:window=4"), tmp_path / "a", progress=False, log=None)
    real = train_mod.batch_generator

    def dies_at_4(seed, step):
        if step == 4:
            raise KeyboardInterrupt
        return real(seed, step)

    monkeypatch.setattr(train_mod, "batch_generator", dies_at_4)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(mixer="l2a:window=4"), tmp_path / "b", progress=False, log=None)
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["step"] == 3
    monkeypatch.setattr(train_mod, "batch_generator", real)
    resumed = train(_cfg(mixer="l2a:window=4"), tmp_path / "b", progress=False, log=None)
    assert resumed["step"] == full["step"] == 6
    a, _, _ = load_checkpoint(tmp_path / "a")
    b, _, _ = load_checkpoint(tmp_path / "b")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=0)


def test_resume_with_other_settings_is_refused(tmp_path):
    train(_cfg(), tmp_path / "run", progress=False, log=None)
    with pytest.raises(LonglabError, match="other settings"):
        train(_cfg(lr=1e-4), tmp_path / "run", progress=False, log=None)


def test_resume_accepts_a_manifest_written_before_new_fields(tmp_path):
    """A run written before ``rollout``/``init`` existed resumes: missing fields hold their defaults."""
    train(_cfg(steps=3), tmp_path / "run", progress=False, log=None)
    path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(path.read_text())
    for key in ("rollout", "init"):
        del manifest["train"][key]
    path.write_text(json.dumps(manifest))
    assert train(_cfg(steps=3), tmp_path / "run", progress=False, log=None)["step"] == 3  # no refusal
    with pytest.raises(LonglabError, match="other settings"):
        train(_cfg(steps=3, lr=1e-4), tmp_path / "run", progress=False, log=None)


def test_training_lowers_the_loss(tmp_path):
    cfg = _cfg(task="flipflop", steps=30, lr=1e-2, ckpt_every=5)
    m = train(cfg, tmp_path / "r", progress=False, log=None)
    losses = [h["loss"] for h in m["history"]]
    assert losses[-1] < losses[0]


def test_equal_parameters_across_mixers():
    counts = {}
    for name in MIXERS:
        if MIXERS[name].block == "plain":  # spiking layers: no MLP whose width could match the count
            continue
        cfg = match_mlp_hidden(LabConfig(vocab_size=40, mixer=name, dim=32, n_layers=2, n_heads=4), 60_000)
        counts[name] = LabLM(cfg).n_params()
    assert all(abs(c - 60_000) / 60_000 < 0.02 for c in counts.values()), counts


def test_eval_writes_the_results_store_and_report(tmp_path):
    res = tmp_path / "results"
    for mixer in ("softmax", "lssar"):
        train(_cfg(mixer=mixer), tmp_path / mixer, progress=False, log=None)
        rows = evaluate(tmp_path / mixer, [24, 48], out=res, samples=3, batch=2, log=None)
        assert len(rows) == 6
    again = evaluate(tmp_path / "lssar", [24, 48], out=res, samples=3, batch=2, log=None)
    assert again == []  # idempotent: nothing re-run
    with ResultStore(res, readonly=True) as store:
        stored = store.rows()
    assert len(stored) == 12
    assert {r["recipe"] for r in stored} == {"softmax", "lssar"}
    assert {r["length"] for r in stored} == {24, 48}
    assert all(0.0 <= r["score"] <= 1.0 for r in stored)
    assert stored[0]["extra"]["train_len"] == 24 and stored[0]["model"] == "lab-mqar-train24"
    table = extrapolation_table(lab_rows(res))
    assert "| lssar |" in table and "| softmax |" in table
    assert plot_results(res, tmp_path / "plot.png").stat().st_size > 1000
    from longlab.eval.report import write_report

    md = write_report(res, html=False)["markdown"].read_text()
    assert "lssar" in md and "softmax" in md


def test_eval_scores_agree_with_a_direct_forward(tmp_path):
    train(_cfg(task="passkey"), tmp_path / "p", progress=False, log=None)
    rows = evaluate(tmp_path / "p", [40], out=tmp_path / "res", samples=2, batch=1, log=None)
    model, cfg, _ = load_checkpoint(tmp_path / "p")
    from longlab.lab.evaluate import eval_generator
    from longlab.lab.tasks import task_config

    task = task_config(cfg.task)
    for r in rows:
        b = task.sample(1, 40, eval_generator(0, 40, int(r["sample_id"])))
        with torch.no_grad():
            assert r["score"] == pytest.approx(float(task.score(model(b.tokens), b)[0]))


def test_bad_input(tmp_path):
    train(_cfg(), tmp_path / "run", progress=False, log=None)
    with pytest.raises(LonglabError, match="training length"):
        evaluate(tmp_path / "run", [16], log=None)
    with pytest.raises(LonglabError, match="no lab checkpoint"):
        evaluate(tmp_path / "nothing", [64], log=None)
    with pytest.raises(LonglabError, match="unknown mixer"):
        _cfg(mixer="nosuch")
    with pytest.raises(LonglabError, match="unknown task"):
        _cfg(task="nosuch")
    with pytest.raises(LonglabError, match="p must be"):
        _cfg(mixer="lssar:p=0")
    with pytest.raises(LonglabError, match="alpha must be"):
        _cfg(mixer="asentmax:alpha=0.5")
    with pytest.raises(LonglabError, match="steps"):
        _cfg(steps=0)


def test_cli_train_eval_and_errors(tmp_path, capsys):
    out = tmp_path / "ck"
    rc = cli_main(["lab", "train", "--mixer", "race", "--task", "copy", "--train-len", "16", "--steps", "2",
                   "--out", str(out), "--dim", "16", "--layers", "1", "--heads", "2", "--batch", "2",
                   "--no-progress"])
    assert rc == 0
    assert cli_main(["lab", "eval", str(out), "--lengths", "16", "32", "--samples", "2"]) == 0
    assert cli_main(["lab", "eval", str(out), "--lengths", "8"]) == 2
    assert cli_main(["lab", "train", "--mixer", "asentmax:alpha=0.9", "--task", "copy", "--train-len", "16",
                     "--steps", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "alpha must be" in err and "training length" in err
    assert not (tmp_path / "x").exists()


def test_position_controls_get_their_own_recipe(tmp_path):
    from longlab.lab.evaluate import recipe_name

    assert recipe_name("softmax", "rope") == "softmax" and recipe_name("asentmax", "nape") == "asentmax"
    assert recipe_name("softmax", "nape") == "softmax+nape"
    assert recipe_name("asentmax", "rope") == "asentmax+rope"
    train(_cfg(positions="nape"), tmp_path / "n", progress=False, log=None)
    rows = evaluate(tmp_path / "n", [24], out=tmp_path / "res", samples=2, batch=2, log=None)
    assert {r["recipe"] for r in rows} == {"softmax+nape"}


def test_ropeid_positions_are_set_for_the_training_length(tmp_path):
    cfg = _cfg(positions="ropeid")
    assert cfg.model_config().train_len == 24 and _cfg().model_config().train_len == 0
    train(cfg, tmp_path / "r", progress=False, log=None)
    model, _, _ = load_checkpoint(tmp_path / "r")
    rot = model.blocks[0].mixer.positions
    half = rot.inv_freq.numel() // 2
    assert rot.kind == "ropeid" and rot.inv_freq[0] == 1.0 and (rot.inv_freq[half:] == 0).all()
    rows = evaluate(tmp_path / "r", [48], out=tmp_path / "res", samples=2, batch=2, log=None)
    assert {r["recipe"] for r in rows} == {"softmax+ropeid"}


def test_several_training_seeds_give_a_t_interval_over_seed_means():
    from scipy import stats

    from longlab.eval.stats import score_estimate
    from longlab.lab.plot import cell_estimate

    one = cell_estimate({0: [1.0, 0.0, 1.0, 1.0]})
    assert one[3] == "n=4" and one[1] < 0.75 < one[2]  # Wilson over samples
    mean, lo, hi, what = cell_estimate({0: [0.2, 0.4], 1: [0.6, 0.6], 2: [0.9, 0.7]})
    means = [0.3, 0.6, 0.8]
    half = stats.t.ppf(0.975, 2) * stats.tstd(means) / 3**0.5
    assert what == "3 seeds×2" and mean == pytest.approx(sum(means) / 3)
    assert lo == pytest.approx(max(0.0, mean - half)) and hi == pytest.approx(min(1.0, mean + half))
    # seeds that agree exactly: the interval is still the test-sampling one (24 sequences, not 0 width)
    same = {s: {str(i): 1.0 for i in range(24)} for s in range(3)}
    m, lo, hi, what = cell_estimate(same)
    assert m == 1.0 and hi == 1.0 and lo == pytest.approx(score_estimate([1.0] * 24).low) and lo < 0.9


def test_samples_without_a_scored_position_are_left_out_of_the_table():
    base = {"model": "lab-flipflop-train64", "task": "flipflop", "recipe": "softmax", "length": 64, "seed": 0}
    rows = [dict(base, sample_id=str(i), score=1.0, extra={"answers_per_sample": 2, "train_steps": 4})
            for i in range(3)]
    rows.append(dict(base, sample_id="3", score=0.0, extra={"answers_per_sample": 0, "train_steps": 4}))
    table = extrapolation_table(rows)
    assert "| softmax | 1.00" in table and "n=3" in table


@pytest.mark.slow
@pytest.mark.parametrize("task", ["flipflop", "passkey"])
def test_softmax_learns_the_task(tmp_path, task):
    cfg = TrainConfig(mixer="softmax", task=task, train_len=64, steps=400, batch=32, lr=3e-3)
    train(cfg, tmp_path / task, progress=False, log=None)
    rows = evaluate(tmp_path / task, [64], samples=32, log=None)
    assert sum(r["score"] for r in rows) / len(rows) > 0.8


def test_eval_on_a_task_variant(tmp_path):
    """An algebra model tested on a mechanism set: rows carry the variant's spec; other tasks refused."""
    train(_cfg(task="algebra", train_len=40, steps=3), tmp_path / "run", progress=False, log=None)
    rows = evaluate(tmp_path / "run", [40], out=tmp_path / "res", samples=3, log=None,
                    task="algebra:query=commuted")
    assert {r["task"] for r in rows} == {"algebra:query=commuted"} and len(rows) == 3
    assert all(r["answers_per_sample"] == 1 for r in rows)
    base = evaluate(tmp_path / "run", [40], out=tmp_path / "res", samples=3, log=None)
    assert {r["task"] for r in base} == {"algebra"} and base[0]["run_key"] != rows[0]["run_key"]
    assert {r["task"] for r in lab_rows(tmp_path / "res", skip=["query="])} == {"algebra"}
    assert "query=commuted" in extrapolation_table(lab_rows(tmp_path / "res"))
    with pytest.raises(LonglabError, match="variant"):
        evaluate(tmp_path / "run", [40], out=tmp_path / "res", samples=1, log=None, task="algebra:symbols=12")
    with pytest.raises(LonglabError, match="variant"):
        evaluate(tmp_path / "run", [40], out=tmp_path / "res", samples=1, log=None, task="copy:alphabet=16")


def test_cli_probe_on_a_pcfg_model(tmp_path, capsys):
    task = "pcfg:nonterminals=3,terminals=4,max_length=16"
    train(_cfg(task=task, train_len=10, steps=3), tmp_path / "run", progress=False, log=None)
    rows = evaluate(tmp_path / "run", [10, 16], out=tmp_path / "res", samples=2, log=None)  # exact oracle
    assert len(rows) == 4 and all(0 < r["score"] <= 1 and r["kl"] >= 0 for r in rows)
    out = tmp_path / "probe.json"
    assert cli_main(["lab", "probe", str(tmp_path / "run"), "--widths", "1", "2", "4", "--train", "12",
                     "--test", "6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) >= {"trained", "untrained"} and res["trained"]["length"] == 10
    assert set(res["trained"]["r2"]) == {"0", "1"} and set(res["trained"]["r2"]["0"]) == {"1", "2", "4"}
    assert "best layer" in capsys.readouterr().out
    train(_cfg(train_len=24, steps=3), tmp_path / "mq", progress=False, log=None)
    assert cli_main(["lab", "probe", str(tmp_path / "mq")]) == 2
    assert "trained on the pcfg task" in capsys.readouterr().err


def test_report_counts_every_training_seed(tmp_path):
    """`longlab report` keeps one row per (sample, recipe); the training seed is part of the sample, so
    the rows of several seeds of one lab recipe are all counted (pooled), none dropped as a duplicate."""
    from longlab.eval.rows import load_rows, one_per_sample

    for seed in (0, 1):
        train(_cfg(seed=seed), tmp_path / f"s{seed}", progress=False, log=None)
        evaluate(tmp_path / f"s{seed}", [24], out=tmp_path / "res", samples=3, log=None)
    sel = one_per_sample(load_rows(tmp_path / "res"))
    assert len(sel.rows) == 6 and sel.dropped == 0 and {r["seed"] for r in sel.rows} == {0, 1}
