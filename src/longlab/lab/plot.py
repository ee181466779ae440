"""The extrapolation plot and table: mean score vs test length, one line per mixer (recipe), one panel
per (model, task), with 95% intervals (Wilson for 0/1 scores, else a seeded bootstrap)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..eval.rows import load_rows
from ..eval.stats import score_estimate

__all__ = ["extrapolation_table", "lab_rows", "plot_results"]


def lab_rows(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return [r for r in load_rows(Path(results_dir), what="DIR") if str(r.get("model", "")).startswith("lab-")]


def _cells(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[int, list[float]]]:
    cells: dict[tuple[str, str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("score") is None:
            continue
        cells[(str(r["model"]), str(r["task"]), str(r["recipe"]))][int(r["length"])].append(float(r["score"]))
    return cells


def _interval(values: Sequence[float]) -> tuple[float, float, float]:
    est = score_estimate(values)
    return est.mean, est.low, est.high


def extrapolation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per (model, task) a table of mean score [95% CI] by mixer × length."""
    cells = _cells(rows)
    out: list[str] = []
    for model, task in sorted({(m, t) for m, t, _ in cells}):
        recipes = sorted(r for m, t, r in cells if (m, t) == (model, task))
        lengths = sorted({n for r in recipes for n in cells[(model, task, r)]})
        out += [f"**{model} · {task}** (mean score [95% CI], n samples × seeds per cell)", ""]
        out.append("| mixer | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for r in recipes:
            row = [r]
            for n in lengths:
                vals = cells[(model, task, r)].get(n)
                if not vals:
                    row.append("–")
                    continue
                mean, lo, hi = _interval(vals)
                row.append(f"{mean:.2f} [{lo:.2f}, {hi:.2f}] n={len(vals)}")
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def plot_results(results_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path | None:
    """Write the PNG; ``None`` when the directory holds no lab rows."""
    rows = lab_rows(results_dir)
    cells = _cells(rows)
    panels = sorted({(m, t) for m, t, _ in cells})
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (model, task) in zip(axes[0], panels):
        for recipe in sorted(r for m, t, r in cells if (m, t) == (model, task)):
            by_len = cells[(model, task, recipe)]
            xs = sorted(by_len)
            stats = [_interval(by_len[n]) for n in xs]
            (line,) = ax.plot(xs, [s[0] for s in stats], marker="o", label=recipe)
            lo, hi = [s[1] for s in stats], [s[2] for s in stats]
            ax.fill_between(xs, lo, hi, alpha=0.12, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length (tokens)")
        ax.set_ylabel("score")
        ax.set_title(f"{task} ({model})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
