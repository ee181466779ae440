"""``longlab report DIR``: Markdown/HTML tables and PNG plots from a results directory.

Scores are shown ×100. A table cell is the mean score of the samples of one recipe on one task (and
length); ``avg`` is the mean of the task cells of that row (every task weighs the same). The
relative table subtracts the ``full`` recipe's cell of the same model, task and length; over all
lengths it averages those per-length differences, so recipes measured at different lengths are
still compared like for like.

Recipes with a sparse prefill policy run with ``--prefill-metrics`` get one more table per model and
length: mean score, prefill seconds (and their ratio to ``full``'s), and the mean over samples of
the whole-model density, attention recall, relative output error and dense-fallback fraction stored
in the ``metrics`` table (``layer = head = -1``).

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend change).
"""

from __future__ import annotations

import html as _html
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .store import DB_NAME, ResultStore

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
    "summary_table",
    "write_report",
]

FULL = "full"
MAX_HEATMAP_PANELS = 6

Row = Mapping[str, Any]
Table = tuple[str, list[str], list[list[str]]]  # (title, header, body)


# --------------------------------------------------------------------------------------------------
# recipe names


def method_of(recipe_name: str) -> str:
    """Method of a recipe name, for rows that lack ``method``.

    The last ``+``-part that carries ``@ratio`` decides (``prism+snapkv@0.5+kivi2`` -> ``snapkv``);
    without one, the last part with ``:params`` (``streaming:budget=512`` -> ``streaming``), else
    the last part (``full`` -> ``full``).
    """
    parts = [p.strip() for p in str(recipe_name).split("+") if p.strip()]
    if not parts:
        return str(recipe_name)
    for marker in ("@", ":"):
        tagged = [p for p in parts if marker in p]
        if tagged:
            return re.split(r"[@:]", tagged[-1], maxsplit=1)[0]
    return parts[-1]


def ratio_of(recipe_name: str) -> float | None:
    """Compression ratio written in a recipe name (last ``@x``), or ``None``."""
    found = re.findall(r"@([0-9]*\.?[0-9]+)", str(recipe_name))
    return float(found[-1]) if found else None


def family_of(recipe_name: str) -> str:
    """Recipe name with ratios and parameters removed: the line a recipe belongs to in a ratio plot.

    ``snapkv@0.5`` -> ``snapkv``; ``prism+snapkv@0.75+kivi2`` -> ``prism+snapkv+kivi2``;
    ``streaming:budget=512`` -> ``streaming``.
    """
    parts = [re.split(r"[@:]", p.strip(), maxsplit=1)[0] for p in str(recipe_name).split("+")]
    return "+".join(p for p in parts if p) or str(recipe_name)


def _method(row: Row) -> str:
    return str(row.get("method") or method_of(str(row.get("recipe"))))


def _ratio(row: Row) -> float | None:
    value = row.get("compression_ratio")
    if value is None:
        return ratio_of(str(row.get("recipe")))
    return float(value)


def _is_full(recipe: str) -> bool:
    return recipe == FULL


def _recipe_order(rows: Iterable[Row]) -> list[str]:
    """Recipes sorted: ``full`` first, then by method, compression ratio and name."""
    info: dict[str, tuple[Any, ...]] = {}
    for r in rows:
        name = str(r.get("recipe"))
        if name not in info:
            ratio = _ratio(r)
            info[name] = (not _is_full(name), family_of(name), ratio is None, ratio or 0.0, name)
    return sorted(info, key=lambda n: info[n])


def _sort_key(value: Any) -> tuple[bool, Any]:
    return (value is None, value if value is not None else 0)


# --------------------------------------------------------------------------------------------------
# small numeric helpers


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_length(n: Any) -> str:
    if n is None:
        return "?"
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _scored(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.get("score") is not None]


# --------------------------------------------------------------------------------------------------
# tables


def _cells(rows: Sequence[Row]) -> dict[tuple[Any, ...], float]:
    """Mean score ×100 per (model, length, recipe, task)."""
    groups: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for r in _scored(rows):
        key = (r.get("model"), r.get("length"), str(r.get("recipe")), r.get("task"))
        groups[key].append(float(r["score"]))
    return {k: 100.0 * sum(v) / len(v) for k, v in groups.items()}


def _summary_tables(rows: Sequence[Row]) -> list[Table]:
    """All summary tables: per model, over all lengths then per length; absolute then vs ``full``."""
    rows = list(rows)
    if not rows:
        return []
    cells = _cells(rows)
    models = sorted({r.get("model") for r in rows}, key=lambda m: _sort_key(None if m is None else str(m)))
    tables: list[Table] = []
    for model in models:
        mrows = [r for r in rows if r.get("model") == model]
        lengths = sorted({r.get("length") for r in mrows}, key=_sort_key)
        scopes: list[tuple[str, list[Any]]] = []
        if len(lengths) > 1:
            scopes.append(("all lengths", lengths))
        scopes.extend((f"length {_fmt_length(n)}", [n]) for n in lengths)
        for scope_name, scope_lengths in scopes:
            srows = [r for r in mrows if r.get("length") in scope_lengths]
            tables.extend(_scope_tables(srows, cells, model, scope_name, scope_lengths))
    return tables


def _scope_tables(
    rows: Sequence[Row], cells: Mapping[tuple[Any, ...], float], model: Any, scope: str, lengths: list[Any]
) -> list[Table]:
    tasks = sorted({r.get("task") for r in rows}, key=lambda t: _sort_key(None if t is None else str(t)))
    recipes = _recipe_order(rows)
    by_recipe: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_recipe[str(r.get("recipe"))].append(r)

    def sample_mean(recipe: str, task: Any) -> float | None:
        vals = [r.get("score") for r in by_recipe[recipe] if r.get("task") == task]
        m = _mean(vals)
        return None if m is None else 100.0 * m

    header = ["recipe", *[str(t) for t in tasks], "avg", "n", "KV bytes after", "KV kept"]
    body: list[list[str]] = []
    for recipe in recipes:
        task_means = [sample_mean(recipe, t) for t in tasks]
        rr = by_recipe[recipe]
        kv_after = _mean(r.get("kv_bytes_after") for r in rr)
        kv_before = _mean(r.get("kv_bytes_before") for r in rr)
        kept = f"{100.0 * kv_after / kv_before:.0f}%" if kv_after is not None and kv_before else "-"
        n = len(_scored(rr))
        avg = _fmt(_mean(task_means))
        body.append([recipe, *[_fmt(m) for m in task_means], avg, str(n), _fmt_bytes(kv_after), kept])
    title = f"{model} · {scope} · score ×100"
    out: list[Table] = [(title, header, body)]

    if FULL in by_recipe and len(recipes) > 1:
        rel_body: list[list[str]] = []
        for recipe in recipes:
            if _is_full(recipe):
                continue
            deltas = []
            for t in tasks:
                per_length = [
                    cells[(model, n, recipe, t)] - cells[(model, n, FULL, t)]
                    for n in lengths
                    if (model, n, recipe, t) in cells and (model, n, FULL, t) in cells
                ]
                deltas.append(_mean(per_length))
            cells_txt = [_fmt(d, signed=True) for d in deltas]
            rel_body.append([recipe, *cells_txt, _fmt(_mean(deltas), signed=True)])
        rel_title = f"{model} · {scope} · score − full (×100, same model/task/length)"
        out.append((rel_title, ["recipe", *[str(t) for t in tasks], "avg"], rel_body))
    return out


PREFILL_METRICS = ("density", "recall", "rel_error", "fallback")


def _prefill_tables(rows: Sequence[Row], metrics: Mapping[str, Mapping[str, float]]) -> list[Table]:
    """Per model and length: score, prefill seconds and mean sparse-prefill quality per recipe.

    Only when some row has metrics; lists those recipes and ``full`` (the dense reference)."""
    with_metrics = {str(r.get("recipe")) for r in rows if r.get("run_key") in metrics}
    if not with_metrics:
        return []
    tables: list[Table] = []
    models = sorted({r.get("model") for r in rows}, key=lambda m: _sort_key(None if m is None else str(m)))
    for model in models:
        mrows = [r for r in rows if r.get("model") == model]
        for length in sorted({r.get("length") for r in mrows}, key=_sort_key):
            lrows = [r for r in mrows if r.get("length") == length]
            recipes = [n for n in _recipe_order(lrows) if n in with_metrics or _is_full(n)]
            if not any(n in with_metrics for n in recipes):
                continue
            by_recipe: dict[str, list[Row]] = defaultdict(list)
            for r in lrows:
                by_recipe[str(r.get("recipe"))].append(r)
            full_s = _mean(r.get("prefill_s") for r in by_recipe.get(FULL, []))
            header = ["recipe", "score", "prefill s", "vs full", *PREFILL_METRICS, "n"]
            body: list[list[str]] = []
            for recipe in recipes:
                rr = by_recipe[recipe]
                score = _mean(r.get("score") for r in rr)
                pre = _mean(r.get("prefill_s") for r in rr)
                ratio = f"{pre / full_s:.2f}×" if pre is not None and full_s else "-"
                cells = []
                for name in PREFILL_METRICS:
                    value = _mean(metrics.get(str(r.get("run_key")), {}).get(name) for r in rr)
                    cells.append("-" if value is None else f"{value:.3f}")
                body.append([
                    recipe, _fmt(None if score is None else 100.0 * score),
                    "-" if pre is None else f"{pre:.2f}", ratio, *cells, str(len(_scored(rr))),
                ])
            title = f"{model} · length {_fmt_length(length)} · sparse prefill (means over samples)"
            tables.append((title, header, body))
    return tables


def prefill_table(rows: Sequence[Row], metrics: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown tables of :func:`_prefill_tables` (empty string when no row has prefill metrics).

    ``metrics``: run_key -> {name: whole-model value} (:func:`load_metrics`)."""
    return "\n\n".join(_table_md(t) for t in _prefill_tables(rows, metrics))


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _table_md(table: Table) -> str:
    title, header, body = table
    lines = [f"### {title}", "", "| " + " | ".join(_md_escape(h) for h in header) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    lines.extend("| " + " | ".join(_md_escape(c) for c in row) + " |" for row in body)
    return "\n".join(lines)


def _table_html(table: Table) -> str:
    title, header, body = table
    esc = _html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<h3>{esc(title)}</h3>\n<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{rows}</tbody>\n</table>"


def summary_table(rows: Sequence[Row]) -> str:
    """Markdown tables: mean score ×100 per recipe × task (+ avg, n, KV bytes), and vs ``full``.

    One block per model; within it one for all lengths (when there are several) and one per length.
    """
    tables = _summary_tables(rows)
    if not tables:
        return "_No results._\n"
    return "\n\n".join(_table_md(t) for t in tables) + "\n"


# --------------------------------------------------------------------------------------------------
# plots


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_score_vs_ratio(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path | None:
    """Line per recipe family (x: compression ratio, y: mean score ×100); ``full`` dashed.

    Means are over every scored sample (all tasks and lengths). Returns ``None`` (no file) when no
    compressed row has a ratio.
    """
    scored = _scored(rows)
    full_score = _mean(r["score"] for r in scored if _is_full(str(r.get("recipe"))))
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in scored:
        recipe = str(r.get("recipe"))
        ratio = _ratio(r)
        if _is_full(recipe) or ratio is None:
            continue
        points[family_of(recipe)][ratio].append(float(r["score"]))
    if not points:
        return None
    fig = _new_figure(7.0, 4.6)
    ax = fig.add_subplot()
    markers = "osD^vP*Xh<>"
    for i, family in enumerate(sorted(points)):
        xs = sorted(points[family])
        ys = [100.0 * sum(points[family][x]) / len(points[family][x]) for x in xs]
        ax.plot(xs, ys, marker=markers[i % len(markers)], linewidth=1.8, label=family)
    if full_score is not None:
        ax.axhline(100.0 * full_score, color="black", linestyle="--", linewidth=1.4, label="full cache")
    ax.set_xlabel("compression ratio (fraction of KV cache evicted)")
    ax.set_ylabel("mean score ×100")
    ax.set_title(f"Score vs compression ratio ({len(scored)} scored samples)")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]), top=max(100.0, ax.get_ylim()[1]) + 2)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9, frameon=True)
    return _save(fig, path)


def plot_depth_length_heatmap(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path | None:
    """Needle depth × context length heatmap of mean score ×100, one panel per recipe (up to 6).

    Uses rows with ``depth`` set; returns ``None`` (no file) when there are none.
    """
    drows = [r for r in _scored(rows) if r.get("depth") is not None]
    if not drows:
        return None
    recipes = _recipe_order(drows)
    shown = recipes[:MAX_HEATMAP_PANELS]
    depths = sorted({float(r["depth"]) for r in drows})
    lengths = sorted({r.get("length") for r in drows}, key=_sort_key)
    cells: dict[tuple[str, float, Any], list[float]] = defaultdict(list)
    for r in drows:
        cells[(str(r.get("recipe")), float(r["depth"]), r.get("length"))].append(float(r["score"]))

    ncols = min(3, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    cell_w = max(0.55, min(0.9, 6.0 / max(len(lengths), 1)))
    width = ncols * (1.6 + cell_w * len(lengths)) + 1.2
    height = nrows * (1.2 + 0.38 * len(depths)) + 0.8
    fig = _new_figure(width, height)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    annotate = len(depths) * len(lengths) <= 120
    image = None
    for idx, recipe in enumerate(shown):
        ax = axes[idx // ncols][idx % ncols]
        grid = [[math.nan] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                vals = cells.get((recipe, d, n))
                if vals:
                    grid[i][j] = 100.0 * sum(vals) / len(vals)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(lengths)), [_fmt_length(n) for n in lengths])
        depth_labels = [f"{d:.0%}" if max(depths) <= 1.0 else f"{d:g}" for d in depths]
        ax.set_yticks(range(len(depths)), depth_labels)
        if idx // ncols == nrows - 1 or idx + ncols >= len(shown):
            ax.set_xlabel("context length (tokens)")
            ax.tick_params(labelbottom=True)
        if idx % ncols == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(recipe, fontsize=10)
        if annotate:
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    v = grid[i][j]
                    if not math.isnan(v):
                        color = "white" if v >= 85 or v <= 15 else "black"  # dark ends of RdYlGn
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8, color=color)
    for idx in range(len(shown), nrows * ncols):
        axes[idx // ncols][idx % ncols].set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="score ×100")
    more = f" (first {len(shown)} of {len(recipes)} recipes)" if len(recipes) > len(shown) else ""
    fig.suptitle(f"Needle retrieval: depth × length{more}")
    return _save(fig, path)


def _pareto_front(points: Sequence[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points no other point dominates (as few bytes or fewer and a higher score), sorted by bytes.

    Identical points are all kept.
    """
    front: list[tuple[float, float, str]] = []
    for x, y, name in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1] or (x, y) == front[-1][:2]:
            front.append((x, y, name))
    return front


def plot_pareto(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path | None:
    """Mean score ×100 vs mean KV bytes after compression, one marker per recipe, Pareto front drawn.

    Returns ``None`` (no file) when no scored row has ``kv_bytes_after``.
    """
    per_recipe: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in _scored(rows):
        if r.get("kv_bytes_after") is None:
            continue
        scores, sizes = per_recipe[str(r.get("recipe"))]
        scores.append(float(r["score"]))
        sizes.append(float(r["kv_bytes_after"]))
    if not per_recipe:
        return None
    points = [
        (sum(sz) / len(sz), 100.0 * sum(sc) / len(sc), name)
        for name, (sc, sz) in per_recipe.items()
    ]
    order = _recipe_order(r for r in _scored(rows) if str(r.get("recipe")) in per_recipe)
    points.sort(key=lambda p: order.index(p[2]))
    front = _pareto_front(points)
    front_names = {p[2] for p in front}

    fig = _new_figure(7.4, 4.8)
    ax = fig.add_subplot()
    xs = [p[0] for p in points]
    use_log = min(xs) > 0 and max(xs) / min(xs) > 20
    scale, unit = next(
        ((s, u) for s, u in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")) if max(xs) >= s), (1, "B")
    )
    markers = "osD^vP*Xh<>"
    for i, (x, y, name) in enumerate(points):
        on_front = name in front_names
        ax.scatter(
            [x / scale], [y], s=70 if on_front else 45, marker=markers[i % len(markers)],
            edgecolors="black" if on_front else "none", linewidths=1.0, zorder=3, label=name,
        )
    ax.step(
        [p[0] / scale for p in front], [p[1] for p in front], where="post", color="grey",
        linestyle="--", linewidth=1.2, zorder=2, label="Pareto front",
    )
    if use_log:
        ax.set_xscale("log")
    ax.set_xlabel(f"mean KV cache size after compression ({unit}{', log scale' if use_log else ''})")
    ax.set_ylabel("mean score ×100")
    ax.set_title("Quality vs memory (up and left is better; outlined: Pareto-optimal)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# report files


def load_rows(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of ``DIR/results.sqlite`` (empty list when the file does not exist; nothing is created)."""
    if not (Path(out_dir) / DB_NAME).is_file():
        return []
    with ResultStore(out_dir) as store:
        return store.rows()


def load_metrics(out_dir: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """Whole-model metrics (``layer = head = -1``) of ``DIR/results.sqlite``: run_key -> {name: value}."""
    if not (Path(out_dir) / DB_NAME).is_file():
        return {}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    with ResultStore(out_dir) as store:
        for m in store.metrics(layer=-1, head=-1):
            if m["value"] is not None:
                out[m["run_key"]][m["name"]] = float(m["value"])
    return dict(out)


_PLOTS = (
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


def write_report(out_dir: str | os.PathLike[str], *, html: bool = True) -> dict[str, Path]:
    """Write ``report.md`` (and ``report.html``) plus PNG plots into ``out_dir``; return their paths.

    Keys: ``markdown``, ``html``, and one per plot that had data (``score_vs_ratio``, ``pareto``,
    ``depth_length_heatmap``). An empty or missing store gives a report that says so.
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"results directory not found: {out}")
    rows = load_rows(out)
    paths: dict[str, Path] = {}
    md: list[str] = [f"# longlab report: {out.name or out}", ""]
    html_parts: list[str] = [f"<h1>longlab report: {_html.escape(out.name or str(out))}</h1>"]
    if not rows:
        msg = f"No results in {out / DB_NAME}: run `longlab eval` with this directory as output first."
        md.append(msg)
        html_parts.append(f"<p>{_html.escape(msg)}</p>")
    else:
        n_scored = len(_scored(rows))
        models = sorted({str(r.get("model")) for r in rows})
        versions = sorted({str(r.get("package_version")) for r in rows if r.get("package_version")})
        commits = sorted({str(r.get("git_commit")) for r in rows if r.get("git_commit")})
        intro = (
            f"{len(rows)} rows ({n_scored} scored), models: {', '.join(models)}; "
            f"longlab {', '.join(versions) or '?'}, commit {', '.join(commits) or '?'}."
        )
        md += [intro, "", "## Scores", ""]
        html_parts += [f"<p>{_html.escape(intro)}</p>", "<h2>Scores</h2>"]
        tables = _summary_tables(rows)
        md.append("\n\n".join(_table_md(t) for t in tables))
        html_parts.extend(_table_html(t) for t in tables)
        prefill = _prefill_tables(rows, load_metrics(out))
        if prefill:
            md += ["", "## Sparse prefill", ""]
            html_parts.append("<h2>Sparse prefill</h2>")
            md.append("\n\n".join(_table_md(t) for t in prefill))
            html_parts.extend(_table_html(t) for t in prefill)
        figures: list[tuple[str, Path]] = []
        for key, title, fn in _PLOTS:
            written = fn(rows, out / f"{key}.png")
            if written is not None:
                paths[key] = written
                figures.append((title, written))
        if figures:
            md += ["", "## Plots", ""]
            html_parts.append("<h2>Plots</h2>")
            for title, fig_path in figures:
                md += [f"### {title}", "", f"![{title}]({fig_path.name})", ""]
                html_parts.append(
                    f"<h3>{_html.escape(title)}</h3>\n<img src=\"{_html.escape(fig_path.name)}\" "
                    f"alt=\"{_html.escape(title)}\">"
                )
    md_path = out / "report.md"
    md_path.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    paths = {"markdown": md_path, **paths}
    if html:
        html_path = out / "report.html"
        body = "\n".join(html_parts)
        html_path.write_text(
            "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>longlab report</title>"
            f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n",
            encoding="utf-8",
        )
        paths["html"] = html_path
    return paths


def main(out_dir: str | os.PathLike[str], *, html: bool = True) -> int:
    """CLI backend: write the report, print what was written (or why not); return an exit status."""
    try:
        paths = write_report(out_dir, html=html)
    except FileNotFoundError as err:
        print(f"longlab report: {err}")
        return 2
    if set(paths) <= {"markdown", "html"} and not load_rows(out_dir):
        print(f"longlab report: no results in {Path(out_dir) / DB_NAME} (wrote {paths['markdown']})")
        return 1
    for key, path in paths.items():
        print(f"{key:>22}: {path}")
    return 0
