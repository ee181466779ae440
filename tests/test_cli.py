"""CLI: user errors exit 2 with one line (no traceback); generate and methods work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longlab.cli import main
from longlab.recipe import RECIPE_METHODS


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
    for name in RECIPE_METHODS:
        assert name in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["generate", "--model", "tiny-llama", "--recipe", "nosuch", "--context", "x"],
            "unknown recipe method 'nosuch'",
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


# --- bad input files and values (issue 10, item 11): one clear line, exit 2, nothing written -------------


def _generate_with_file(path, *extra):
    return ["generate", "--model", "tiny-llama", "--context-file", str(path), "--question", "Where?",
            "--max-new-tokens", "2", *extra]


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp: tmp, "is a directory, not a text file"),
        (lambda tmp: "/dev/null", "/dev/null is a character device, not a text file"),
        (lambda tmp: tmp / "absent.txt", "no such file"),
        (lambda tmp: _write(tmp / "latin1.txt", "caf\u00e9 cr\u00e8me ".encode("latin-1") * 20),
         "is not valid utf-8 text (byte 3: invalid continuation byte); give the file's encoding"),
        (lambda tmp: _write(tmp / "random.bin", bytes(range(128, 256)) * 4), "is not valid utf-8 text"),
        (lambda tmp: _write(tmp / "zeros.bin", b"ab\x00\x01\x02" * 50), "looks binary (it contains NUL"),
        (lambda tmp: _write(tmp / "empty.txt", b" \n\n"), "is empty"),
    ],
)
def test_generate_context_file_faults_are_named(capsys, tmp_path, make, fragment):
    assert main(_generate_with_file(make(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("longlab: error: --context-file: ") and fragment in err and "Traceback" not in err


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_generate_reads_another_encoding_when_told(capsys, tmp_path):
    text = "Le caf\u00e9 est dans la bo\u00eete rouge. " * 10
    path = _write(tmp_path / "latin1.txt", text.encode("latin-1"))
    assert main(_generate_with_file(path, "--encoding", "latin-1", "--recipe", "full")) == 0
    assert "[full] context tokens" in capsys.readouterr().out
    assert main(_generate_with_file(path, "--encoding", "no-such-codec")) == 2
    assert "--encoding: unknown encoding 'no-such-codec'" in capsys.readouterr().err


def test_generate_utf8_bom_is_dropped(capsys, tmp_path):
    path = _write(tmp_path / "bom.txt", b"\xef\xbb\xbf" + b"The lamp is on the table. " * 20)
    assert main(_generate_with_file(path, "--recipe", "full")) == 0


@pytest.mark.parametrize(
    "recipe, fragment",
    [
        ("random@0.5:seed=abc", "random: seed must be an integer"),
        ("streaming:budget=" + "9" * 23, "streaming: budget must be an integer in [1, 1048576]"),
        ("snapkv@", "the compression ratio after '@' is empty"),
    ],
)
def test_generate_bad_recipe_values_fail_before_loading(capsys, recipe, fragment):
    assert main(["generate", "--model", "tiny-llama", "--recipe", recipe, "--context", "x"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_a_100kb_recipe_name_is_not_echoed_whole(capsys):
    assert main(["generate", "--model", "tiny-llama", "--recipe", "x" * 100_000, "--context", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe method 'xxx" in err and "\u2026 (100000 characters)" in err and len(err) < 1000


def test_generate_bad_seed_and_context_flags(capsys):
    assert main(["generate", "--model", "tiny-llama", "--context", "some text", "--seed", str(2**70)]) == 2
    assert "seed must be an integer in [0, 2**64 - 1]" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-llama", "--context", "x", "--context-file", "f.txt"]) == 2
    assert "not both" in capsys.readouterr().err


def test_eval_jsonl_with_an_empty_context_is_refused_with_its_line(capsys, tmp_path):
    jsonl = tmp_path / "samples.jsonl"
    jsonl.write_text(
        '{"context": "a real context", "question": "q?", "answers": ["a"]}\n'
        '{"context": "", "question": "q?", "answers": ["a"]}\n'
    )
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny-llama", "--jsonl", str(jsonl), "--recipes", "full", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{jsonl}:2: 'context' is empty" in err and "Traceback" not in err
    assert not out.exists()  # nothing half-written


def test_methods_lists_the_families_outside_recipes(capsys):
    """Reuse methods, drafts and verifiers have their own registries; `longlab methods` lists them too."""
    from longlab.lab.mixers import MIXERS
    from longlab.position import POSITIONS
    from longlab.reuse.policies import REUSE_METHODS
    from longlab.spec.base import DRAFTS, VERIFIERS

    assert main(["methods"]) == 0
    listed = {tuple(line.split()[:2]) for line in capsys.readouterr().out.splitlines() if line[:1].strip()}
    families = (("reuse", REUSE_METHODS), ("draft", DRAFTS), ("verify", VERIFIERS), ("position", POSITIONS),
                ("mixer", MIXERS))
    for kind, registry in families:
        assert registry and all((name, kind) in listed for name in registry), kind
