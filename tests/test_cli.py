"""CLI: user errors exit 2 with one line (no traceback); generate and methods work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longlab.cli import main
from longlab.recipe import REGISTRY


def test_generate_prints_answer_and_summary(capsys, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The lamp is on the table. " * 40)
    code = main(
        [
            "generate",
            "--model",
            "tiny-llama",
            "--recipe",
            "snapkv@0.5",
            "--context-file",
            str(ctx),
            "--question",
            "Where is the lamp?",
            "--max-new-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "[snapkv@0.5] context tokens" in out and "MiB ->" in out and "prefill" in out


def test_methods_lists_every_registered_method(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert name in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["generate", "--model", "tiny-llama", "--recipe", "nosuch", "--context", "x"],
            "unknown method 'nosuch'",
        ),
        (
            ["generate", "--model", "tiny-llama", "--recipe", "snapkv@1.2", "--context", "x"],
            "compression_ratio",
        ),
        (["generate", "--model", "tiny-llama", "--context-file", "/no/such/file"], "--context-file"),
        (["generate", "--model", "tiny-llama", "--context", " "], "context is empty"),
        (["generate", "--model", "tiny-nosuch", "--context", "x"], "cannot load model 'tiny-nosuch'"),
    ],
)
def test_user_errors_exit_2_with_a_clear_line(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_cli_entry_point_has_no_traceback_for_user_errors():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longlab.cli",
            "generate",
            "--model",
            "tiny-llama",
            "--recipe",
            "h2o@7",
            "--context",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "longlab: error: h2o: compression_ratio must be in [0, 1)" in out.stderr
    assert "Traceback" not in out.stderr


def test_recipe_lists_keep_multi_parameter_methods_together():
    from longlab.recipe import LonglabError, split_recipes

    assert split_recipes("full, streaming:budget=512,sinks=4 ,snapkv@0.5") == [
        "full",
        "streaming:budget=512,sinks=4",
        "snapkv@0.5",
    ]
    assert split_recipes("prism+streaming:budget=64,sinks=2,knorm@0.5") == [
        "prism+streaming:budget=64,sinks=2",
        "knorm@0.5",
    ]
    with pytest.raises(LonglabError, match="sinks=4"):
        split_recipes("snapkv@0.5,sinks=4")
