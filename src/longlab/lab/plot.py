"""The extrapolation plot and table: mean score vs test length, one line per mixer (recipe), one panel
per (model, task, training steps), with 95% intervals.

Intervals: with one training seed in a cell, the interval covers the sampling of test sequences only
(Wilson for 0/1 scores, else a seeded bootstrap). With ``s ≥ 2`` training seeds (every seed is tested on the
same sequences) it is the hull of two intervals: the Student-t interval over the ``s`` per-seed means
(``mean ± t_{0.975, s−1}·sd/√s``: training seeds) and the interval over the test sequences of their
seed-averaged scores (test sampling), clipped to the score range; so it is never narrower than either.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..eval.rows import load_rows
from ..eval.stats import score_estimate

__all__ = ["cell_estimate", "extrapolation_table", "lab_rows", "plot_results"]

Cells = dict[tuple[str, str, str], dict[int, dict[int, dict[str, float]]]]


def lab_rows(results_dir: str | os.PathLike[str], skip: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The lab's rows of a results directory, without those whose task spec contains any of ``skip``."""
    return [r for r in load_rows(Path(results_dir), what="DIR") if str(r.get("model", "")).startswith("lab-")
            and not any(s in str(r.get("task", "")) for s in skip)]


def _cells(rows: Sequence[Mapping[str, Any]]) -> Cells:
    """``(model, task + training steps, recipe) -> length -> training seed -> {sample id: score}``."""
    cells: Cells = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        extra = r.get("extra") or {}
        if r.get("score") is None or extra.get("answers_per_sample") == 0:
            continue  # a sequence with no scored position (flip-flop without a read) has no score
        steps = extra.get("train_steps")
        task = str(r["task"]) + (f", {steps} steps" if steps else "")
        key = (str(r["model"]), task, str(r["recipe"]))
        cells[key][int(r["length"])][int(r.get("seed") or 0)][str(r.get("sample_id"))] = float(r["score"])
    return cells


def cell_estimate(
    by_seed: Mapping[int, Mapping[str, float] | Sequence[float]], clip: bool = True,
) -> tuple[float, float, float, str]:
    """``(mean, low, high, what)`` of one cell (see the module docstring); ``what`` names the n.
    ``by_seed``: training seed -> scores by sample id (a list: ids 0, 1, ...). ``clip``: bound the
    interval to the score range (at most 1; at least 0 for non-negative scores); off for a quantity on
    the whole real line (e.g. an excess NLL)."""
    cell = {s: (dict(enumerate(v)) if not isinstance(v, Mapping) else dict(v)) for s, v in by_seed.items()}
    seeds = sorted(cell)
    if len(seeds) == 1:
        est = score_estimate(list(cell[seeds[0]].values()))
        return est.mean, est.low, est.high, f"n={est.n}"
    from scipy import stats

    means = [sum(cell[s].values()) / len(cell[s]) for s in seeds]
    k = len(means)
    mean = sum(means) / k
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (k - 1))
    half = float(stats.t.ppf(0.975, k - 1)) * sd / math.sqrt(k)
    common = sorted(set.intersection(*(set(cell[s]) for s in seeds)))
    per_sample = [sum(cell[s][i] for s in seeds) / k for i in common]  # seed-averaged score per sequence
    samp = score_estimate(per_sample) if per_sample else None
    lo, hi = mean - half, mean + half
    if samp is not None:
        lo, hi = min(lo, samp.low), max(hi, samp.high)
    what = f"{k} seeds×{len(common)}"
    if not clip:
        return mean, lo, hi, what
    lo_clip = 0.0 if min(min(v.values()) for v in cell.values()) >= 0 else -math.inf
    return mean, max(lo_clip, lo), min(1.0, hi), what


def extrapolation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per (model, task) a table of mean score [95% CI] by mixer × length."""
    cells = _cells(rows)
    out: list[str] = []
    for model, task in sorted({(m, t) for m, t, _ in cells}):
        recipes = sorted(r for m, t, r in cells if (m, t) == (model, task))
        lengths = sorted({n for r in recipes for n in cells[(model, task, r)]})
        out += [f"**{model} · {task}** (mean score [95% CI]; n = test samples; with several training seeds "
                "the hull of the t-interval over seed means and the test-sample interval)", ""]
        out.append("| mixer | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for r in recipes:
            row = [r]
            for n in lengths:
                by_seed = cells[(model, task, r)].get(n)
                if not by_seed:
                    row.append("–")
                    continue
                mean, lo, hi, what = cell_estimate(by_seed)
                row.append(f"{mean:.2f} [{lo:.2f}, {hi:.2f}] {what}")
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


# distinct colours (tab10), then line styles, and markers: fixed per recipe, so no two recipes look alike
_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf"]
_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def plot_results(results_dir: str | os.PathLike[str], path: str | os.PathLike[str],
                 skip: Sequence[str] = ()) -> Path | None:
    """Write the PNG; ``None`` when the directory holds no lab rows (after ``skip``, see :func:`lab_rows`).
    One legend per panel, outside the axes (never over a curve); every recipe keeps one colour and style
    across panels."""
    rows = lab_rows(results_dir, skip)
    cells = _cells(rows)
    panels = sorted({(m, t) for m, t, _ in cells})
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes_all = sorted({r for _, _, r in cells})
    look = {r: (_COLOURS[i % len(_COLOURS)], _STYLES[(i // len(_COLOURS)) % len(_STYLES)],
                _MARKERS[i % len(_MARKERS)]) for i, r in enumerate(recipes_all)}
    panels.sort(key=lambda p: (not p[1].startswith("passkey"), p))  # the main task first
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(7.6 * ncol, 3.9 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (model, task) in zip(axes.flat, panels):
        low_all = 0.0
        for recipe in sorted(r for m, t, r in cells if (m, t) == (model, task)):
            by_len = cells[(model, task, recipe)]
            xs = sorted(by_len)
            stats = [cell_estimate(by_len[n]) for n in xs]
            seeds = max(len(by_len[n]) for n in xs)
            colour, style, mark = look[recipe]
            label = recipe + (f" ({seeds} seeds)" if seeds > 1 else "")
            ax.plot(xs, [s[0] for s in stats], marker=mark, ms=4, color=colour, ls=style, label=label,
                    mfc="none" if style != "-" else colour)
            lo, hi = [s[1] for s in stats], [s[2] for s in stats]
            low_all = min(low_all, min(s[0] for s in stats))
            ax.fill_between(xs, lo, hi, alpha=0.10, color=colour, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_ylim(min(-0.02, low_all - 0.05), 1.02)
        ax.set_xlabel("test length (tokens)")
        ax.set_ylabel("utilisation U" if task.startswith("lcube") else "score")
        ax.set_title(f"{task} ({model})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
