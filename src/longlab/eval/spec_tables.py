"""The speculative-decoding summary of a results directory (rows of ``longlab eval --speculative``).

Score cells are written as every score table writes them (:func:`~longlab.eval.tables.fmt_estimate`,
:func:`~longlab.eval.tables.fmt_difference`: ×100 with the 95% interval, ``n.s.`` when not significant);
acceptance and tokens per forward are means of per-sample values with a bootstrap interval over samples;
speed and bytes against plain decoding are medians and quartiles of per-sample ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .stats import bootstrap_ci, paired_difference, score_estimate
from .tables import fmt_difference, fmt_estimate

__all__ = ["spec_markdown", "mean_ci_cell", "score_ci_cell", "median_cell", "paired_cell", "load_cell"]


def mean_ci_cell(values: Sequence[float], digits: int = 2) -> str:
    """``mean [low, high]``: the mean over samples with its 95% percentile-bootstrap CI (resampling samples;
    :func:`longlab.eval.stats.bootstrap_ci`)."""
    if not values:
        return "—"
    mean, low, high = bootstrap_ci([list(values)])
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def score_ci_cell(values: Sequence[float]) -> str:
    """Mean score ×100 with its 95% CI (Wilson for pass/fail scores, else bootstrap over samples), as
    every score table writes it (:func:`longlab.eval.tables.fmt_estimate`)."""
    return fmt_estimate(score_estimate(list(values)))


def median_cell(values: Sequence[float]) -> str:
    """``median (q1-q3)`` of per-sample ratios (each measured side by side with plain decoding)."""
    if not values:
        return "—"
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.2f} ({q[0]:.2f}-{q[2]:.2f})"


def paired_cell(a: Sequence[float], b: Sequence[float], same: int) -> str:
    """Paired bootstrap of ``mean(a - b)`` over the same samples; identical outputs are said so."""
    if not a:
        return "—"
    if same == len(a):
        return f"identical tokens ({same}/{len(a)})"
    d = paired_difference(list(a), list(b))
    return f"{fmt_difference(d)} ({same}/{len(a)} identical)"


def load_cell(extras: Sequence[dict[str, Any]]) -> str:
    loads = [e["load_1m"] for e in extras if e.get("load_1m") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "—"


def spec_markdown(rows: Sequence[dict[str, Any]]) -> str | None:
    """Two markdown tables of the rows of ``longlab eval --speculative`` (None when there are none).

    Per (task, length, config): samples, score with its 95% CI, the paired difference to plain decoding on
    the same samples (paired bootstrap; "identical tokens (k/n)" when every sample's tokens equal plain
    decoding's), acceptance rate and tokens per target forward (means of per-sample values, bootstrap CI
    over samples). Per (length, config), all tasks pooled: acceptance and tokens per forward with CIs, the
    tokens/s ratio to plain decoding (median and quartiles of the per-sample ratios, each config decoded
    side by side with plain on the same prefilled prompt in a rotating order), K/V bytes read per token vs
    plain (median), identical-token count and the 1-minute load average while the rows were measured."""
    rows = [r for r in rows if "spec" in (r.get("extra") or {})]
    if not rows:
        return None
    plain = {
        (r["method"], r["task"], r["length"], r["sample_id"], r["seed"]): r
        for r in rows
        if r["extra"]["spec"] == "plain"
    }

    def paired(sel: list[dict]) -> list[tuple[dict, dict]]:
        out = []
        for r in sel:
            p = plain.get((r["method"], r["task"], r["length"], r["sample_id"], r["seed"]))
            if p is not None:
                out.append((r, p))
        return out

    by_task: dict[tuple[str, int, str], list[dict]] = {}
    by_length: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        by_task.setdefault((r["task"], r["length"], r["recipe"]), []).append(r)
        by_length.setdefault((r["length"], r["recipe"]), []).append(r)

    def order(label: str) -> tuple[int, str]:
        return ("~" in label, label)

    lines = [
        "| task | length | config | n | score ×100 [95% CI] | score - plain ×100 [paired 95% CI] "
        "| acceptance [95% CI] "
        "| tokens / target forward [95% CI] |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (task, length, label), sel in sorted(
        by_task.items(), key=lambda kv: (kv[0][1], kv[0][0], order(kv[0][2]))
    ):
        pairs = paired(sel)
        ex = [r["extra"] for r in sel]
        acc = [e["acceptance_rate"] for e in ex if e.get("acceptance_rate") is not None]
        is_plain = ex[0]["spec"] == "plain"
        diff = "—" if is_plain else paired_cell(
            [r["score"] for r, _ in pairs],
            [p["score"] for _, p in pairs],
            sum(bool(r["extra"]["same_as_plain"]) for r, _ in pairs),
        )
        tpf = "1.00" if is_plain else mean_ci_cell([e["tokens_per_forward"] for e in ex])
        lines.append(
            f"| {task} | {length} | {label} | {len(sel)} | {score_ci_cell([r['score'] for r in sel])} |"
            f" {diff} |"
            f" {mean_ci_cell(acc)} | {tpf} |"
        )
    lines += [
        "",
        "| length | config | n | acceptance [95% CI] | tokens / target forward [95% CI] | tok/s vs plain "
        "(median, quartiles) | KV bytes read per token vs plain (median) | tokens = plain | load (1 min) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (length, label), sel in sorted(by_length.items(), key=lambda kv: (kv[0][0], order(kv[0][1]))):
        ex = [r["extra"] for r in sel]
        acc = [e["acceptance_rate"] for e in ex if e.get("acceptance_rate") is not None]
        is_plain = ex[0]["spec"] == "plain"
        lines.append(
            f"| {length} | {label} | {len(sel)} | {mean_ci_cell(acc)} |"
            f" {'1.00' if is_plain else mean_ci_cell([e['tokens_per_forward'] for e in ex])} |"
            f" {median_cell([e['speed_vs_plain'] for e in ex])} |"
            f" {statistics.median(e['bytes_vs_plain'] for e in ex):.2f} |"
            f" {sum(bool(e['same_as_plain']) for e in ex)}/{len(sel)} | {load_cell(ex)} |"
        )
    return "\n".join(lines)
