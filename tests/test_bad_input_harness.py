"""Bad input to ``longlab eval`` / ``longlab example``, as a newcomer tries it: exit 2 with one line
naming the argument (no traceback), nothing written."""

from __future__ import annotations

import pytest

from longlab.cli import main
from longlab.engine import kv_bytes_per_token
from longlab.eval.config import EvalConfig
from longlab.eval.driver import check_lengths
from longlab.eval.store import DB_NAME
from longlab.recipe import LonglabError
from longlab.tasks import generate_samples as generate_task
from longlab.tasks import save_jsonl

EVAL = ["eval", "--model", "tiny-llama", "--tasks", "niah_single_1", "--recipes", "full", "--samples", "1",
        "--max-new-tokens", "2", "--no-progress", "--no-report"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _user_error(capsys, argv: list[str], *fragments: str) -> str:
    """Run the CLI; assert a user error naming ``fragments``; return what it printed on stdout."""
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and printed.err.startswith("longlab: error: ")
    assert printed.err.count("\n") == 1  # one line
    for fragment in fragments:
        assert fragment in printed.err
    return printed.out


def test_empty_out_is_refused_and_nothing_is_written_in_cwd(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _user_error(capsys, [*EVAL, "--lengths", "512", "--out", ""], "--out is empty")
    _user_error(capsys, [*EVAL, "--lengths", "512", "--out", "  "], "--out is empty")
    assert list(tmp_path.iterdir()) == []


def test_impossible_length_is_refused_before_generating(tmp_path, capsys):
    out = tmp_path / "x"
    _user_error(capsys, [*EVAL, "--lengths", "512,100000000", "--out", str(out)],
                "--lengths 100000000 cannot be held here", "allowed range: 1..")
    assert not (out / DB_NAME).exists()


def test_length_beyond_the_models_positions_warns_before_generating(tmp_path, capsys, monkeypatch):
    import longlab.eval.driver as grid

    def stop(*args, **kwargs):  # the samples would be generated next: stop the run there
        raise LonglabError("stopped before generating")

    monkeypatch.setattr(grid, "build_samples", stop)
    assert main([*EVAL, "--lengths", "512,9000", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err  # refused by default, naming the flag that runs it anyway
    assert "--lengths 9000 is beyond tiny-llama's max_position_embeddings=8192" in err
    assert "--no-strict" in err
    assert "stopped before generating" not in err
    assert main([*EVAL, "--lengths", "512,9000", "--no-strict", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--lengths 9000 is beyond tiny-llama's max_position_embeddings=8192" in err
    assert err.index("max_position_embeddings") < err.index("stopped before generating")


def test_length_bounds_come_from_the_model_and_the_memory(tiny_models):
    model = tiny_models["tiny-llama"][0]
    per_token = kv_bytes_per_token(model)
    cfg = model.config
    assert per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    warnings: list[str] = []
    config = EvalConfig(out="x", model="tiny-llama", recipes=["full"], lengths=[512], strict=False)
    check_lengths(config, model, warnings.append, available=2**40)
    assert warnings == []
    # beyond max_position_embeddings: a warning naming --lengths, not an error
    beyond = cfg.max_position_embeddings + 1
    config.lengths = [512, beyond]
    check_lengths(config, model, warnings.append, available=2**40)
    assert len(warnings) == 1 and f"--lengths {beyond}" in warnings[0]
    assert "max_position_embeddings" in warnings[0]
    # memory: 1 MiB free holds a few hundred tokens of this model, not 512
    config.lengths = [512]
    with pytest.raises(LonglabError, match=r"--lengths 512 cannot be held here.*allowed range: 1\.\.\d+"):
        check_lengths(config, model, warnings.append, available=2**20)
    # a grid that fits one sample but maybe not every recipe's branch warns
    warnings.clear()
    need_one = 512 * (2 * per_token + 2 * cfg.num_attention_heads * 128 * 4)
    many = EvalConfig(out="x", recipes=["full"] * 40, lengths=[512])
    check_lengths(many, model, warnings.append, available=need_one + 1)
    assert len(warnings) == 1 and "--no-batch-decode" in warnings[0]


def test_duplicate_jsonl_sample_ids_are_refused(tmp_path, capsys, tokenizer):
    samples = generate_task("niah_single_1", tokenizer, 512, 3, seed=1)
    samples[2].sample_id = samples[0].sample_id  # same task and length: one row of the store for two samples
    path = tmp_path / "dup.jsonl"
    save_jsonl(samples, path)
    out = tmp_path / "out"
    argv = ["eval", "--model", "tiny-llama", "--recipes", "full", "--max-new-tokens", "2", "--no-progress",
            "--no-report", "--jsonl", str(path), "--out", str(out)]
    _user_error(capsys, argv, "--jsonl", "duplicate sample_id", repr(samples[0].sample_id))
    assert not (out / DB_NAME).exists()


def test_example_checks_every_recipe_before_running_the_first(capsys):
    out = _user_error(capsys, ["example", "--model", "tiny-llama", "--recipes", "full,snapkv@0.5,nosuch@0.5"],
                      "--recipes", "unknown recipe method 'nosuch'")
    assert out == ""  # nothing ran: not even the model was loaded
    _user_error(capsys, ["example", "--model", "tiny-llama", "--recipes", "full,snapkv@1.5"],
                "--recipes", "compression_ratio")
