"""``longlab report DIR``: ``report.md`` (and ``report.html``) with score tables and PNG plots.

The work is done in three modules, re-exported here: :mod:`~longlab.eval.rows` reads a results
directory (read-only) and picks one row per (sample, recipe); :mod:`~longlab.eval.tables` turns rows
into Markdown/HTML tables with 95% confidence intervals (:mod:`~longlab.eval.stats`) and paired
differences vs a baseline recipe; :mod:`~longlab.eval.plots` draws the PNGs. This module writes the
files: every one is rendered to a temporary name first and renamed into place only when all of them
are ready, so a failure leaves the previous report as it was.
"""

from __future__ import annotations

import html as _html
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..recipe import LonglabError
from .plots import plot_depth_length_heatmap, plot_pareto, plot_score_vs_ratio
from .rows import FULL, family_of, load_metrics, load_rows, method_of, one_per_sample, ratio_of, scored
from .store import DB_NAME
from .tables import (
    how_to_read,
    prefill_table,
    prefill_tables,
    score_table,
    score_tables,
    summary_table,
    table_html,
    table_md,
)

__all__ = [
    "FULL",
    "family_of",
    "load_metrics",
    "load_rows",
    "main",
    "method_of",
    "plot_depth_length_heatmap",
    "plot_pareto",
    "plot_score_vs_ratio",
    "prefill_table",
    "ratio_of",
    "report_markdown",
    "score_table",
    "summary_table",
    "write_report",
]

_PLOTS: tuple[tuple[str, str, Callable[..., Path | None]], ...] = (
    ("score_vs_ratio", "Score vs compression ratio", plot_score_vs_ratio),
    ("pareto", "Quality vs KV memory", plot_pareto),
    ("depth_length_heatmap", "Needle depth × length", plot_depth_length_heatmap),
)

_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
    "table{border-collapse:collapse;margin-bottom:1.5em}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}th{background:#f2f2f2}img{max-width:100%}"
)


def _target_dir(out: Path, report_dir: str | os.PathLike[str] | None, what: str) -> tuple[Path, str]:
    """The directory the report goes to (made when missing), checked writable by making a file in it."""
    if report_dir is None:
        target, arg = out, what
    else:
        target, arg = Path(report_dir), "--report-dir"
        if not os.fspath(report_dir).strip():
            raise LonglabError("--report-dir: empty path; give a directory")
        if target.exists() and not target.is_dir():
            raise LonglabError(f"--report-dir: {target} is a file, not a directory")
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            reason = err.strerror or err
            raise LonglabError(f"--report-dir: cannot create directory {target}: {reason}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=target, prefix=".longlab-report-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        hint = " (give --report-dir OTHER_DIR; the database itself is only read)"
        hint = "" if report_dir is not None else hint
        reason = err.strerror or err
        raise LonglabError(f"{arg}: cannot write the report into {target}: {reason}{hint}") from None
    return target, arg


def _render(
    out: Path, rows: list[dict[str, Any]], metrics: dict[str, dict[str, float]], *, baseline: str,
    all_configs: bool, plot_path: Callable[[str], Path] | None,
) -> tuple[list[str], list[str], dict[str, Path]]:
    """Markdown lines, HTML parts and the plots written (key -> temporary path; none when ``plot_path``
    is None)."""
    name = out.name or str(out)
    md: list[str] = [f"# longlab report: {name}", ""]
    html_parts: list[str] = [f"<h1>longlab report: {_html.escape(name)}</h1>"]
    plots: dict[str, Path] = {}
    if not rows:
        msg = f"No results in {out / DB_NAME}: run `longlab eval` with this directory as output first."
        return md + [msg], html_parts + [f"<p>{_html.escape(msg)}</p>"], plots
    selection = one_per_sample(rows, all_configs=all_configs)
    kept = selection.rows
    models = sorted({str(r.get("model")) for r in rows})
    versions = sorted({str(r.get("package_version")) for r in rows if r.get("package_version")})
    commits = sorted({str(r.get("git_commit")) for r in rows if r.get("git_commit")})
    intro = (
        f"{len(rows)} rows ({len(scored(rows))} scored, {len(scored(kept))} counted), "
        f"models: {', '.join(models)}; "
        f"longlab {', '.join(versions) or '?'}, commit {', '.join(commits) or '?'}."
    )
    md += [intro, ""]
    html_parts.append(f"<p>{_html.escape(intro)}</p>")
    tables, note = score_tables(rows, baseline=baseline, all_configs=all_configs)
    if note:
        md += [note, ""]
        html_parts.append(f"<p><strong>{_html.escape(note)}</strong></p>")
    reading = how_to_read(baseline)
    md += ["## Scores", "", reading, "", "\n\n".join(table_md(t) for t in tables)]
    html_parts += ["<h2>Scores</h2>", f"<p>{_html.escape(reading)}</p>", *(table_html(t) for t in tables)]
    prefill = prefill_tables(rows, metrics, all_configs=all_configs)
    if prefill:
        md += ["", "## Sparse prefill", "", "\n\n".join(table_md(t) for t in prefill)]
        html_parts += ["<h2>Sparse prefill</h2>", *(table_html(t) for t in prefill)]
    from .spec_tables import spec_markdown  # rows of `longlab eval --speculative` (longlab.spec)

    speculation = spec_markdown(rows)
    if speculation:
        md += ["", "## Speculative decoding", "", speculation]
        html_parts += ["<h2>Speculative decoding</h2>", f"<pre>{_html.escape(speculation)}</pre>"]
    figures: list[tuple[str, str]] = []
    for key, title, fn in _PLOTS if plot_path is not None else ():
        written = fn(kept, plot_path(key))
        if written is not None:
            plots[key] = written
            figures.append((title, f"{key}.png"))
    if figures:
        md += ["", "## Plots", ""]
        html_parts.append("<h2>Plots</h2>")
        for title, file_name in figures:
            md += [f"### {title}", "", f"![{title}]({file_name})", ""]
            esc = _html.escape(title)
            html_parts.append(f"<h3>{esc}</h3>\n<img src=\"{_html.escape(file_name)}\" alt=\"{esc}\">")
    return md, html_parts, plots


def _write_report(
    out_dir: str | os.PathLike[str], *, html: bool, baseline: str, all_configs: bool,
    report_dir: str | os.PathLike[str] | None, what: str,
) -> tuple[dict[str, Path], int]:
    if not isinstance(out_dir, (str, os.PathLike)) or not str(os.fspath(out_dir)).strip():
        raise LonglabError(f"{what}: expected a results directory path, got {out_dir!r}")
    out = Path(out_dir)
    if not out.exists():
        raise LonglabError(f"{what}: results directory not found: {out}")
    if not out.is_dir():
        raise LonglabError(f"{what}: {out} is a file, not a results directory")
    rows = load_rows(out, what=what)  # read-only: works on a database we may not write
    recipes = {str(r.get("recipe")) for r in rows}
    if rows and baseline != FULL and baseline not in recipes:
        raise LonglabError(
            f"--baseline: recipe {baseline!r} is not in the results; recipes: {', '.join(sorted(recipes))}"
        )
    metrics = load_metrics(out, what=what) if rows else {}
    target, arg = _target_dir(out, report_dir, what)

    temps: list[Path] = []

    def temp_path(key: str) -> Path:
        path = target / f".{key}.png.tmp-{os.getpid()}"
        temps.append(path)
        return path

    try:
        md, html_parts, plots = _render(
            out, rows, metrics, baseline=baseline, all_configs=all_configs, plot_path=temp_path
        )
        files: dict[str, tuple[Path, Path]] = {}  # key -> (temporary, final)
        md_tmp = target / f".report.md.tmp-{os.getpid()}"
        temps.append(md_tmp)
        md_tmp.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
        files["markdown"] = (md_tmp, target / "report.md")
        if html:
            html_tmp = target / f".report.html.tmp-{os.getpid()}"
            temps.append(html_tmp)
            body = "\n".join(html_parts)
            html_tmp.write_text(
                "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>longlab report</title>"
                f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n",
                encoding="utf-8",
            )
            files["html"] = (html_tmp, target / "report.html")
        for key, tmp in plots.items():
            files[key] = (tmp, target / f"{key}.png")
        for tmp, final in files.values():
            os.replace(tmp, final)
    except OSError as err:
        raise LonglabError(f"{arg}: cannot write the report into {target}: {err.strerror or err}") from None
    finally:
        for tmp in temps:
            try:
                tmp.unlink()
            except OSError:
                pass
    order = ["markdown", "html", *(key for key, _, _ in _PLOTS)]
    return {k: files[k][1] for k in order if k in files}, len(rows)


def report_markdown(
    out_dir: str | os.PathLike[str], *, baseline: str = FULL, all_configs: bool = False,
    what: str = "results directory",
) -> str:
    """The text of the ``report.md`` that :func:`write_report` would write for ``out_dir`` (its
    ``results.sqlite``, or the committed ``results.sqlite.gz``, only read), without the plots and
    without writing anything: the generated documentation pages take their tables from it."""
    out = Path(out_dir)
    if not out.is_dir():
        raise LonglabError(f"{what}: results directory not found: {out}")
    rows = load_rows(out, what=what)
    metrics = load_metrics(out, what=what) if rows else {}
    md, _, _ = _render(out, rows, metrics, baseline=baseline, all_configs=all_configs, plot_path=None)
    return "\n".join(md).rstrip() + "\n"


def write_report(
    out_dir: str | os.PathLike[str],
    *,
    html: bool = True,
    baseline: str = FULL,
    all_configs: bool = False,
    report_dir: str | os.PathLike[str] | None = None,
    what: str = "results directory",
) -> dict[str, Path]:
    """Write ``report.md`` (and ``report.html``) plus PNG plots; return their paths.

    The database in ``out_dir`` is only read; the files go to ``report_dir`` (default: ``out_dir``).
    Keys: ``markdown``, ``html``, and one per plot that had data (``score_vs_ratio``, ``pareto``,
    ``depth_length_heatmap``). An empty or missing store gives a report that says so. ``baseline``:
    the recipe the relative tables subtract; ``all_configs``: count every row, not one per (sample,
    recipe). Faults (missing directory, corrupt database, nowhere to write) raise a
    :class:`~longlab.recipe.LonglabError` naming ``what`` (or ``--report-dir``/``--baseline``).
    """
    paths, _ = _write_report(
        out_dir, html=html, baseline=baseline, all_configs=all_configs, report_dir=report_dir, what=what
    )
    return paths


def main(
    out_dir: str | os.PathLike[str],
    *,
    html: bool = True,
    baseline: str = FULL,
    all_configs: bool = False,
    report_dir: str | os.PathLike[str] | None = None,
) -> int:
    """CLI backend: write the report and print what was written; 1 when there are no results.

    Faults raise :class:`~longlab.recipe.LonglabError` (the CLI prints one line and exits 2)."""
    paths, n_rows = _write_report(
        out_dir, html=html, baseline=baseline, all_configs=all_configs, report_dir=report_dir,
        what="report DIR",
    )
    if not n_rows:
        print(f"longlab report: no results in {Path(out_dir) / DB_NAME} (wrote {paths['markdown']})")
        return 1
    for key, path in paths.items():
        print(f"{key:>22}: {path}")
    return 0
