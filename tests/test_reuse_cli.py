"""``longlab store add|list|rm|gc`` and ``longlab generate --docs ... --reuse ...`` on a tiny model."""

from __future__ import annotations

import pytest

from longlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def files(tmp_path):
    out = []
    for i in range(2):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(" ".join(f"Item {j} is in box {j % 5}." for j in range(i * 10, i * 10 + 8)) + "\n")
        out.append(str(f))
    return out


def test_store_commands_and_generate_docs(files, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["store", "add", "--model", "tiny-llama", "--store", store, *files]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    assert main(["store", "list", "--store", store]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("2 entries") and all(i in listing for i in ids)
    args = [
        "generate",
        "--model",
        "tiny-llama",
        "--docs",
        *files,
        "--question",
        "Where is item 12?",
        "--max-new-tokens",
        "4",
        "--store",
        store,
    ]
    assert main([*args, "--reuse", "prophetkv:recompute=0.2"]) == 0
    out = capsys.readouterr().out
    assert "reuse=prophetkv" in out and "'hits': 2" in out and "'misses': 0" in out  # the added entries serve
    assert main([*args, "--reuse", "bogus"]) == 2
    assert "unknown reuse method" in capsys.readouterr().err
    assert main(["store", "rm", "--store", store, ids[0]]) == 0
    assert main(["store", "rm", "--store", store, ids[0]]) == 2
    assert main(["store", "gc", "--store", store, "--max-bytes", "0"]) == 0
    assert "1 evicted; 0 entries" in capsys.readouterr().out


def test_generate_docs_bad_input(files, tmp_path, capsys):
    base = ["generate", "--model", "tiny-llama", "--store", str(tmp_path / "s")]
    assert main([*base, "--docs", *files]) == 2  # no question
    assert "--question" in capsys.readouterr().err
    assert main([*base, "--reuse", "epic", "--question", "q"]) == 2  # no docs
    assert main([*base, "--docs", str(tmp_path / "missing.txt"), "--question", "q"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([*base, "--docs", *files, "--question", "q", "--reuse", "cacheblend:recompute=2"]) == 2
    assert "recompute must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing written before the arguments were checked


def test_eval_reuse_grid_writes_rows(tmp_path, capsys):
    out = str(tmp_path / "runs")
    args = [
        "eval",
        "--model",
        "tiny-llama",
        "--reuse",
        "full-prefill,no-recompute,prophetkv:recompute=0.2,epic:k=4",
        "--tasks",
        "multidoc_qa_1",
        "--lengths",
        "900",
        "--samples",
        "2",
        "--num-docs",
        "4",
        "--score",
        "forced",
        "--out",
        out,
        "--no-progress",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "8 new rows, 0 skipped" in first
    from longlab.eval.report import load_rows

    rows = load_rows(out)
    assert {r["recipe"] for r in rows} == {"full", "no-recompute", "prophetkv", "epic:k=4"}
    full = {r["sample_id"]: r for r in rows if r["recipe"] == "full"}
    for r in rows:
        assert r["extra"]["fidelity"] is not None and 0 <= r["extra"]["fidelity"] <= 1
        if r["recipe"] == "full":
            assert r["extra"]["fidelity"] == 1.0 and r["extra"]["recompute_fraction"] == 1.0
        assert r["context_tokens"] == full[r["sample_id"]]["context_tokens"]
    assert main(args) == 0
    assert "0 new rows, 8 skipped" in capsys.readouterr().out
    assert main([*args[:4], "cacheblend:recompute=3", *args[5:]]) == 2
    assert (
        main(
            [
                "eval",
                "--model",
                "tiny-llama",
                "--reuse",
                "epic",
                "--tasks",
                "passkey",
                "--lengths",
                "600",
                "--samples",
                "1",
                "--out",
                str(tmp_path / "r2"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "multi-document" in capsys.readouterr().err


def test_generate_docs_with_recipe(files, tmp_path, capsys):
    """``--reuse`` and ``--recipe`` compose: the summary names both and the KV shrinks; a recipe that cannot
    follow a reuse prefill fails before the model loads or the store is made."""
    base = ["generate", "--model", "tiny-llama", "--docs", *files, "--question", "Where is item 12?",
            "--max-new-tokens", "3", "--store", str(tmp_path / "s"), "--reuse", "cacheblend:recompute=0.2"]
    assert main([*base, "--recipe", "snapkv@0.5"]) == 0
    out = capsys.readouterr().out
    assert "[reuse=cacheblend:recompute=0.2+snapkv@0.5]" in out
    before, after = out.split("| KV ")[1].split(" | ")[0].split(" -> ")
    assert float(after.split()[0]) < float(before.split()[0])
    assert main([*base, "--recipe", "full"]) == 0
    assert "[reuse=cacheblend:recompute=0.2]" in capsys.readouterr().out
    bad = [*base[:-4], "--store", str(tmp_path / "s2"), "--reuse", "epic", "--recipe", "h2o@0.5"]
    assert main(bad) == 2
    assert "accumulates attention" in capsys.readouterr().err
    assert not (tmp_path / "s2").exists()


def test_eval_reuse_times_recipes(tmp_path, capsys):
    """``longlab eval --reuse ... --recipes ...``: every method x recipe is a row; full-prefill + snapkv is
    labelled ``snapkv@0.5`` (a plain prefill + recipe), the others ``<reuse>+<recipe>``."""
    out = str(tmp_path / "runs")
    args = ["eval", "--model", "tiny-llama", "--reuse", "full-prefill,cacheblend:recompute=0.2", "--recipes",
            "full,snapkv@0.5", "--tasks", "multidoc_qa_1", "--lengths", "700", "--samples", "1",
            "--num-docs", "4", "--out", out, "--no-progress"]
    assert main(args) == 0
    assert "4 new rows" in capsys.readouterr().out
    from longlab.eval.report import load_rows

    rows = {r["recipe"]: r for r in load_rows(out)}
    assert set(rows) == {
        "full", "cacheblend:recompute=0.2", "snapkv@0.5", "cacheblend:recompute=0.2+snapkv@0.5"
    }
    assert rows["snapkv@0.5"]["kv_bytes_after"] < rows["full"]["kv_bytes_after"]
    assert rows["cacheblend:recompute=0.2+snapkv@0.5"]["extra"]["kv_recipe"] == "snapkv@0.5"
    assert main([*args[:6], "full,h2o@0.5", *args[7:]]) == 2
    assert "--recipes" in capsys.readouterr().err
