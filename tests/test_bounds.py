"""Nothing hangs, everything is bounded: every input that used to hang (a FIFO, a huge context, a length the
machine cannot hold, a process group that cannot meet) is refused before the work, naming the argument."""

from __future__ import annotations

import os
import socket

import pytest

from longlab.cli import main
from longlab.recipe import LonglabError

EVAL = ["eval", "--model", "tiny-llama", "--recipes", "full", "--no-progress"]


def test_a_fifo_is_refused_instead_of_blocking(tmp_path, capsys):
    fifo = tmp_path / "rows.json"
    os.mkfifo(fifo)
    assert main([*EVAL, "--tasks", "niah_single_1", "--lengths", "512", "--skip-rows", str(fifo),
                 "--out", str(tmp_path / "a")]) == 2
    assert "--skip-rows" in capsys.readouterr().err
    assert main([*EVAL, "--jsonl", str(fifo), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--jsonl" in err and "not a regular file" in err
    assert main(["generate", "--model", "tiny-llama", "--context-file", str(fifo), "--question", "q"]) == 2
    assert "a named pipe" in capsys.readouterr().err


def test_skip_rows_with_infinity_deep_nesting_or_string_booleans_is_refused(tmp_path, capsys):
    for text, needle in (("[" * 100000 + "]" * 100000, "nested too deeply"),
                         ('[{"model": "m", "recipe": "full", "task": "t", "length": Infinity, '
                          '"sample_id": "s"}]', "not JSON"),
                         ('[{"model": "m", "recipe": "full", "task": "t", "length": 1, "sample_id": "s", '
                          '"query_aware": "false"}]', "query_aware must be true or false")):
        path = tmp_path / "rows.json"
        path.write_text(text)
        assert main([*EVAL, "--tasks", "niah_single_1", "--lengths", "512", "--skip-rows", str(path),
                     "--out", str(tmp_path / "x")]) == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("axis", [[], ["--reuse", "full-prefill"], ["--speculative", "lookup"]])
def test_a_length_the_machine_cannot_hold_is_refused_on_every_axis(tmp_path, capsys, axis):
    tasks = ["--tasks", "multidoc_qa_1"] if axis and axis[0] == "--reuse" else ["--tasks", "niah_single_1"]
    assert main([*EVAL, *axis, *tasks, "--lengths", "100000000", "--no-strict", "--out", str(tmp_path)]) == 2
    assert "--lengths 100000000 cannot be held here" in capsys.readouterr().err


def test_a_huge_context_is_refused_before_it_is_tokenized(tiny_models, tokenizer):
    from longlab import generate

    model = tiny_models["tiny-llama"][0]
    with pytest.raises(LonglabError, match="beyond longlab's input limit"):
        generate(model, tokenizer, "x" * 9_000_000, "q?", "full")


def test_a_process_group_without_loopback_is_refused(monkeypatch):
    from longlab.ops import context_parallel

    def no_network(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(LonglabError, match="needs a loopback network"):
        context_parallel.check_loopback()
