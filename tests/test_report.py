"""Tests for the report backend (longlab.eval.report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longlab.eval.report import (
    _pareto_front,
    family_of,
    main,
    method_of,
    plot_depth_length_heatmap,
    plot_pareto,
    plot_score_vs_ratio,
    ratio_of,
    summary_table,
    write_report,
)
from longlab.eval.store import DB_NAME, ResultStore

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _r(recipe: str, task: str, score: float, length: int = 1024, i: int = 0, **kw: object) -> dict:
    row = {
        "model": "m",
        "recipe": recipe,
        "method": method_of(recipe),
        "compression_ratio": ratio_of(recipe) or (0.0 if recipe == "full" else None),
        "task": task,
        "length": length,
        "sample_id": f"{task}-{length}-{i}",
        "score": score,
        "kv_bytes_before": 1000,
        "kv_bytes_after": 1000 if recipe == "full" else 500,
    }
    row.update(kw)
    return row


HAND_ROWS = [
    # length 1024: full a = (1+0)/2 -> 50, b = 100 ; snapkv a = 0, b = (1+0)/2 -> 50
    _r("full", "a", 1.0, i=0), _r("full", "a", 0.0, i=1),
    _r("full", "b", 1.0, i=0), _r("full", "b", 1.0, i=1),
    _r("snapkv@0.5", "a", 0.0, i=0), _r("snapkv@0.5", "a", 0.0, i=1),
    _r("snapkv@0.5", "b", 1.0, i=0), _r("snapkv@0.5", "b", 0.0, i=1),
    # length 2048: only task a, both recipes score 1
    _r("full", "a", 1.0, length=2048), _r("snapkv@0.5", "a", 1.0, length=2048),
]


def _tables(md: str) -> dict[str, dict[str, list[str]]]:
    """Parse the Markdown output into {title: {first cell: row cells}} (header row under "recipe")."""
    out: dict[str, dict[str, list[str]]] = {}
    title = ""
    for line in md.splitlines():
        if line.startswith("### "):
            title = line[4:]
            out[title] = {}
        elif line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[title][cells[0]] = cells
    return out


def test_method_ratio_family_of_names() -> None:
    assert method_of("full") == "full"
    assert method_of("snapkv@0.5") == "snapkv"
    assert method_of("adakv@0.75") == "adakv"
    assert method_of("streaming:budget=512") == "streaming"
    assert method_of("prism+snapkv@0.5+kivi2") == "snapkv"
    assert ratio_of("prism+snapkv@0.5+kivi2") == 0.5 and ratio_of("full") is None
    assert family_of("prism+snapkv@0.75+kivi2") == "prism+snapkv+kivi2"
    assert family_of("streaming:budget=512") == "streaming" and family_of("adakv@0.75") == "adakv"


def test_summary_table_hand_computed_means() -> None:
    t = _tables(summary_table(HAND_ROWS))
    one = t["m · length 1k · score ×100"]
    assert one["recipe"] == ["recipe", "a", "b", "avg", "n", "KV bytes after", "KV kept"]
    assert one["full"] == ["full", "50.0", "100.0", "75.0", "4", "1000 B", "100%"]
    assert one["snapkv@0.5"] == ["snapkv@0.5", "0.0", "50.0", "25.0", "4", "500 B", "50%"]
    rel = t["m · length 1k · score − full (×100, same model/task/length)"]
    assert rel["snapkv@0.5"] == ["snapkv@0.5", "-50.0", "-50.0", "-50.0"]
    assert "full" not in rel

    two = t["m · length 2k · score ×100"]
    assert two["recipe"][:3] == ["recipe", "a", "avg"]  # only the tasks run at this length
    assert two["full"][1:4] == ["100.0", "100.0", "1"]
    # all lengths: sample means (full a = 2/3, snapkv a = 1/3); relative = mean of per-length deltas
    both = t["m · all lengths · score ×100"]
    assert both["full"][1:4] == ["66.7", "100.0", "83.3"]
    assert both["snapkv@0.5"][1:4] == ["33.3", "50.0", "41.7"]
    rel_all = t["m · all lengths · score − full (×100, same model/task/length)"]
    assert rel_all["snapkv@0.5"][1:] == ["-25.0", "-50.0", "-37.5"]
    # full comes first
    assert list(both)[1:] == ["full", "snapkv@0.5"]


def test_summary_table_without_full_and_empty() -> None:
    md = summary_table([r for r in HAND_ROWS if r["recipe"] != "full"])
    assert "score − full" not in md and "0.0" in md
    assert "No results" in summary_table([])


ALL_RECIPES = ("full", "snapkv@0.25", "snapkv@0.5", "snapkv@0.75", "adakv@0.5", "adakv@0.75",
               "prism+snapkv@0.5+kivi2", "streaming:budget=512")


def _grid_rows(recipes: tuple[str, ...] = ALL_RECIPES) -> list[dict]:
    rows = []
    for recipe in recipes:
        ratio = ratio_of(recipe) or 0.0
        for length in (1024, 2048, 4096):
            for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
                score = max(0.0, 1.0 - ratio * depth * length / 4096)
                kv = 73728 * length  # SmolLM2-135M-like bytes per token
                rows.append(_r(recipe, "niah", score, length=length, i=int(depth * 100), depth=depth,
                               kv_bytes_before=kv, kv_bytes_after=int(kv * (1 - ratio)),
                               compression_ratio=None if recipe.startswith("streaming") else ratio))
    return rows


def _is_png(path: Path | None) -> bool:
    return path is not None and path.is_file() and path.stat().st_size > 1000 and \
        path.read_bytes()[:8] == PNG_MAGIC


def test_plots_write_png(tmp_path: Path) -> None:
    rows = _grid_rows()
    assert _is_png(plot_score_vs_ratio(rows, tmp_path / "ratio.png"))
    assert _is_png(plot_depth_length_heatmap(rows, tmp_path / "heat.png"))  # 8 recipes -> first 6
    assert _is_png(plot_pareto(rows, tmp_path / "pareto.png"))
    # a single recipe / single cell still plots
    assert _is_png(plot_depth_length_heatmap(rows[:1], tmp_path / "heat1.png"))


def test_pareto_front() -> None:
    pts = [(1.0, 50.0, "a"), (1.0, 50.0, "a2"), (2.0, 40.0, "dominated"), (3.0, 90.0, "b"), (0.5, 10.0, "c")]
    assert [p[2] for p in _pareto_front(pts)] == ["c", "a", "a2", "b"]


def test_plots_without_data_return_none(tmp_path: Path) -> None:
    rows = [_r("full", "a", 1.0, kv_bytes_after=None)]
    assert plot_score_vs_ratio(rows, tmp_path / "a.png") is None
    assert plot_depth_length_heatmap(rows, tmp_path / "b.png") is None
    assert plot_pareto(rows, tmp_path / "c.png") is None
    assert list(tmp_path.iterdir()) == []


def test_write_report(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        store.add_many(_grid_rows(("full", "snapkv@0.5", "adakv@0.5")) + HAND_ROWS)
    paths = write_report(tmp_path)
    assert set(paths) == {"markdown", "html", "score_vs_ratio", "pareto", "depth_length_heatmap"}
    md = paths["markdown"].read_text()
    assert "| recipe |" in md and "](score_vs_ratio.png)" in md and "](depth_length_heatmap.png)" in md
    html = paths["html"].read_text()
    assert "<table>" in html and 'src="pareto.png"' in html
    for key in ("score_vs_ratio", "pareto", "depth_length_heatmap"):
        assert _is_png(paths[key]) and paths[key].parent == tmp_path


def test_write_report_skips_plots_without_data(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        store.add_many(HAND_ROWS)  # no depth
    paths = write_report(tmp_path, html=False)
    assert "depth_length_heatmap" not in paths and "html" not in paths
    assert "depth_length_heatmap.png" not in paths["markdown"].read_text()


def test_write_report_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ResultStore(tmp_path).close()
    paths = write_report(tmp_path)
    assert set(paths) == {"markdown", "html"}
    assert "No results" in paths["markdown"].read_text()
    # a directory without a database: same message, no database is created
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "No results" in write_report(bare)["markdown"].read_text()
    assert not (bare / DB_NAME).exists()
    # CLI backend: a message and an exit status, not a traceback
    assert main(bare) == 1
    assert "no results" in capsys.readouterr().out
    assert main(tmp_path / "missing") == 2
    assert "not found" in capsys.readouterr().out


def test_prefill_table_hand_computed_means() -> None:
    from longlab.eval.report import prefill_table

    rows = [
        _r("full", "a", 1.0, i=0, run_key="f0", prefill_s=2.0),
        _r("full", "a", 0.0, i=1, run_key="f1", prefill_s=4.0),
        _r("prism", "a", 1.0, i=0, run_key="p0", prefill_s=6.0),
        _r("prism", "a", 1.0, i=1, run_key="p1", prefill_s=3.0),
        _r("snapkv@0.5", "a", 0.0, i=0, run_key="s0", prefill_s=1.0),  # no prefill policy: not listed
    ]
    metrics = {
        "p0": {"density": 0.2, "recall": 0.9, "rel_error": 0.1, "fallback": 0.0},
        "p1": {"density": 0.4, "recall": 0.7, "rel_error": 0.3, "fallback": 0.5},
    }
    t = _tables(prefill_table(rows, metrics))
    (title,) = t
    table = t[title]
    assert table["recipe"] == ["recipe", "score", "prefill s", "vs full", "density", "recall", "rel_error",
                               "fallback", "n"]
    assert table["full"] == ["full", "50.0", "3.00", "1.00×", "-", "-", "-", "-", "2"]
    assert table["prism"] == ["prism", "100.0", "4.50", "1.50×", "0.300", "0.800", "0.200", "0.250", "2"]
    assert "snapkv@0.5" not in table
    assert prefill_table(rows, {}) == ""
