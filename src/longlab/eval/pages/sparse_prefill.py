"""The generated blocks of ``docs/results/sparse-prefill.md``: block-sparse prefill selectors on SmolLM2-135M
and Gemma3-270M (issues 10 and 16).

Reads the committed results under ``bench/results/``:

* ``sparse_prefill_4k/results.sqlite.gz`` and ``stats.json`` (the ``longlab eval`` store, read through
  :func:`longlab.eval.report.report_markdown`, and ``bench/sparse_prefill.py stats`` of it; the 4k run:
  scores with Wilson / bootstrap intervals, paired differences against ``full``, per-sample prefill-time
  ratios as a geometric mean with a bootstrap 95% interval, answer agreement, mask quality);
* ``sparse_prefill_24/results.sqlite.gz`` (against ``full`` and against ``snapkv@0.5``) and
  ``prefill_ratios.json`` (the 2k run);
* ``sparse_prefill_backends.json`` (``bench/sparse_prefill.py backends``: interleaved repeats, so each
  repeat's ratio is paired);
* ``prefill_attention.json``, ``prefill_attention_32k.json`` (synthetic q/k/v) and
  ``prefill_attention_real_gemma3.json`` (captured q/k/v) from ``bench/sparse_prefill.py attention``;
* ``prefill_time.json`` (``bench/sparse_prefill.py prefill-time``).

Verdicts follow :func:`longlab.eval.pages.paired.call` (scores) and "faster / slower" when a time ratio's
95% interval lies below / above 1.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..report import report_markdown
from .kv_eviction import parse_report_table
from .paired import fmt_ci, log_ratio_interval

__all__ = ["COMMANDS", "parse_diff", "render", "speed_call"]

TASKS = ("niah_multikey_1", "niah_single_1", "vt")
COMMANDS = {
    "4k": (
        "bench/heavy.sh .venv/bin/longlab eval --config bench/configs/sparse-prefill-4k.toml; "
        "python bench/sparse_prefill.py stats bench/results/sparse_prefill_4k/results.sqlite "
        "bench/results/sparse_prefill_4k/stats.json"
    ),
    "2k": (
        "bench/heavy.sh .venv/bin/longlab eval --config bench/configs/sparse-prefill-2k.toml; "
        "python bench/sparse_prefill.py ratios bench/results/sparse_prefill_24/results.sqlite "
        "bench/results/sparse_prefill_24/prefill_ratios.json"
    ),
    "backends": (
        "bench/heavy.sh .venv/bin/python bench/sparse_prefill.py backends --lengths 4096,8192 --repeats 3"
    ),
    "synthetic": (
        "python bench/sparse_prefill.py attention --lengths 2048,4096 --out "
        "bench/results/prefill_attention.json; "
        "python bench/sparse_prefill.py attention --lengths 16384,32768 "
        "--out bench/results/prefill_attention_32k.json"
    ),
    "real": (
        "python bench/sparse_prefill.py capture-qkv --model gemma3-270m --length 32768 "
        "--out runs/qkv/gemma3_32k.safetensors --threads 1; OMP_NUM_THREADS=1 python bench/sparse_prefill.py "
        "attention --qkv runs/qkv/gemma3_32k.safetensors --groups L11 --lengths 8192,16384,32768 "
        "--selectors ashape,vslash,flexprefill,xattention,prism --repeats 1 "
        "--out bench/results/prefill_attention_real_gemma3.json"
    ),
    "prefill_time": (
        "python bench/sparse_prefill.py prefill-time --length 4096 --chunk-sizes 1024,4096 --repeats 2"
    ),
}

_ROOT: list[Path] = [Path(".")]
_NUM = r"([+-]?\d+(?:\.\d+)?)"


def _res(rel: str) -> Path:
    return _ROOT[0] / "bench" / "results" / rel


def _json(rel: str) -> Any:
    return json.loads(_res(rel).read_text(encoding="utf-8"))


def _code(s: str) -> str:
    return f"`{s}`"


def _pretty(cell: str) -> str:
    return cell.replace("-", "−").replace("+0.0", "0.0").replace("−0.0", "0.0")


def parse_diff(cell: str) -> tuple[float, float, float, int | None] | None:
    """``'+6.2 [+0.0, +18.8] (n=7) n.s.'`` -> ``(6.2, 0.0, 18.8, 7)``; ``'-'`` -> None."""
    m = re.match(rf"\s*{_NUM} \[{_NUM}, {_NUM}\]", cell)
    if not m:
        return None
    n = re.search(r"\(n=(\d+)\)", cell)
    return float(m.group(1)), float(m.group(2)), float(m.group(3)), int(n.group(1)) if n else None


def speed_call(lo: float, hi: float) -> str:
    """A time ratio's verdict from its 95% interval (ratio < 1: faster than the baseline)."""
    if math.isnan(lo):
        return "one timing, no interval"
    return "faster" if hi < 1 else "slower" if lo > 1 else "not significant"


def _ratio(e: dict[str, Any]) -> str:
    lo, hi = e["ci95"]
    return f"{e['geomean']:.2f}× [{lo:.2f}, {hi:.2f}] (n = {e['n']}, {speed_call(lo, hi)})"


def _mean_ci(e: dict[str, Any]) -> str:
    return f"{e['mean']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"


def _report(rel: str, heading: str, baseline: str = "full") -> dict[str, dict[str, str]]:
    """The rows of one ``longlab report`` table of the committed store ``bench/results/REL``."""
    text = report_markdown(_res(rel), baseline=baseline, what=f"bench/results/{rel}")
    return {r["recipe"]: r for r in parse_report_table(text, heading)}


def _avg_n(row: dict[str, str]) -> int:
    """Samples behind a report row's task average: the per-task n (or each cell's own ``(n=k)``)."""
    total = 0
    for t in TASKS:
        cell = row.get(t, "-")
        if cell.strip() in ("-", ""):
            continue
        own = re.search(r"\(n=(\d+)\)", cell)
        total += int(own.group(1)) if own else int(row["n"].split("-")[-1])
    return total


# ---------------------------------------------------------------------------------------------- 4k


def _4k() -> tuple[dict, dict, dict]:
    scores = _report("sparse_prefill_4k", "### smollm2-135m · length 4k · score ×100")
    diffs = _report("sparse_prefill_4k", "### smollm2-135m · length 4k · score − full")
    return scores, diffs, _json("sparse_prefill_4k/stats.json")


def table_4k() -> str:
    scores, diffs, st = _4k()
    lines = [
        "| recipe | "
        + " | ".join(_code(t) for t in TASKS)
        + " | average (n) | average − `full` [paired 95% CI] | "
        "same answer as `full` | prefill time / `full` [95% CI] | density | recall | rel. error |",
        "|---|" + "---:|" * (len(TASKS) + 7),
    ]
    full_s = st["full_prefill_s"]
    for r, row in scores.items():
        cells = [row[t] for t in TASKS] + [f"{row['avg']} ({_avg_n(row)})"]
        if r == "full":
            cells += ["—", "—", f"1 (median {full_s['median']:.2f} s, n = {full_s['n']})", "—", "—", "—"]
        else:
            mq = st["mask_quality"][r]
            same = st["same_prediction_as_full"][r]
            cells += [
                _pretty(diffs[r]["avg"]),
                f"{same['same']} of {same['n']}",
                _ratio(st["ratio_to_full"][r]["all"]),
                _mean_ci(mq["density"]["all"]),
                _mean_ci(mq["recall"]["all"]),
                _mean_ci(mq["rel_error"]["all"]),
            ]
        lines.append(f"| {_code(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_4k_tasks() -> str:
    _, diffs, st = _4k()
    lines = [
        "| recipe | "
        + " | ".join(f"{_code(t)}: score − `full` | {_code(t)}: time / `full`" for t in TASKS)
        + " |",
        "|---|" + "---:|---:|" * len(TASKS),
    ]
    for r, row in diffs.items():
        cells = []
        for t in TASKS:
            cells += [_pretty(row[t]), _ratio(st["ratio_to_full"][r][t])]
        lines.append(f"| {_code(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _accuracy_words(d: tuple[float, float, float, int | None] | None) -> str:
    if d is None:
        return "no paired difference"
    m, lo, hi, _ = d
    if lo > 0:
        return f"significantly better, {fmt_ci(m, lo, hi, sign=True)}"
    if hi < 0:
        return f"significantly worse, {fmt_ci(m, lo, hi, sign=True)}"
    if lo == hi == 0:
        return "the same score on every sample (0.0 [0.0, 0.0])"
    rule = f"; a loss above {-lo:.1f} points is ruled out" if lo < 0 else "; no loss in the interval"
    return f"not significant, {fmt_ci(m, lo, hi, sign=True)}{rule}"


def verdicts_4k() -> str:
    scores, diffs, st = _4k()
    out = []
    for r in diffs:
        n = _avg_n(scores[r])
        acc = _accuracy_words(parse_diff(diffs[r]["avg"]))
        sp = st["ratio_to_full"][r]["all"]
        out.append(
            f"- **{_code(r)} at 4,096 tokens: accuracy against `full`: {acc}** (average over the 3 tasks, "
            f"n = {n} "
            f"paired samples, paired bootstrap). **Prefill time: {speed_call(*sp['ci95'])}**, "
            f"{_ratio(sp)} of `full`'s per sample (both recipes on the same sample back to back; geometric "
            "mean, "
            f"bootstrap 95% interval)."
        )
    out += ["", f"Reproduce: `{COMMANDS['4k']}`."]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- 2k


def _2k() -> tuple[dict, dict, dict, dict]:
    h = "### smollm2-135m · length 2k · "
    scores = _report("sparse_prefill_24", h + "score ×100")
    vs_full = _report("sparse_prefill_24", h + "score − full")
    vs_snap = _report("sparse_prefill_24", h + "score − snapkv@0.5", baseline="snapkv@0.5")
    return scores, vs_full, vs_snap, _json("sparse_prefill_24/prefill_ratios.json")


def table_2k() -> str:
    scores, vs_full, vs_snap, ratios = _2k()
    lines = [
        "| recipe | "
        + " | ".join(_code(t) for t in TASKS)
        + " | average (n) | average − `full` [paired 95% CI] | "
        "average − `snapkv@0.5` [paired 95% CI] | prefill time / `full` [95% CI] |",
        "|---|" + "---:|" * (len(TASKS) + 4),
    ]
    for r, row in scores.items():
        cells = [row[t] for t in TASKS] + [f"{row['avg']} ({_avg_n(row)})"]
        cells.append("—" if r == "full" else _pretty(vs_full[r]["avg"]))
        cells.append("—" if r == "snapkv@0.5" else _pretty(vs_snap[r]["avg"]))
        rt = ratios["ratio_to_full"].get(r)
        if r == "full":
            cells.append(f"1 (median {ratios['full_prefill_s_median']:.2f} s)")
        elif r == "snapkv@0.5":
            cells.append("— (the same prefill as `full`)")
        else:
            cells.append(_ratio(rt["all"]) if rt else "—")
        lines.append(f"| {_code(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_2k_time_tasks() -> str:
    _, _, _, ratios = _2k()
    lines = [
        "| recipe | " + " | ".join(_code(t) for t in TASKS) + " | all |",
        "|---|" + "---:|" * (len(TASKS) + 1),
    ]
    for r, e in ratios["ratio_to_full"].items():
        if r == "snapkv@0.5":
            continue  # shares full's prefill (the same prefill policy): ratio 1 by construction
        cells = [_ratio(e[t]) if t in e else "—" for t in (*TASKS, "all")]
        lines.append(f"| {_code(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts_2k() -> str:
    scores, vs_full, vs_snap, ratios = _2k()
    out = []
    for r in scores:
        if r in ("full", "snapkv@0.5"):
            continue
        composed = "+snapkv" in r
        base, table = ("snapkv@0.5", vs_snap) if composed else ("full", vs_full)
        n = _avg_n(scores[r])
        acc = _accuracy_words(parse_diff(table[r]["avg"]))
        sp = ratios["ratio_to_full"][r]["all"]
        out.append(
            f"- **{_code(r)} at 2,048 tokens: accuracy against {_code(base)}: {acc}** (n = {n} paired "
            "samples). "
            f"**Prefill time: {speed_call(*sp['ci95'])}**, {_ratio(sp)} of `full`'s."
        )
    snap = parse_diff(vs_full["snapkv@0.5"]["avg"])
    if snap:
        out.append(
            f"- `snapkv@0.5` alone against `full`: {_accuracy_words(snap)} (n = "
            f"{_avg_n(scores['snapkv@0.5'])}); "
            "where it already scores 0 a composition cannot score lower, so the composition test is weak."
        )
    out += ["", f"Reproduce: `{COMMANDS['2k']}`."]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- timings


def table_backends() -> str:
    d = _json("sparse_prefill_backends.json")
    hw, args = d["hardware"], d["args"]
    backends = [b for b in d["rows"][0]["prefill_s"] if b != "full"]
    lines = [
        f"{hw['cpu']}, {hw['threads']} thread, torch {hw['torch']}, commit {hw['git_commit']}, "
        f"{hw['date']} UTC, "
        f"load average {hw['load_avg_1m']:.1f}; `{args['selector']}` on one `niah_single_1` sample, chunks "
        "of "
        f"{args['chunk_size']}, {args['repeats']} interleaved repeats (one of each per repeat). Ratios per "
        "repeat, geometric mean with a 95% t-interval over the repeats:",
        "",
        "| context | full: median s | "
        + " | ".join(f"{_code(b)}: median s | × full" for b in backends)
        + f" | {_code(backends[-1])} / {_code(backends[0])} | same answer tokens |",
        "|---:|---:|" + "---:|---:|" * len(backends) + "---:|---|",
    ]
    for row in d["rows"]:
        p = row["prefill_s"]
        cells = [str(row["context_tokens"]), f"{row['median_s']['full']:.1f}"]
        for b in backends:
            g, lo, hi = log_ratio_interval([x / f for x, f in zip(p[b], p["full"])])
            cells += [f"{row['median_s'][b]:.1f}", f"{g:.2f} [{lo:.2f}, {hi:.2f}] ({speed_call(lo, hi)})"]
        g, lo, hi = log_ratio_interval([x / y for x, y in zip(p[backends[-1]], p[backends[0]])])
        cells.append(f"{g:.2f} [{lo:.2f}, {hi:.2f}] ({speed_call(lo, hi)})")
        cells.append("yes" if row["answers_equal_across_backends"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Reproduce: `{COMMANDS['backends']}`."]
    return "\n".join(lines)


def _attention_rows(rel: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    d = _json(rel)
    return d["meta"], d["rows"]


def table_synthetic() -> str:
    rows, metas = [], []
    for rel in ("prefill_attention.json", "prefill_attention_32k.json"):
        meta, r = _attention_rows(rel)
        metas.append(meta)
        rows += r
    lengths = sorted({r["T"] for r in rows})
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "dense-sdpa"]
    by = {(r["shape"], r["method"], r["T"]): r for r in rows}
    m0 = metas[0]
    lines = [
        f"Synthetic q/k/v (`{m0['source']}`), {m0['cpu']}, {m0['threads']} threads, torch {m0['torch']}, "
        f"blocks of {m0['block']}, best of {m0['repeats']} after a compiling warm-up; recall and relative "
        "error on "
        f"{m0['rows_sampled']} sampled query rows; commits "
        + ", ".join(f"{m['git_commit']} ({', '.join(str(x) for x in m['lengths'])})" for m in metas)
        + ". Each cell: speedup over dense SDPA (select + execute) / recall / density; no interval.",
        "",
        "| shape | selector | " + " | ".join(f"T = {t}" for t in lengths) + " |",
        "|---|---|" + "---:|" * len(lengths),
    ]
    for s in shapes:
        for m in methods:
            cells = []
            for t in lengths:
                r = by.get((s, m, t))
                cells.append(f"{r['speedup']:.2f}× / {r['recall']:.3f} / {r['density']:.2f}" if r else "—")
            lines.append(f"| {s} | {_code(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_real() -> str:
    meta, rows = _attention_rows("prefill_attention_real_gemma3.json")
    dense = {r["T"]: r["dense_s"] for r in rows if r["method"] == "dense-sdpa"}
    lines = [
        f"`{meta['source']}`, layer {rows[0]['shape']} (H = {rows[0]['H']}, H_kv = {rows[0]['H_kv']}, "
        f"D = {rows[0]['D']}), {meta['cpu']}, {meta['threads']} thread, load average "
        f"{meta['load_avg_1m']:.1f}, "
        f"commit {meta['git_commit']}; {meta['repeats']} timed repeat after a compiling warm-up: every "
        "speedup is "
        "one timing (n = 1, no interval).",
        "",
        "| T | selector | density | recall | rel. error | select ms | exec ms | dense ms | speedup |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["method"] == "dense-sdpa":
            continue
        lines.append(
            f"| {r['T'] // 1024}k | {_code(r['method'])} | {r['density']:.3f} | {r['recall']:.3f} | "
            f"{r['rel_error']:.3f} | {1000 * r['select_s']:.0f} | {1000 * r['exec_s']:.0f} | "
            f"{1000 * dense[r['T']]:.0f} | {r['speedup']:.2f}× |"
        )
    return "\n".join(lines)


def goal_rows(rows: list[dict[str, Any]], speedup: float = 2.0, recall: float = 0.95) -> list[dict[str, Any]]:
    """The rows at the largest T that reach both ``speedup`` (over dense) and ``recall``."""
    top = max(r["T"] for r in rows)
    return [
        r
        for r in rows
        if r["T"] == top and r["method"] != "dense-sdpa" and r["speedup"] >= speedup and r["recall"] >= recall
    ]


def verdict_goal() -> str:
    """The issue's goal: at 32k, one selector at least 2× faster than dense SDPA at ≥ 95% recall."""
    real_meta, real = _attention_rows("prefill_attention_real_gemma3.json")
    synth_meta, synth = _attention_rows("prefill_attention_32k.json")
    out = []
    for name, meta, rows in (
        ("real Gemma3 layer 11 q/k/v", real_meta, real),
        ("synthetic q/k/v", synth_meta, synth),
    ):
        top = max(r["T"] for r in rows)
        hits = goal_rows(rows)
        best = max(
            (r for r in rows if r["T"] == top and r["recall"] >= 0.95 and r["method"] != "dense-sdpa"),
            key=lambda r: r["speedup"],
            default=None,
        )
        best_txt = (
            f"the fastest selector with recall ≥ 0.95 is {_code(best['method'])} ({best['shape']}) at "
            f"{best['speedup']:.2f}× (recall {best['recall']:.3f})"
            if best
            else "no selector reaches recall 0.95"
        )
        met = ", ".join(
            f"{_code(r['method'])} ({r['shape']}, {r['speedup']:.2f}×, recall {r['recall']:.3f})"
            for r in hits
        )
        out.append(
            f"- **{name}, T = {top}: {'met' if hits else 'not met'}**"
            + (f" by {met}" if hits else "")
            + f"; {best_txt}. Best of {meta['repeats']} timing(s) per cell, no interval."
        )
    out += ["", f"Reproduce: `{COMMANDS['real']}`; synthetic: `{COMMANDS['synthetic']}`."]
    return "\n".join(out)


def table_prefill_time() -> str:
    d = _json("prefill_time.json")
    hw = d["hardware"]
    lines = [
        f"{hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}, commit {hw['git_commit']}, load average "
        f"{hw['load_avg_1m']:.1f}; best of {d['args']['repeats']} (all timings listed), no interval.",
        "",
        "| model | context tokens | chunk size | prefill s (best) | all timings s |",
        "|---|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {_code(r['model'])} | {r['context_tokens']} | {r['chunk_size']} | {r['prefill_s']:.1f} | "
            + ", ".join(f"{x:.1f}" for x in r["all_s"])
            + " |"
        )
    lines += ["", f"Reproduce: `{COMMANDS['prefill_time']}`."]
    return "\n".join(lines)


BLOCKS = {
    "sp-4k": table_4k,
    "sp-4k-tasks": table_4k_tasks,
    "sp-4k-verdicts": verdicts_4k,
    "sp-2k": table_2k,
    "sp-2k-time-tasks": table_2k_time_tasks,
    "sp-2k-verdicts": verdicts_2k,
    "sp-backends": table_backends,
    "sp-synthetic": table_synthetic,
    "sp-real": table_real,
    "sp-goal": verdict_goal,
    "sp-prefill-time": table_prefill_time,
}


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every block of :data:`BLOCKS` from ``ROOT/bench/results`` (this page draws no plots)."""
    _ROOT[0] = root
    return {name: make() for name, make in BLOCKS.items()}
