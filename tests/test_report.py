"""Tests for the report backend (longlab.eval.report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longlab.cli import main as cli_main
from longlab.eval.plots import _pareto_front
from longlab.eval.report import (
    family_of,
    main,
    method_of,
    plot_depth_length_heatmap,
    plot_pareto,
    plot_score_vs_ratio,
    ratio_of,
    score_table,
    summary_table,
    write_report,
)
from longlab.eval.rows import one_per_sample
from longlab.eval.store import DB_NAME, ResultStore
from longlab.recipe import LonglabError

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


def test_summary_table_hand_computed_means_and_intervals() -> None:
    # Wilson 95%: k/n = 1/2 -> [9.5, 90.5], 2/2 -> [34.2, 100], 0/2 -> [0, 65.8], 1/1 -> [20.7, 100],
    # 2/3 -> [20.8, 93.9], 1/3 -> [6.1, 79.2] (centre and half-width of the Wilson formula, by hand).
    # avg (bootstrap stratified by task): full 1k resamples a in {0, .5, 1} (1/4, 1/2, 1/4), b = 1, so
    # the avg takes 0.5, 0.75, 1.0 and its 2.5% / 97.5% quantiles are 0.5 and 1.0 exactly.
    t = _tables(summary_table(HAND_ROWS))
    one = t["m · length 1k · score ×100 [95% CI]"]
    assert one["recipe"] == ["recipe", "a", "b", "avg", "n", "KV bytes after", "KV vs dense"]
    assert one["full"] == ["full", "50.0 [9.5, 90.5]", "100.0 [34.2, 100.0]", "75.0 [50.0, 100.0]", "2",
                           "1000 B", "100%"]
    assert one["snapkv@0.5"] == ["snapkv@0.5", "0.0 [0.0, 65.8]", "50.0 [9.5, 90.5]", "25.0 [0.0, 50.0]", "2",
                                 "500 B", "50%"]
    # paired differences on the same samples: a: d = (-1, 0), b: d = (0, -1); every resample mean lies
    # in {-1, -0.5, 0}, both ends are reached with probability 1/4 (avg: 1/16) > 2.5%: CI [-100, 0], n.s.
    rel = t["m · length 1k · score − full (×100, paired on the same samples) [95% CI]"]
    assert rel["recipe"] == ["recipe", "a", "b", "avg", "n"]
    assert rel["snapkv@0.5"] == ["snapkv@0.5", "-50.0 [-100.0, +0.0] n.s.", "-50.0 [-100.0, +0.0] n.s.",
                                 "-50.0 [-100.0, +0.0] n.s.", "2"]
    assert "full" not in rel

    two = t["m · length 2k · score ×100 [95% CI]"]
    assert two["recipe"][:3] == ["recipe", "a", "avg"]  # only the tasks run at this length
    assert two["full"][1:4] == ["100.0 [20.7, 100.0]", "100.0 [20.7, 100.0]", "1"]
    rel_two = t["m · length 2k · score − full (×100, paired on the same samples) [95% CI]"]
    assert rel_two["snapkv@0.5"][1:] == ["+0.0 [+0.0, +0.0] n.s.", "+0.0 [+0.0, +0.0] n.s.", "1"]
    # all lengths: pooled sample means (full a = 2/3, snapkv a = 1/3); cells carry their own n when the
    # row's cells differ in n; relative = mean of the per-length paired differences
    both = t["m · all lengths · score ×100 [95% CI]"]
    assert both["full"][1:3] == ["66.7 [20.8, 93.9] (n=3)", "100.0 [34.2, 100.0] (n=2)"]
    assert both["full"][4] == "2-3"
    assert both["snapkv@0.5"][1:3] == ["33.3 [6.1, 79.2] (n=3)", "50.0 [9.5, 90.5] (n=2)"]
    assert both["full"][3].startswith("83.3 [") and both["snapkv@0.5"][3].startswith("41.7 [")
    rel_all = t["m · all lengths · score − full (×100, paired on the same samples) [95% CI]"]
    # a: (mean over 1k pairs + 0 at 2k) / 2 takes -0.5, -0.25, 0 -> CI [-50, 0]; avg weights 1/4, 1/4, 1/2
    assert rel_all["snapkv@0.5"][1:] == ["-25.0 [-50.0, +0.0] (n=3) n.s.", "-50.0 [-100.0, +0.0] (n=2) n.s.",
                                         "-37.5 [-75.0, +0.0] n.s.", "2-3"]
    # full comes first
    assert list(both)[1:] == ["full", "snapkv@0.5"]


def test_clearly_better_recipe_is_significant_and_the_sentence_says_how_to_read() -> None:
    rows = []
    for i in range(24):
        rows.append(_r("full", "a", 1.0 if i < 2 else 0.0, i=i))
        rows.append(_r("better", "a", 0.0 if i < 2 else 1.0, i=i))
        rows.append(_r("same", "a", 1.0 if i < 2 else 0.0, i=i))
    md = score_table(rows)
    t = _tables(md)
    rel = t["m · length 1k · score − full (×100, paired on the same samples) [95% CI]"]
    diff = rel["better"][1]
    assert diff.startswith("+83.3 [") and "n.s." not in diff  # 22 of 24 gained, 2 lost
    assert float(diff.split("[")[1].split(",")[0]) > 50
    assert rel["same"][1] == "+0.0 [+0.0, +0.0] n.s."
    abs_cells = t["m · length 1k · score ×100 [95% CI]"]
    assert abs_cells["better"][1:3] == ["91.7 [74.2, 97.7]", "91.7 [74.2, 97.7]"]  # Wilson 22/24
    assert abs_cells["better"][3] == "24"
    assert "How to read:" in md and "n.s." in md.splitlines()[-1]
    assert "How to read:" not in summary_table(rows)  # the older name prints the tables only


def test_graded_scores_get_a_bootstrap_interval() -> None:
    scores = [0.25, 0.5, 0.75, 1.0] * 6
    rows = [_r("full", "qa", s, i=i) for i, s in enumerate(scores)]
    cell = _tables(score_table(rows))["m · length 1k · score ×100 [95% CI]"]["full"][1]
    mean, low, high = (float(x) for x in cell.replace("[", "").replace("]", "").replace(",", "").split())
    assert mean == 62.5 and low < mean < high
    # percentile bootstrap: half-width close to 1.96 * sd / sqrt(n) = 1.96 * 0.2795 / sqrt(24) * 100
    assert abs((high - low) / 2 - 11.2) < 1.5
    assert cell == _tables(score_table(rows))["m · length 1k · score ×100 [95% CI]"]["full"][1]  # seeded


def test_one_row_per_sample_and_recipe_newest_first() -> None:
    old = [_r("full", "a", 0.0, i=i, config_hash="c1", created_at="2026-01-01T00:00:00+00:00", id=i + 1)
           for i in range(2)]
    new = [_r("full", "a", 1.0, i=i, config_hash="c2", created_at="2026-02-01T00:00:00+00:00", id=i + 10)
           for i in range(2)]
    rows = new + old  # order of the list does not decide which is newest
    sel = one_per_sample(rows)
    assert [r["score"] for r in sel.rows] == [1.0, 1.0] and sel.dropped == 2 and sel.duplicated == 2
    md = summary_table(rows)
    t = _tables(md)
    assert t["m · length 1k · score ×100 [95% CI]"]["full"][1:2] == ["100.0 [34.2, 100.0]"]
    assert "Note: 2 older rows of 2 (sample, recipe) pairs" in md and "--all-configs" in md
    md_all = summary_table(rows, all_configs=True)
    assert _tables(md_all)["m · length 1k · score ×100 [95% CI]"]["full"][1:2] == ["50.0 [15.0, 85.0]"]
    assert "every row is counted" in md_all
    # same created_at: the later insertion (id) wins; no duplicates: no note
    tie = [dict(old[0], score=0.5, id=99), old[0]]
    assert one_per_sample(tie).rows[0]["score"] == 0.5
    assert "Note" not in summary_table(HAND_ROWS)


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
    with pytest.raises(LonglabError, match="report DIR: results directory not found"):
        main(tmp_path / "missing")
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "report DIR: results directory not found" in err and "Traceback" not in err


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
    assert table["recipe"] == ["recipe", "score [95% CI]", "prefill s", "vs full", "density", "recall",
                               "rel_error", "fallback", "n"]
    assert table["full"] == ["full", "50.0 [9.5, 90.5]", "3.00", "1.00×", "-", "-", "-", "-", "2"]
    assert table["prism"] == ["prism", "100.0 [34.2, 100.0]", "4.50", "1.50×", "0.300", "0.800", "0.200",
                              "0.250", "2"]
    assert "snapkv@0.5" not in table
    assert prefill_table(rows, {}) == ""


def test_write_report_says_how_to_read_and_notes_left_out_rows(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        store.add_many(HAND_ROWS)
        store.add_many([dict(r, config_hash="other", score=1.0 - r["score"]) for r in HAND_ROWS[:4]])
    md = write_report(tmp_path, html=False)["markdown"].read_text()
    assert "How to read:" in md and "n.s." in md
    assert "Note: 4 older rows of 4 (sample, recipe) pairs" in md
    assert "14 rows (14 scored, 10 counted)" in md
    md_all = write_report(tmp_path, html=False, all_configs=True)["markdown"].read_text()
    assert "every row is counted" in md_all and "14 counted" in md_all


def test_write_report_baseline_and_report_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ResultStore(tmp_path) as store:
        store.add_many(HAND_ROWS)
    elsewhere = tmp_path / "elsewhere" / "deep"
    assert cli_main(["report", str(tmp_path), "--baseline", "snapkv@0.5", "--report-dir", str(elsewhere),
                     "--no-html"]) == 0
    md = (elsewhere / "report.md").read_text()
    assert "score − snapkv@0.5 (×100, paired" in md and "score − full" not in md
    assert not (tmp_path / "report.md").exists()
    t = _tables(md)
    assert t["m · length 1k · score − snapkv@0.5 (×100, paired on the same samples) [95% CI]"]["full"][1] == \
        "+50.0 [+0.0, +100.0] n.s."
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path), "--baseline", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--baseline: recipe 'nosuch' is not in the results" in err and "Traceback" not in err
    assert not (tmp_path / "report.md").exists()  # nothing half-written
    (tmp_path / "afile").write_text("x")
    assert cli_main(["report", str(tmp_path), "--report-dir", str(tmp_path / "afile")]) == 2
    assert "--report-dir:" in capsys.readouterr().err


def test_write_report_failure_leaves_previous_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ResultStore(tmp_path) as store:
        store.add_many(_grid_rows(("full", "snapkv@0.5")))
    first = write_report(tmp_path)
    before = {k: p.read_bytes() for k, p in first.items()}

    def boom(rows, path):  # the last plot fails after the others were drawn
        raise OSError(28, "No space left on device")

    import longlab.eval.report as report_mod

    plots = list(report_mod._PLOTS)
    plots[-1] = (plots[-1][0], plots[-1][1], boom)
    monkeypatch.setattr(report_mod, "_PLOTS", tuple(plots))
    with ResultStore(tmp_path) as store:
        store.add_many(HAND_ROWS)
    with pytest.raises(LonglabError, match="cannot write the report .*No space left"):
        write_report(tmp_path)
    assert {k: p.read_bytes() for k, p in first.items()} == before  # old report untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries


def test_report_markdown_is_the_report_text_without_plots_and_reads_a_packed_store(tmp_path: Path) -> None:
    """report_markdown gives report.md's tables from the store alone (the generated docs pages read the
    committed results.sqlite.gz through it), writes nothing, and honours the baseline."""
    import gzip
    import shutil

    from longlab.eval.report import report_markdown

    live = tmp_path / "live"
    with ResultStore(live) as store:
        store.add_many(HAND_ROWS)
    written = write_report(live, html=False)["markdown"].read_text()
    text = report_markdown(live)
    assert text.rstrip() == written.split("## Plots")[0].rstrip() and "## Plots" not in text
    packed = tmp_path / "packed"
    packed.mkdir()
    with open(live / DB_NAME, "rb") as src, gzip.open(packed / f"{DB_NAME}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert _tables(report_markdown(packed)) == _tables(text)
    assert sorted(p.name for p in packed.iterdir()) == [f"{DB_NAME}.gz"]  # only read
    vs = _tables(report_markdown(packed, baseline="snapkv@0.5"))
    title = "m · length 1k · score − snapkv@0.5 (×100, paired on the same samples) [95% CI]"
    assert vs[title]["full"][1] == "+50.0 [+0.0, +100.0] n.s."
    with pytest.raises(LonglabError, match="results directory not found"):
        report_markdown(tmp_path / "nosuch")
