"""Markdown/HTML tables of a results directory's rows, with 95% confidence intervals.

Scores are shown ×100. A score cell is the mean over the samples of one recipe on one task (and
length) with its CI: Wilson when every score of the cell is 0 or 1 (pass/fail), a seeded percentile
bootstrap otherwise (:mod:`longlab.eval.stats`); ``avg`` is the mean of the task cells of the row
(every task weighs the same), its CI a bootstrap stratified by task. ``n`` is the number of samples
per cell (``min-max`` when the row's cells differ, and those cells then show their own ``(n=k)``).

The relative tables subtract the baseline recipe (``full`` by default) **on the same samples**: a cell
is the mean of the per-sample differences ``score(recipe) - score(baseline)`` over the samples both
were scored on, its CI a paired bootstrap, and ``n.s.`` marks a difference whose CI contains 0. Over
all lengths, a cell averages the per-length differences (stratified by length), so recipes measured
at different lengths are still compared like for like.

Rows of the same sample and recipe stored under several config hashes count once (the newest) unless
``all_configs``; the tables then carry a note line saying how many were left out.

Recipes with a sparse prefill policy run with ``--prefill-metrics`` get one more table per model and
length: score, prefill seconds (and their ratio to ``full``'s), and the mean over samples of the
whole-model density, attention recall, relative output error and dense-fallback fraction stored in
the ``metrics`` table (``layer = head = -1``).
"""

from __future__ import annotations

import html as _html
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .rows import (
    FULL,
    Row,
    is_full,
    mean,
    one_per_sample,
    paired_scores,
    recipe_order,
    scored,
    scores_by,
    str_sort_key,
)
from .rows import sort_key as _sort_key
from .stats import (
    CONFIDENCE,
    RESAMPLES,
    SEED,
    Difference,
    Estimate,
    score_estimate,
    stratified_difference,
    stratified_estimate,
)

__all__ = [
    "HOW_TO_READ",
    "PREFILL_METRICS",
    "fmt_difference",
    "fmt_estimate",
    "prefill_table",
    "prefill_tables",
    "score_table",
    "score_tables",
    "summary_table",
    "table_html",
    "table_md",
]

Table = tuple[str, list[str], list[list[str]]]  # (title, header, body)

PREFILL_METRICS = ("density", "recall", "rel_error", "fallback")


def how_to_read(baseline: str = FULL, confidence: float = CONFIDENCE) -> str:
    """The sentence printed under the score tables."""
    pct = f"{100 * confidence:g}%"
    return (
        f"How to read: each cell is the mean score ×100 with its {pct} confidence interval in brackets "
        "(Wilson for pass/fail cells, seeded percentile bootstrap for graded ones; n = samples per cell), "
        f"and in the 'score − {baseline}' tables each cell is the mean paired difference on the same "
        f"samples with its {pct} paired-bootstrap interval, marked n.s. when that interval contains 0 "
        "(not distinguishable from the baseline with this many samples). 'KV vs dense' is the cache's "
        "bytes (slot positions and method state included) over a dense cache's keys and values for the "
        "same tokens, so the full cache reads about 101%."
    )


HOW_TO_READ = how_to_read()


# --------------------------------------------------------------------------------------------------
# formatting


def _num(value: float, signed: bool = False) -> str:
    value = round(value, 1) + 0.0  # no "-0.0"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def fmt_estimate(est: Estimate | None, *, show_n: bool = False) -> str:
    """``62.5 [43.0, 78.8]`` (×100), with `` (n=24)`` when ``show_n``; ``-`` for no data."""
    if est is None:
        return "-"
    text = f"{_num(100 * est.mean)} [{_num(100 * est.low)}, {_num(100 * est.high)}]"
    return f"{text} (n={est.n})" if show_n else text


def fmt_difference(diff: Difference | None, *, show_n: bool = False) -> str:
    """``+8.3 [-4.2, +20.8] n.s.`` (×100; ``n.s.`` when the CI contains 0); ``-`` for no pairs."""
    if diff is None:
        return "-"
    text = f"{_num(100 * diff.mean, True)} [{_num(100 * diff.low, True)}, {_num(100 * diff.high, True)}]"
    if show_n:
        text += f" (n={diff.n})"
    return text if diff.significant else text + " n.s."


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_length(n: Any) -> str:
    """``1024`` -> ``1k``; other lengths as they are; ``None`` -> ``?``."""
    if n is None:
        return "?"
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _n_cells(cells: Sequence[Estimate | Difference | None]) -> tuple[str, bool]:
    """The ``n`` column (one number when every cell has the same n, else ``min-max``) and whether the
    cells must show their own n."""
    ns = sorted({c.n for c in cells if c is not None})
    if not ns:
        return "0", False
    if len(ns) == 1:
        return str(ns[0]), False
    return f"{ns[0]}-{ns[-1]}", True


# --------------------------------------------------------------------------------------------------
# score tables


class _Stats:
    """Keyword arguments shared by every interval of one report."""

    def __init__(self, confidence: float, resamples: int, seed: int) -> None:
        self.kw = {"confidence": confidence, "resamples": resamples, "seed": seed}

    def estimate(self, values: Sequence[float]) -> Estimate | None:
        return score_estimate(values, **self.kw) if values else None

    def macro(self, strata: Sequence[Sequence[float]]) -> Estimate | None:
        strata = [s for s in strata if s]
        return stratified_estimate(strata, **self.kw) if strata else None

    def difference(
        self, pairs: Sequence[tuple[list[float], list[float]]], weights: Sequence[float] | None = None
    ) -> Difference | None:
        if not pairs:
            return None
        return stratified_difference(pairs, weights, **self.kw)


def score_tables(
    rows: Sequence[Row],
    *,
    baseline: str = FULL,
    all_configs: bool = False,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[list[Table], str]:
    """The score tables (per model: all lengths when there are several, then each length; absolute,
    then vs ``baseline``) and the note line of :meth:`~longlab.eval.rows.Selection.note`.

    ``rows`` are the store's rows as they are; one per (sample, recipe) is chosen here."""
    selection = one_per_sample(rows, all_configs=all_configs)
    rows = selection.rows
    if not rows:
        return [], selection.note()
    st = _Stats(confidence, resamples, seed)
    models = sorted({r.get("model") for r in rows}, key=str_sort_key)
    tables: list[Table] = []
    for model in models:
        mrows = [r for r in rows if r.get("model") == model]
        lengths = sorted({r.get("length") for r in mrows}, key=_sort_key)
        scopes: list[tuple[str, list[Any]]] = []
        if len(lengths) > 1:
            scopes.append(("all lengths", lengths))
        scopes.extend((f"length {fmt_length(n)}", [n]) for n in lengths)
        for scope_name, scope_lengths in scopes:
            srows = [r for r in mrows if r.get("length") in scope_lengths]
            tables.extend(_scope_tables(srows, st, model, scope_name, baseline, all_configs))
    return tables, selection.note()


def _scope_tables(
    rows: Sequence[Row], st: _Stats, model: Any, scope: str, baseline: str, all_configs: bool
) -> list[Table]:
    tasks = sorted({r.get("task") for r in rows}, key=str_sort_key)
    lengths = sorted({r.get("length") for r in rows}, key=_sort_key)
    recipes = recipe_order(rows)
    by_recipe: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_recipe[str(r.get("recipe"))].append(r)
    pooled = scores_by(rows, "recipe", "task")  # all lengths of the scope pooled
    by_cell: dict[tuple[Any, Any], list[Row]] = defaultdict(list)
    for r in rows:
        by_cell[(r.get("task"), r.get("length"))].append(r)

    header = ["recipe", *[str(t) for t in tasks], "avg", "n", "KV bytes after", "KV vs dense"]
    body: list[list[str]] = []
    for recipe in recipes:
        cells = [st.estimate(pooled.get((recipe, t), [])) for t in tasks]
        n_text, show_n = _n_cells(cells)
        avg = st.macro([pooled.get((recipe, t), []) for t in tasks])
        rr = by_recipe[recipe]
        kv_after = mean(r.get("kv_bytes_after") for r in rr)
        kv_before = mean(r.get("kv_bytes_before") for r in rr)
        kept = f"{100.0 * kv_after / kv_before:.0f}%" if kv_after is not None and kv_before else "-"
        body.append([
            recipe, *[fmt_estimate(c, show_n=show_n) for c in cells], fmt_estimate(avg), n_text,
            _fmt_bytes(kv_after), kept,
        ])
    out: list[Table] = [(f"{model} · {scope} · score ×100 [95% CI]", header, body)]

    if baseline not in by_recipe or len(recipes) < 2:
        return out
    rel_body: list[list[str]] = []
    for recipe in recipes:
        if recipe == baseline:
            continue
        diffs: list[Difference | None] = []
        avg_pairs: list[tuple[list[float], list[float]]] = []
        avg_task: list[Any] = []
        for t in tasks:
            pairs = []
            for n in lengths:
                a, b = paired_scores(by_cell[(t, n)], recipe, baseline, with_config=all_configs)
                if a:
                    pairs.append((a, b))
            diffs.append(st.difference(pairs))  # equal weight per length
            avg_pairs.extend(pairs)
            avg_task.extend([t] * len(pairs))
        # avg: every task weighs the same, and within a task every length
        per_task = {t: avg_task.count(t) for t in set(avg_task)}
        weights = [1.0 / (len(per_task) * per_task[t]) for t in avg_task]
        avg = st.difference(avg_pairs, weights)
        n_text, show_n = _n_cells(diffs)
        cells = [fmt_difference(d, show_n=show_n) for d in diffs]
        rel_body.append([recipe, *cells, fmt_difference(avg), n_text])
    rel_title = f"{model} · {scope} · score − {baseline} (×100, paired on the same samples) [95% CI]"
    out.append((rel_title, ["recipe", *[str(t) for t in tasks], "avg", "n"], rel_body))
    return out


# --------------------------------------------------------------------------------------------------
# sparse prefill tables


def prefill_tables(
    rows: Sequence[Row],
    metrics: Mapping[str, Mapping[str, float]],
    *,
    all_configs: bool = False,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> list[Table]:
    """Per model and length: score [CI], prefill seconds and mean sparse-prefill quality per recipe.

    Only when some row has metrics; lists those recipes and ``full`` (the dense reference)."""
    rows = one_per_sample(rows, all_configs=all_configs).rows
    st = _Stats(confidence, resamples, seed)
    with_metrics = {str(r.get("recipe")) for r in rows if r.get("run_key") in metrics}
    if not with_metrics:
        return []
    tables: list[Table] = []
    models = sorted({r.get("model") for r in rows}, key=str_sort_key)
    for model in models:
        mrows = [r for r in rows if r.get("model") == model]
        for length in sorted({r.get("length") for r in mrows}, key=_sort_key):
            lrows = [r for r in mrows if r.get("length") == length]
            recipes = [n for n in recipe_order(lrows) if n in with_metrics or is_full(n)]
            if not any(n in with_metrics for n in recipes):
                continue
            by_recipe: dict[str, list[Row]] = defaultdict(list)
            for r in lrows:
                by_recipe[str(r.get("recipe"))].append(r)
            full_s = mean(r.get("prefill_s") for r in by_recipe.get(FULL, []))
            header = ["recipe", "score [95% CI]", "prefill s", "vs full", *PREFILL_METRICS, "n"]
            body: list[list[str]] = []
            for recipe in recipes:
                rr = by_recipe[recipe]
                est = st.estimate([float(r["score"]) for r in scored(rr)])
                pre = mean(r.get("prefill_s") for r in rr)
                ratio = f"{pre / full_s:.2f}×" if pre is not None and full_s else "-"
                cells = []
                for name in PREFILL_METRICS:
                    value = mean(metrics.get(str(r.get("run_key")), {}).get(name) for r in rr)
                    cells.append("-" if value is None else f"{value:.3f}")
                body.append([
                    recipe, fmt_estimate(est), "-" if pre is None else f"{pre:.2f}", ratio,
                    *cells, str(len(scored(rr))),
                ])
            title = f"{model} · length {fmt_length(length)} · sparse prefill (means over samples)"
            tables.append((title, header, body))
    return tables


def prefill_table(
    rows: Sequence[Row], metrics: Mapping[str, Mapping[str, float]], *, all_configs: bool = False
) -> str:
    """Markdown tables of :func:`prefill_tables` (empty string when no row has prefill metrics).

    ``metrics``: run_key -> {name: whole-model value} (:func:`longlab.eval.rows.load_metrics`)."""
    return "\n\n".join(table_md(t) for t in prefill_tables(rows, metrics, all_configs=all_configs))


# --------------------------------------------------------------------------------------------------
# rendering


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def table_md(table: Table) -> str:
    """One table as Markdown: a ``### title`` line, the header, right-aligned number columns."""
    title, header, body = table
    lines = [f"### {title}", "", "| " + " | ".join(_md_escape(h) for h in header) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    lines.extend("| " + " | ".join(_md_escape(c) for c in row) + " |" for row in body)
    return "\n".join(lines)


def table_html(table: Table) -> str:
    """One table as HTML (``<h3>`` title and a ``<table>``)."""
    title, header, body = table
    esc = _html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<h3>{esc(title)}</h3>\n<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{rows}</tbody>\n</table>"


def score_table(
    rows: Sequence[Row],
    *,
    baseline: str = FULL,
    all_configs: bool = False,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    explain: bool = True,
) -> str:
    """Markdown score tables with 95% CIs and paired differences vs ``baseline``, for the terminal
    or a file: the note line (when rows were left out), the tables, then (``explain``) the sentence
    of :func:`how_to_read`. ``rows``: the store's rows (:func:`longlab.eval.rows.load_rows`)."""
    tables, note = score_tables(
        rows, baseline=baseline, all_configs=all_configs, confidence=confidence, resamples=resamples,
        seed=seed,
    )
    if not tables:
        return "_No results._\n"
    parts = [note] if note else []
    parts.append("\n\n".join(table_md(t) for t in tables))
    if explain:
        parts.append(how_to_read(baseline, confidence))
    return "\n\n".join(parts) + "\n"


def summary_table(rows: Sequence[Row], **kwargs: Any) -> str:
    """:func:`score_table` without the how-to-read sentence (the older name; for callers that print
    their own explanation)."""
    kwargs.setdefault("explain", False)
    return score_table(rows, **kwargs)
