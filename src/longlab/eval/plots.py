"""PNG plots of a results directory's rows (matplotlib's object API with the Agg canvas: no pyplot,
no global backend change). Each function returns the path it wrote, or ``None`` (and writes nothing)
when the rows hold no data for it. Scores are shown ×100.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .rows import Row, family_of, is_full, mean, recipe_order, row_ratio, scored, sort_key
from .tables import fmt_length

__all__ = ["MAX_HEATMAP_PANELS", "plot_depth_length_heatmap", "plot_pareto", "plot_score_vs_ratio"]

MAX_HEATMAP_PANELS = 6


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
    done = scored(rows)
    full_score = mean(r["score"] for r in done if is_full(str(r.get("recipe"))))
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in done:
        recipe = str(r.get("recipe"))
        ratio = row_ratio(r)
        if is_full(recipe) or ratio is None:
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
    ax.set_title(f"Score vs compression ratio ({len(done)} scored samples)")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]), top=max(100.0, ax.get_ylim()[1]) + 2)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9, frameon=True)
    return _save(fig, path)


def plot_depth_length_heatmap(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path | None:
    """Needle depth × context length heatmap of mean score ×100, one panel per recipe (up to 6).

    Uses rows with ``depth`` set; returns ``None`` (no file) when there are none.
    """
    drows = [r for r in scored(rows) if r.get("depth") is not None]
    if not drows:
        return None
    recipes = recipe_order(drows)
    shown = recipes[:MAX_HEATMAP_PANELS]
    depths = sorted({float(r["depth"]) for r in drows})
    lengths = sorted({r.get("length") for r in drows}, key=sort_key)
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
        ax.set_xticks(range(len(lengths)), [fmt_length(n) for n in lengths])
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
    for r in scored(rows):
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
    order = recipe_order(r for r in scored(rows) if str(r.get("recipe")) in per_recipe)
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
