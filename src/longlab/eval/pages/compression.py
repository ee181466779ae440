"""The generated blocks of ``docs/results/compression.md``: context compression against KV compression
at equal memory (issue #13), from the committed ``longlab eval`` stores under ``bench/results/compression/``.

For each task: accuracy (mean score, 95% CI: Wilson for pass/fail) of every method at each removed fraction
r (kept KV memory 1 - r of the full cache: a context compressor keeps ``ceil((1-r) n)`` context tokens, a
KV policy ``ceil((1-r) n)`` entries per head), on the same samples; a paired bootstrap of each method against
SnapKV at the same r and against the full cache; the compression step's own time (``extra.context_s``)
against the prefill time it saves (paired per sample, medians); KIVI at the memory it measurably holds.
Moved from ``bench/compression_table.py`` (its ``--needles`` check, which needs the tokenizer, stays there).

InftyThink (Yan et al., arXiv 2503.06692) against one long context on ``lookup_chain_reason``
(:data:`INFTYTHINK`, the ``longlab eval`` store of ``bench/configs/compression-inftythink.toml``): accuracy
with Wilson intervals, paired bootstrap against ``full``, tokens generated, peak KV and iterations
(:func:`inftythink_rows`, :func:`inftythink_table`, :func:`inftythink_plot`).

COMI's soft variant against its hard variant and the full prompt (:data:`COMI_SOFT`, the teacher-forced store
of ``bench/configs/compression-comi-soft.toml``, with the fusion layer's committed training record):
:func:`comi_soft_table`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..stats import paired_difference, score_estimate
from ..store import ResultStore

__all__ = ["GRIDS", "INFTYTHINK", "COMI_SOFT", "Grid", "cite_table", "comi_soft_table", "hico_forward_table",
           "inftythink_plot", "inftythink_rows", "inftythink_speed_table", "inftythink_table", "load", "plot",
           "render", "table"]

TOKEN = ("llmlingua", "longllmlingua", "hico", "tpp", "comi")
# token dropping inside the prefill forward (hico-forward@r, query-aware); --alias names its variants
FORWARD = ("hico-forward-qa", "hico-forward-l3-qa")
KV = ("snapkv", "tova", "hico-drop", "snapkv-qa", "tova-qa", "hico-drop-qa")  # -qa: --query-aware runs
QUANT = ("kivi4", "kivi2")  # quantized KV: no ratio; placed at the memory it measurably holds


def _split(recipe: str) -> tuple[str, float]:
    if recipe == "full":
        return "full", 0.0
    name, _, ratio = recipe.partition("@")
    return name, float(ratio.split(":")[0]) if ratio else 0.0


def load(dirs: list[str], aliases: dict[str, tuple[str, float]] | None = None
         ) -> dict[str, dict[tuple[str, float], dict[str, dict]]]:
    """task -> (method, r) -> sample_id -> row. ``aliases``: recipe -> (column, r) placing a recipe's rows
    in a column of its own at a nominal r (e.g. a hico-forward variant at the memory it holds)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for d in dirs:
        with ResultStore(d, readonly=True) as store:
            for row in store.iter_rows():
                if row["recipe"] in (aliases or {}):
                    out[row["task"]][aliases[row["recipe"]]][row["sample_id"]] = row  # type: ignore[index]
                    continue
                if "+" in row["recipe"]:
                    key = (row["recipe"], -1.0)
                else:
                    key = _split(row["recipe"])
                if row["query_aware"] and key[0] in ("snapkv", "tova", "hico-drop", "full", "hico-forward"):
                    key = (key[0] + "-qa", key[1])
                out[row["task"]][key][row["sample_id"]] = row
    return out


def _cell(rows: dict[str, dict], ids: list[str]) -> str:
    if not all(i in rows for i in ids):
        return "—"
    e = score_estimate([rows[i]["score"] for i in ids])
    return f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}]"


def _diff(a: dict[str, dict], b: dict[str, dict], ids: list[str]) -> str:
    if not ids or not all(i in a and i in b for i in ids):
        return "—"
    d = paired_difference([a[i]["score"] for i in ids], [b[i]["score"] for i in ids])
    sig = "" if d.low <= 0 <= d.high else " *"
    return f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{sig}"


def table(data: dict, ratios: list[float]) -> tuple[str, dict]:
    lines, curves = [], {}
    for task, cells in sorted(data.items()):
        full = cells.get(("full", 0.0), {})
        methods = [m for m in (*TOKEN, *FORWARD, *KV) if any((m, r) in cells for r in ratios)]
        # the samples every cell of the grid holds (a sweep cut short leaves its last sample out)
        ids = sorted(set(full).intersection(*(set(cells[(m, r)]) for m in methods for r in ratios
                                                if (m, r) in cells)))
        lines += [f"### {task} (n = {len(ids)} samples, the same in every cell)", "",
                  "| kept memory | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for r in ratios:
            row = [f"{1 - r:g}" + (" (full)" if r == 0 else "")]
            for m in methods:
                rows = full if r == 0 else cells.get((m, r), {})
                cell = _cell(rows, ids)
                base = cells.get(("full-qa", 0.0), {}) if m.endswith("-qa") else full
                kept = 1.0 - r  # the plot's x: the memory actually held, where measured
                if r > 0 and rows and all(i in rows for i in ids) and (m in FORWARD and not base
                                                                       or all(i in base for i in ids)):
                    # without a query-aware full run, a -qa row's own uncompressed size is the base
                    kept = statistics.fmean(rows[i]["kv_bytes_after"] / (
                        base[i]["kv_bytes_after"] if base else rows[i]["kv_bytes_before"]) for i in ids)
                    if kept > 1.15 * (1 - r) + 0.02:  # more memory than asked (TPP, hico-drop's early layers)
                        cell += f" † ({kept:.2f})"
                row.append(cell)
                if rows and all(i in rows for i in ids):
                    curves.setdefault(task, {}).setdefault(m, []).append(
                        (kept, statistics.fmean(rows[i]["score"] for i in ids)))
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "†: not at equal memory: the cache holds more than asked (its fraction of full shown).",
                  "", "Paired difference (method - SnapKV, same kept memory; *: the 95% CI excludes 0):",
                  "", "| kept memory | " + " | ".join(m for m in methods if m != "snapkv") + " |",
                  "|---|" + "---|" * (len(methods) - 1)]
        for r in ratios[1:]:
            snap = cells.get(("snapkv", r), {})
            lines.append(f"| {1 - r:g} | " + " | ".join(
                _diff(cells.get((m, r), {}), snap, ids) for m in methods if m != "snapkv") + " |")
        lines += ["", "Paired difference (method - the full cache):", "",
                  "| kept memory | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for r in ratios[1:]:
            diffs = [_diff(cells.get((m, r), {}), full, ids) for m in methods]
            lines.append(f"| {1 - r:g} | " + " | ".join(diffs) + " |")
        lines += ["", "Compression time vs prefill saved (medians over samples, seconds; saved = full-cache "
                  "prefill - the method's prefill of its shorter context, same sample):", "",
                  "| method | r | context_s | prefill_s | full prefill_s | saved | kept tokens / original |",
                  "|---|---|---|---|---|---|---|"]
        for m in TOKEN:
            for r in ratios[1:]:
                rows = cells.get((m, r), {})
                common = [i for i in ids if i in rows]
                if not common:
                    continue
                cs = statistics.median(rows[i]["extra"].get("context_s", 0.0) for i in common)
                ps = statistics.median(rows[i]["prefill_s"] for i in common)
                fs = statistics.median(full[i]["prefill_s"] for i in common)
                saved = statistics.median(full[i]["prefill_s"] - rows[i]["prefill_s"] for i in common)
                kept = statistics.fmean(rows[i]["extra"]["context"]["kept_tokens"]
                                        / rows[i]["extra"]["context"]["original_tokens"] for i in common)
                lines.append(f"| {m} | {r:g} | {cs:.2f} | {ps:.2f} | {fs:.2f} | {saved:.2f} | {kept:.3f} |")
        lines += quant_section(cells, full, ids, ratios, methods, curves.setdefault(task, {}))
        combos = sorted(k[0] for k in cells if k[1] == -1.0)
        if combos:
            lines += ["", "Combined recipes:", "", "| recipe | accuracy | kv_bytes_after / full |",
                      "|---|---|---|"]
            for c in combos:
                rows = cells[(c, -1.0)]
                frac = statistics.fmean(rows[i]["kv_bytes_after"] / full[i]["kv_bytes_after"]
                                        for i in ids if i in rows)
                lines.append(f"| {c} | {_cell(rows, ids)} | {frac:.3f} |")
        lines.append("")
    return "\n".join(lines), curves


def quant_section(cells: dict, full: dict, ids: list[str], ratios: list[float], methods: list[str],
                  curves: dict) -> list[str]:
    """KIVI beside the eviction and token methods: its accuracy at the KV memory it measurably holds
    (``kv_bytes_after`` over the full cache's: codes, scales and the full-precision residual), and paired
    differences against every method at the two nominal kept memories that bracket it (the one above
    holds more memory than KIVI, the one below less)."""
    quant = [q for q in QUANT if (q, 0.0) in cells and all(i in cells[(q, 0.0)] for i in ids)]
    if not quant or not ids:
        return []
    nominal = sorted((r for r in ratios if r > 0), key=lambda r: 1 - r)  # kept memory, increasing
    out = ["", "Quantized KV (KIVI, G = 32, R = 128) at the memory it holds (same samples); paired "
           "difference KIVI - method at the nominal kept memories bracketing it (*: the 95% CI excludes 0):",
           "", "| recipe | accuracy | KV memory held / full | vs kept memory | " + " | ".join(methods) + " |",
           "|---|---|---|---|" + "---|" * len(methods)]
    for q in quant:
        rows = cells[(q, 0.0)]
        held = statistics.fmean(rows[i]["kv_bytes_after"] / full[i]["kv_bytes_after"] for i in ids)
        below = [r for r in nominal if 1 - r <= held][-1:]
        above = [r for r in nominal if 1 - r > held][:1]
        for k, near in enumerate(above + below):
            diffs = [_diff(rows, cells.get((m, near), {}), ids) for m in methods]
            head = f"| {q} | {_cell(rows, ids)} | {held:.3f} |" if k == 0 else "| | | |"
            out.append(f"{head} {1 - near:g} | " + " | ".join(diffs) + " |")
        curves[q] = [(held, statistics.fmean(rows[i]["score"] for i in ids))]
    return out


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (task, methods) in zip(axes[0], sorted(curves.items())):
        colours = [*plt.get_cmap("tab10").colors, "black", "gold"]
        for k, (m, pts) in enumerate(methods.items()):
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*" if m in QUANT else "o",
                    markersize=11 if m in QUANT else 5, label=m, color=colours[k % len(colours)],
                    linestyle="none" if m in QUANT else ("--" if m in KV else "-"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV memory held (fraction of the full cache, measured)")
        ax.set_ylabel("accuracy")
        ax.set_title(task)
        ax.set_ylim(-0.05, 1.05)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


@dataclass(frozen=True)
class Grid:
    """One generated table set: its block (and plot) name, the stores it reads, the removed fractions
    shown, and aliases placing a recipe's rows in a column of their own at a nominal r."""

    name: str
    dirs: tuple[str, ...]
    ratios: tuple[float, ...]
    aliases: dict[str, tuple[str, float]] = field(default_factory=dict)


_L3 = {"hico-forward@0.8333:stages=[0.1]": ("hico-forward-l3-qa", 0.75)}
GRIDS = (
    Grid("compression-redundant_niah", ("compression/redundant_niah", "compression/redundant_niah-qa"),
         (0.0, 0.5, 0.75, 0.875, 0.9375)),
    Grid("compression-redundant_niah-2k",
         ("compression/redundant_niah-2k", "compression/redundant_niah-2k-qa"),
         (0.0, 0.75), _L3),
    Grid("compression-multidoc_qa_1", ("compression/multidoc_qa_1", "compression/multidoc_qa_1-qa"),
         (0.0, 0.75), _L3),
)


INFTYTHINK = "compression/inftythink_ask"  # the store of bench/configs/compression-inftythink.toml
INFTYTHINK_BLOCK = "compression-inftythink"


def inftythink_rows(directory: str | Path) -> list[dict]:
    """The rows of an InftyThink sweep (a ``longlab eval`` store), one dict per row: ``recipe``, ``length``,
    ``sample_id``, ``steps`` (the chain's), ``score``, ``generated`` (reasoning + asked summary tokens),
    ``peak_kv_bytes`` (``full``: its cache after the last token, ``extra.kv_bytes_end``; InftyThink: the
    largest cache of any iteration, its own counter), ``prompt_tokens``, ``final_tokens`` (the answer's),
    ``iterations``, ``stop`` and ``seconds`` (prefill + decode). A row without those counters (a batched
    ``full`` row keeps no cache) is refused, naming it."""
    from ...errors import LonglabError

    out = []
    with ResultStore(str(directory), readonly=True) as store:
        for row in store.iter_rows():
            extra, rec = row["extra"], row["extra"].get("context") or {}
            where = f"{directory}: row {row['recipe']} {row['sample_id']}"
            if "iterations" in rec:  # InftyThink's own counters
                generated = int(rec["reasoning_tokens"]) + int(rec.get("summary_tokens_used", 0))
                peak, iterations = int(rec["peak_kv_bytes"]), int(rec["iterations"])
                stop = rec.get("stop", "")
            elif "kv_bytes_end" in extra:
                generated, peak = int(extra["generated_tokens"]), int(extra["kv_bytes_end"])
                iterations, stop = 1, ""
            else:
                raise LonglabError(f"{where} has neither InftyThink's counters nor kv_bytes_end "
                                   "(run the sweep with --no-batch-decode)")
            out.append({
                "recipe": row["recipe"], "length": row["length"], "sample_id": row["sample_id"],
                "steps": (extra.get("sample") or {}).get("steps"), "score": float(row["score"]),
                "generated": generated, "peak_kv_bytes": peak, "prompt_tokens": int(extra["prompt_tokens"]),
                "final_tokens": int(extra["generated_tokens"]), "iterations": iterations, "stop": stop,
                "seconds": float(row["prefill_s"] or 0) + float(row["decode_s"] or 0),
            })
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _label(recipe: str) -> str:
    if recipe == "full":
        return "full (one long context)"
    name, _, params = recipe.partition(":")
    return "InftyThink (ask)" if name == "inftythink" and "summarise=ask" in params else f"`{recipe}`"


def inftythink_table(rows: list[dict]) -> str:
    """Per chain length and recipe, on the samples every recipe holds: accuracy (Wilson 95%), the paired
    bootstrap difference against ``full`` (2,000 resamples; ``*``: the interval excludes 0), tokens
    generated, peak KV (MiB, and tokens beyond the prompt at the same sample's ``full`` bytes per cached
    token: its cache holds prompt + answer - 1 tokens) and iterations; then all lengths pooled with the
    sign test over the discordant pairs, how the rows stopped and their times; only the samples every
    recipe holds count."""
    from .paired import fmt_p, sign_test

    base = "full"
    recipes = sorted({r["recipe"] for r in rows}, key=lambda r: (r != base, r))
    by = {(r["recipe"], r["sample_id"]): r for r in rows}
    # only the samples every recipe holds (a sweep cut short leaves an unpaired row out of every line)
    rows = [r for r in rows if all((rc, r["sample_id"]) in by for rc in recipes)]
    lines = ["| chain (steps) | recipe | n | accuracy [95% CI] | − full (paired) [95% CI] | tokens generated "
             "(median, max) | peak KV MiB (median, max) | peak KV tokens beyond the prompt (median, max) "
             "| iterations |", "|---|---|---|---|---|---|---|---|---|"]
    pairs: list[tuple[float, float]] = []
    for length in sorted({r["length"] for r in rows}):
        ids = sorted({r["sample_id"] for r in rows if r["length"] == length})
        ids = [i for i in ids if all((rc, i) in by for rc in recipes)]  # the same samples in every cell
        if not ids:
            continue
        steps = sorted({by[(recipes[0], i)]["steps"] for i in ids}, key=str)
        span = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
        full = {i: by[(base, i)] for i in ids if (base, i) in by}
        per = {i: f["peak_kv_bytes"] / (f["prompt_tokens"] + f["final_tokens"] - 1) for i, f in full.items()}
        for recipe in recipes:
            cell = [by[(recipe, i)] for i in ids]
            est = score_estimate([c["score"] for c in cell])
            diff = "—"
            if recipe != base and base in recipes:
                mine, theirs = [c["score"] for c in cell], [by[(base, i)]["score"] for i in ids]
                pairs += zip(mine, theirs)
                d = paired_difference(mine, theirs, resamples=2000)
                diff = f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{' *' if d.significant else ''}"
            made = sorted(c["generated"] for c in cell)
            peak = sorted(c["peak_kv_bytes"] / 2**20 for c in cell)
            extra = sorted(c["peak_kv_bytes"] / per[i] - c["prompt_tokens"]
                           for c, i in zip(cell, ids) if i in per)
            its = sorted(c["iterations"] for c in cell)
            beyond = f"{_median(extra):.0f}, {extra[-1]:.0f}" if extra else "—"
            lines.append(
                f"| {length} tokens ({span}) | {_label(recipe)} | {len(cell)} | {est.mean:.2f} "
                f"[{est.low:.2f}, {est.high:.2f}] | {diff} | {_median(made):.0f}, {made[-1]} | "
                f"{_median(peak):.2f}, {peak[-1]:.2f} | {beyond} | {_median(its):.0f} ({its[0]}-{its[-1]}) |")
    if pairs:
        d = paired_difference([a for a, _ in pairs], [b for _, b in pairs], resamples=2000)
        mine, theirs = (statistics.fmean(x) for x in zip(*pairs))
        worse, better = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
        lines += ["", f"all lengths pooled: n = {len(pairs)} pairs, accuracy {mine:.2f} vs full "
                  f"{theirs:.2f}; difference {d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}] "
                  f"({'significant' if d.significant else 'not significant'}); sign test over the "
                  f"{worse + better} discordant pairs: {worse} full better, {better} InftyThink better, "
                  f"p = {fmt_p(sign_test(better, worse))}."]
    stops = []
    for recipe in recipes:
        if recipe == base:
            continue
        mine = [r for r in rows if r["recipe"] == recipe]
        counts: dict[str, int] = defaultdict(int)
        for r in mine:
            counts[r["stop"] or "plain"] += 1
        why = {"end of turn": "at end of turn", "iterations": "at the iteration cap",
               "no summary": "without a summary"}
        stops.append(f"{_label(recipe)}: "
                     + ", ".join(f"{n} {why.get(k, k)}" for k, n in sorted(counts.items())))
    times = []
    for recipe in recipes:
        secs = sorted(r["seconds"] for r in rows if r["recipe"] == recipe)
        times.append(f"{_label(recipe)} {secs[0]:.0f}–{secs[-1]:.0f} s (median {_median(secs):.0f} s)")
    lines += ["", "How the rows stopped: " + "; ".join(stops) + ". Time per row: "
              + ", ".join(times) + "."]
    return "\n".join(lines)


def inftythink_plot(rows: list[dict], path: Path, model: str = "") -> None:
    """Peak KV (MiB) against the tokens generated (reasoning + asked summaries), one point per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    markers = {n: m for n, m in zip(sorted({r["length"] for r in rows}), "os^Dv")}
    recipes = sorted({r["recipe"] for r in rows}, key=lambda r: (r != "full", r))
    for colour, recipe in zip(colours, recipes):
        for length, marker in markers.items():
            cell = [r for r in rows if r["recipe"] == recipe and r["length"] == length]
            if cell:
                ax.scatter([r["generated"] for r in cell], [r["peak_kv_bytes"] / 2**20 for r in cell],
                           color=colour, marker=marker,
                           label=f"{_label(recipe).strip('`')}, {length}-token chain")
    ax.set_xlabel("tokens generated (reasoning + asked summaries)")
    ax.set_ylabel("peak KV cache (MiB)")
    ax.set_title(f"InftyThink vs one long context{', ' + model if model else ''}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, bbox_inches="tight", dpi=110, metadata={"Software": None})
    plt.close(fig)


COMI_SOFT = "compression/comi_soft"  # the store of bench/configs/compression-comi-soft.toml
COMI_SOFT_BLOCK = "compression-comi-soft"
COMI_FUSION_MANIFEST = "compression/comi_fusion_r0.875.json"  # `longlab train comi`'s record, committed


def _comi_label(recipe: str) -> str:
    if recipe == "full":
        return "full prompt"
    return "COMI-soft (trained fusion)" if ":fusion=" in recipe else "COMI-hard (training-free)"


def comi_soft_table(directory: str | Path, manifest: dict | None = None) -> str:
    """COMI's soft variant against its hard variant and the full prompt, from a teacher-forced ``longlab
    eval`` store: per recipe the accuracy (greedy would emit the answer; Wilson 95%), the answer's NLL per
    token (``extra.answer_nll``; median and bootstrap mean) and the KL to full; then soft - hard, paired on
    the same samples (bootstrap). ``manifest``: the fusion layer's training record (``train comi``)."""
    from ...errors import LonglabError
    from ..rows import load_rows

    rows = load_rows(directory, what="COMI soft store")
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if (r["extra"] or {}).get("score_mode") != "forced":
            raise LonglabError(f"{directory}: row {r['recipe']} / {r['sample_id']} is not teacher-forced")
        by[r["recipe"]][str(r["sample_id"])] = r
    order = sorted(by, key=lambda rec: (rec != "full", ":fusion=" in rec))
    soft = next((rec for rec in order if ":fusion=" in rec), None)
    hard = next((rec for rec in order if rec != "full" and ":fusion=" not in rec), None)
    if soft is None or hard is None:
        raise LonglabError(f"{directory}: needs a comi@r row and a comi@r:fusion=PATH row")
    lines = ["| recipe | n | accuracy [95% CI] | answer NLL / token: median, mean [95% CI] "
             "| KL to full (mean) |", "|---|---|---|---|---|"]
    for rec in order:
        got = list(by[rec].values())
        acc = score_estimate([r["score"] for r in got])
        nll = [r["extra"]["answer_nll"] for r in got]
        est = score_estimate(nll)
        kls = [r["extra"].get("kl_vs_full") for r in got if r["extra"].get("kl_vs_full") is not None]
        kl = f"{statistics.fmean(kls):.2f}" if kls and rec != "full" else "—"
        lines.append(f"| {_comi_label(rec)} (`{rec}`) | {len(got)} | {acc.mean:.2f} [{acc.low:.2f}, "
                     f"{acc.high:.2f}] | {statistics.median(nll):.2f}, {est.mean:.2f} [{est.low:.2f}, "
                     f"{est.high:.2f}] | {kl} |")
    common = sorted(set(by[soft]) & set(by[hard]))
    d_acc = paired_difference([by[soft][i]["score"] for i in common], [by[hard][i]["score"] for i in common])
    d_nll = paired_difference([by[soft][i]["extra"]["answer_nll"] for i in common],
                              [by[hard][i]["extra"]["answer_nll"] for i in common])

    def verdict(d) -> str:
        sig = "significant" if d.low > 0 or d.high < 0 else "not significant"
        return f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}] ({sig})"

    lines += ["", f"Soft − hard, paired on the same {len(common)} samples (bootstrap): accuracy "
              f"{verdict(d_acc)}; answer NLL per token {verdict(d_nll)}."]
    preds = [by[soft][i]["prediction"] for i in common[:3]]
    if any(preds):
        lines.append("")
        def shown(text: str) -> str:
            return "`" + repr(text).replace("`", "'") + "`"

        lines.append("Greedy argmax along the answer, first samples: soft " + ", ".join(map(shown, preds))
                     + "; hard " + ", ".join(shown(by[hard][i]["prediction"]) for i in common[:3]) + ".")
    if manifest:
        t = manifest.get("training") or {}
        log = t.get("loss_every_10_steps") or []
        lines += ["", f"Fusion layer (`{COMI_FUSION_MANIFEST.split('/')[-1]}`, `longlab train comi`): "
                  f"{manifest.get('samples')} `{manifest.get('task')}` samples of {manifest.get('seq_len')} "
                  f"tokens, {manifest.get('steps')} steps, lr {manifest.get('lr')}, {t.get('params'):,} "
                  f"parameters; merging {t.get('prep_s', 0):.0f} s, training {t.get('train_s', 0):.0f} s; "
                  "training loss per 10 steps " + " → ".join(f"{x:.2f}" for x in log[:2])
                  + (f" … {log[-1]:.2f}" if len(log) > 2 else "") + " nats per answer token."]
    return "\n".join(lines)


HICO_FORWARD = "compression/hico_forward.json"  # bench/compression.py hico-forward
INFTYTHINK_SPEED = "compression/inftythink_speed.json"  # bench/compression.py inftythink-speed
CITE = {"compression-cite": "compression/cite_qa", "compression-cite-qwen": "compression/cite_qa_qwen"}


def _ci(t: list[float] | tuple[float, ...], sign: str = "") -> str:
    return f"{t[0]:{sign}.2f} [{t[1]:{sign}.2f}, {t[2]:{sign}.2f}]"


def hico_forward_table(data: dict) -> str:
    """HiCo inside the prefill forward vs a plain prefill (``bench/compression.py hico-forward``'s JSON):
    median prefill time, time ratio to plain (median, bootstrap 95% CI), KV held, accuracy (Wilson) and the
    paired difference to plain (bootstrap; * = the interval excludes 0)."""
    summary = data["summary"]
    n = len({r["sample_id"] for r in data.get("rows", [])}) or data.get("args", {}).get("samples")
    lines = [f"n = {n} samples. *: the paired interval excludes 0.", "",
             "| prefill | median prefill s | time / plain [95% CI] | KV held / full | accuracy [95% CI] "
             "| − plain (paired) |", "|---|---|---|---|---|---|"]
    for name, rec in summary.items():
        label = "plain (one forward)" if name == "plain" else f"HiCoForward r = {name.split('@')[1]}"
        t = rec.get("time_ratio_median_ci")
        ratio = f"**{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]**" if t else "1"
        diff = ""
        if "minus_plain" in rec:
            d = rec["minus_plain"]
            diff = _ci(d, "+") + (" *" if d[1] > 0 or d[2] < 0 else "")
        lines.append(f"| {label} | {rec['prefill_s_median']:.2f} | {ratio} | {rec['kv_fraction']:.3f} "
                     f"| {_ci(rec['accuracy'])} | {diff} |")
    return "\n".join(lines)


def inftythink_speed_table(rows: list[dict]) -> str:
    """InftyThink's prompt prefilled once and forked per iteration vs refilled every iteration
    (``bench/compression.py inftythink-speed``'s JSON): each repeat's seconds, the ratio of the medians,
    and whether both produced the same tokens."""
    lines = ["| sample (prompt tokens) | iterations | once (s), per repeat | refill (s), per repeat "
             "| refill / once (medians) | same tokens | load |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        once = ", ".join(f"{x:.1f}" for x in r["once_s"])
        refill = ", ".join(f"{x:.1f}" for x in r["refill_s"])
        lines.append(f"| `{r['sample_id']}` ({r['prompt_tokens']}) | {r['iterations']} | {once} | {refill} "
                     f"| **{r['speedup']:.2f}x** | {'yes' if r['same_tokens'] else 'no'} | {r['load']:.1f} |")
    return "\n".join(lines)


def cite_table(directory: str | Path, base: str = "full") -> str:
    """Citation scores per recipe on ``cite_qa`` from a ``longlab eval`` store: answer correctness
    (Wilson), citation precision / recall / F1 (bootstrap) by :func:`longlab.tasks.compression.
    citation_scores` over the samples every recipe answered, how many answers write a ``[k]`` marker,
    Guidance's forced sentences per sample; then each recipe minus ``base`` on the same samples (paired
    bootstrap; * = the interval excludes 0)."""
    from ...errors import LonglabError
    from ...tasks.compression import citation_scores
    from ..rows import load_rows

    rows: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in load_rows(directory, what="cite_qa store"):
        rows[row["recipe"]][str(row["sample_id"])] = row
    if not rows:
        raise LonglabError(f"{directory}: no rows")
    ids = sorted(set.intersection(*(set(r) for r in rows.values())))  # samples every recipe answered
    parts = ("correct", "precision", "recall", "f1")
    scores = {rc: {i: citation_scores(rows[rc][i]["prediction"], rows[rc][i]["answers"]) for i in ids}
              for rc in rows}
    lines = [f"n = {len(ids)} samples answered by every recipe. Intervals: Wilson for correctness, bootstrap "
             "for precision / recall / F1.", "",
             "| recipe | answer correct | citation precision | recall | F1 | writes a `[k]` marker "
             "| forced sentences / sample |", "|---|---|---|---|---|---|---|"]
    for rc in rows:
        cells = []
        for part in parts:
            e = score_estimate([scores[rc][i][part] for i in ids])
            cells.append(f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}]")
        cites = sum("[" in (rows[rc][i]["prediction"] or "") for i in ids)
        forced = [(rows[rc][i]["extra"] or {}).get("context", {}).get("forced_sentences") for i in ids]
        known = [f for f in forced if f is not None]
        forced_txt = f"{sum(known) / len(ids):.1f} ({sum(known)} in all)" if known else "—"
        lines.append(f"| `{rc}` | {' | '.join(cells)} | {cites}/{len(ids)} | {forced_txt} |")
    if base in rows and len(rows) > 1:
        lines += ["", f"Each recipe − `{base}` on the same samples (paired bootstrap; *: the interval "
                  "excludes 0):", "", "| recipe | answer correct | precision | recall | F1 |",
                  "|---|---|---|---|---|"]
        for rc in rows:
            if rc == base:
                continue
            cells = []
            for part in parts:
                d = paired_difference([scores[rc][i][part] for i in ids],
                                      [scores[base][i][part] for i in ids])
                cells.append(f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{' *' if d.significant else ''}")
            lines.append(f"| `{rc}` | {' | '.join(cells)} |")
    return "\n".join(lines)


def render(root: Path, plots: bool) -> dict[str, str]:
    """One block per :data:`GRIDS` entry and the InftyThink block; with ``plots`` each PNG goes to
    ``docs/results/NAME.png``."""
    results = root / "bench" / "results"
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for grid in GRIDS:
            data = load([str(results / d) for d in grid.dirs], grid.aliases)
            text, curves = table(data, list(grid.ratios))
            image = f"{grid.name}.png"
            if curves:
                target = root / "docs" / "results" / image if plots else Path(scratch) / image
                plot(curves, target)
                text = f"![accuracy vs KV memory held]({image})\n\n{text}"
            out[grid.name] = text
        rows = inftythink_rows(results / INFTYTHINK)
        image = f"{INFTYTHINK_BLOCK}.png"
        if plots:
            inftythink_plot(rows, root / "docs" / "results" / image, "Qwen2.5-Coder-0.5B-Instruct")
        out[INFTYTHINK_BLOCK] = f"{inftythink_table(rows)}\n\n![peak KV vs tokens generated]({image})"
    manifest_file = results / COMI_FUSION_MANIFEST
    manifest = json.loads(manifest_file.read_text(encoding="utf-8")) if manifest_file.is_file() else None
    out[COMI_SOFT_BLOCK] = comi_soft_table(results / COMI_SOFT, manifest)
    out["compression-hico-forward"] = hico_forward_table(
        json.loads((results / HICO_FORWARD).read_text(encoding="utf-8")))
    out["compression-inftythink-speed"] = inftythink_speed_table(
        json.loads((results / INFTYTHINK_SPEED).read_text(encoding="utf-8")))
    for block, store in CITE.items():
        out[block] = cite_table(results / store)
    return out
