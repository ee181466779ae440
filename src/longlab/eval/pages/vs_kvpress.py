"""The generated tables of ``docs/results/vs-kvpress.md``: longlab against NVIDIA kvpress.

Reads ``bench/results/kvpress_layout-*.json`` (``bench/kvpress_layout.py``: both sides on identical ids per
layout variant) and ``bench/results/vs_kvpress-cases-raw.json`` / ``vs_kvpress-raw.json``
(``bench/vs_kvpress.py --kvpress-question raw``). Every count carries its 95% interval (Wilson for 0/1
scores, else a percentile bootstrap) and every comparison a paired bootstrap over the same samples
(:mod:`longlab.eval.stats`); a difference whose interval contains 0 is marked n.s. (moved from
the former ``bench/vs_kvpress_report.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..stats import paired_difference, score_estimate

__all__ = ["render"]

RECIPES = ["full", "knorm@0.5", "streaming@0.5", "snapkv@0.5", "tova@0.5"]
# (file, side label, variant) -> the row's name in the tables
CELLS = [
    ("kvpress_layout-kvpress.json", "kvpress", "kvpress",
     "kvpress pipeline, `answer_prefix=prefix + \" \"` (the issue's call)"),
    ("kvpress_layout-longlab128.json", "longlab/chunk128", "kvpress",
     "longlab eval path on the ids of the issue's kvpress call"),
    ("kvpress_layout-longlab128.json", "longlab/chunk128", "longlab",
     "**longlab eval default before** (`chat-sep`: context + \"\\n\\n\" + question)"),
    ("kvpress_layout-longlab128.json", "longlab/chunk128", "kvpress-bare",
     "**longlab eval default now** (`chat`: kvpress's layout, prefix verbatim)"),
    ("kvpress_layout-longlab128.json", "longlab/chunk128", "longlab-space",
     "longlab `chat-sep` with `prefix + \" \"`"),
]


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

def _scores(result: dict, variant: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for row in result["rows"]:
        if row["variant"] == variant:
            out.setdefault(row["recipe"], {})[row["sample_id"]] = row["score"]
    return out


def _predictions(result: dict, variant: str) -> dict[tuple[str, str], str]:
    return {(r["recipe"], r["sample_id"]): r["prediction"] for r in result["rows"] if r["variant"] == variant}


def _cell(values: list[float]) -> str:
    e = score_estimate(values)
    return f"{sum(values):.3g} [{e.low * len(values):.3g}, {e.high * len(values):.3g}]"


def _diff(a: list[float], b: list[float]) -> str:
    d = paired_difference(a, b)
    n = len(a)
    tag = "" if d.significant else " n.s."
    return f"{d.mean * n:+.3g} [{d.low * n:+.3g}, {d.high * n:+.3g}]{tag}"


def layout_tables(results: Path) -> list[str]:
    rows = []
    for name, _side, variant, label in CELLS:
        result = _load(results, name)
        if result is not None and any(r["variant"] == variant for r in result["rows"]):
            rows.append((label, _scores(result, variant), result))
    if not rows:
        return ["(no bench/results/kvpress_layout-*.json yet)"]
    ref_label, ref, _ = rows[0]
    ids = sorted(next(iter(ref.values())))
    n = len(ids)
    out = [
        f"**Correct answers out of {n}** (chain cases score the fraction of the 5 variables named), with the "
        "95% interval of the count; below each count, the paired difference from the first row (the issue's "
        "kvpress call) in samples, with its 95% bootstrap interval.",
        "",
        "| protocol | " + " | ".join(f"`{r}`" for r in RECIPES) + " |",
        "|---|" + "---:|" * len(RECIPES),
    ]
    for label, scores, _ in rows:
        cells = []
        for recipe in RECIPES:
            mine = scores.get(recipe)
            if mine is None or set(mine) != set(ids):
                cells.append("—")
                continue
            a = [mine[i] for i in ids]
            text = _cell(a)
            if label != ref_label:
                text += "<br>" + _diff(a, [ref[recipe][i] for i in ids])
            cells.append(text)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    by_label = {label: scores for label, scores, _ in rows}
    before = next((v for k, v in by_label.items() if "default before" in k), None)
    now = next((v for k, v in by_label.items() if "default now" in k), None)
    if before is not None and now is not None:
        out += ["", "**longlab's former default minus the new one** (`chat-sep` − `chat`, paired, samples): "
                + ", ".join(f"`{r}` " + _diff([before[r][i] for i in ids], [now[r][i] for i in ids])
                            for r in RECIPES) + "; n.s. = not significant."]
    # the engines on identical ids: predictions equal, per recipe
    kv, ll = _load(results, "kvpress_layout-kvpress.json"), _load(results, "kvpress_layout-longlab128.json")
    if kv is not None and ll is not None:
        a, b = _predictions(kv, "kvpress"), _predictions(ll, "kvpress")
        same = {r: sum(a[k] == b.get(k) for k in a if k[0] == r) for r in RECIPES}
        total = {r: sum(1 for k in a if k[0] == r) for r in RECIPES}
        out += ["", "**Same ids, two engines** (kvpress's pipeline, one prefill forward; longlab's eval "
                "runner, 128-token chunks, compression once at the end): identical predictions per recipe: "
                + ", ".join(f"`{r}` {same[r]}/{total[r]}" for r in RECIPES) + "."]
    return out


def vs_tables(results: Path) -> list[str]:
    out = []
    for name, what in (("vs_kvpress-cases-raw.json", "the 36 unseen cases, `--ratios 0.5`"),
                       ("vs_kvpress-raw.json", "the issue's sweep (`niah_single_1`, `vt`; 9 recipes)")):
        result = _load(results, name)
        if result is None:
            out += ["", f"`bench/results/{name}` ({what}, `--kvpress-question raw`): not run yet."]
            continue
        n = result["table"][0]["n"]
        same_ids = n - len(result["setup"]["prompt_id_mismatches"])
        missing = result["setup"]["blocks_missing"] or "none"
        out += ["", f"**`bench/results/{name}`** ({what}, `--kvpress-question raw`: both sides in their "
                f"default layouts, prompt ids identical for {same_ids}/{n} samples; missing: {missing}). "
                "Correct (% with 95% CI) and the paired difference longlab − kvpress:", "",
                "| recipe | kvpress | longlab | longlab − kvpress | same predictions |",
                "|---|---:|---:|---:|---:|"]
        for t in result["table"]:
            c = t["longlab_batched"]
            sig = "" if c["significant"] else " n.s."
            out.append(f"| `{t['recipe']}` | {_pct(c['kvpress'])} | {_pct(c['longlab'])} | "
                       f"{_pct(c['difference'])}{sig} | {t['same_predictions_batched']}/{n} |")
        kv, ll = result["kvpress"], result["longlab_batched"]
        timing = result["timing"]["batched"]
        out += ["", "Sweep time (model loads excluded, sides interleaved by block): "
                f"kvpress {kv['sweep_s']:.0f} s wall ({kv['sweep_cpu_s']:.0f} s CPU), "
                f"longlab {ll['sweep_s']:.0f} s ({ll['sweep_cpu_s']:.0f} s): "
                f"**{timing['wall_ratio']:.2f}× wall, {timing['cpu_ratio']:.2f}× CPU**; load average "
                f"{kv.get('load_average')} / {ll.get('load_average')}."]
    return out


def _pct(x: list) -> str:
    return f"{100 * x[0]:.1f} [{100 * x[1]:.1f}, {100 * x[2]:.1f}]"


def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's ``kvpress-layout`` and ``kvpress-sweep`` blocks."""
    results = root / "bench" / "results"
    return {"kvpress-layout": "\n".join(layout_tables(results)),
            "kvpress-sweep": "\n".join(vs_tables(results)).strip()}
