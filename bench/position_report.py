"""Tables and plots of the position sweep, written into docs/results/position.md between its markers.

    .venv/bin/python bench/position_report.py --db runs/position/eval/results.sqlite \\
        --ppl bench/results/position/ppl.json --doc docs/results/position.md

Reads the ``longlab eval --positions`` rows (model ``smollm2-135m|METHOD``; ``smollm2-135m`` is the model's
own RoPE, the baseline) and the perplexity JSON of ``bench/position_ppl.py``. Scores: mean ×100 over every
task's samples with a 95% interval (Wilson for pass/fail cells, else bootstrap; stratified by task when
several), and the paired difference to no scaling on the same samples (paired bootstrap; n.s. when the
interval holds 0). The tables and plots are generated, never typed in.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import defaultdict
from pathlib import Path

START, END = "<!-- position-tables:start -->", "<!-- position-tables:end -->"


def _label(model: str) -> str:
    return model.split("|", 1)[1] if "|" in model else "none"


def _short(method: str) -> str:
    """A plot label: trained-weight and factor-file paths replaced by a word."""
    import re

    out = re.sub(r",?weights=[^,]+", "", method)
    out = re.sub(r",?factors=[^,]+", "", out)
    out = out.replace(":,", ":").rstrip(":")
    if "weights=" in method:
        out += " (recal.)"
    if "factors=" in method:
        out += " (searched)"
    return out


def _pooled(ppl_by_bin: dict[tuple[int, int], float], lo: int, hi: int) -> str:
    """Token-weighted perplexity over the bins inside ``[lo, hi)`` (from their perplexities)."""
    import math

    bins = [(b, v) for b, v in ppl_by_bin.items() if b[0] >= lo and b[1] <= hi]
    if not bins or sum(b[1] - b[0] for b, _ in bins) != hi - lo:
        return "—"
    nll = sum((b[1] - b[0]) * math.log(v) for b, v in bins) / (hi - lo)
    return f"{math.exp(nll):.2f}"


def _sign_test(pairs: list[tuple[list[float], list[float]]]) -> float | None:
    """Two-sided exact sign test on the discordant pairs (McNemar's exact test for pass/fail scores);
    ``None`` when scores are not all 0/1."""
    from math import comb

    a = [x for xs, _ in pairs for x in xs]
    b = [y for _, ys in pairs for y in ys]
    if any(v not in (0.0, 1.0) for v in a + b):
        return None
    up = sum(1 for x, y in zip(a, b) if x > y)
    down = sum(1 for x, y in zip(a, b) if x < y)
    n = up + down
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(up, down) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _style(i: int) -> dict:
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10").colors
    return {"color": colours[i % 10], "ls": ("-", "--", ":")[(i // 10) % 3]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="runs/position/eval/results.sqlite")
    ap.add_argument("--ppl", default="bench/results/position/ppl.json")
    ap.add_argument("--doc", default="docs/results/position.md")
    ap.add_argument("--plots", default="docs/results")
    ap.add_argument("--vs", default="none,yarn:factor=2", help="baselines of the paired-difference tables")
    args = ap.parse_args()
    from longlab.eval.stats import paired_difference, stratified_difference, stratified_estimate

    rows = []
    if Path(args.db).exists():
        con = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True)
        rows = con.execute("select model, task, length, sample_id, score, prefill_s from results").fetchall()
        con.close()
    cell: dict[tuple[str, int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    secs: dict[tuple[str, int], list[float]] = defaultdict(list)
    for model, task, length, sid, score, prefill in rows:
        cell[(_label(model), length)][task][sid] = float(score)
        secs[(_label(model), length)].append(float(prefill or 0))
    methods = sorted({m for m, _ in cell}, key=lambda m: (m != "none", m))
    lengths = sorted({n for _, n in cell})
    lines = [
        "| method | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    baselines = [b for b in args.vs.split(",") if any(m == b for m in methods)]
    diff_lines = {
        b: [lines[0], lines[1]]
        for b in baselines
    }
    curves: dict[str, list[tuple[int, float, float, float]]] = {}
    for m in methods:
        out = []
        for n in lengths:
            tasks = cell.get((m, n))
            if not tasks:
                out.append("—")
                continue
            strata = [list(v.values()) for _, v in sorted(tasks.items())]
            est = stratified_estimate(strata)
            out.append(f"{100 * est.mean:.0f} [{100 * est.low:.0f}, {100 * est.high:.0f}] (n={est.n})")
            curves.setdefault(m, []).append((n, est.mean, est.low, est.high))
        lines.append(f"| `{m}` | " + " | ".join(out) + " |")
        for b in baselines:
            dout = []
            for n in lengths:
                tasks, base = cell.get((m, n)), cell.get((b, n))
                if m == b:
                    dout.append("baseline")
                    continue
                pairs = []
                for task, scores in sorted((tasks or {}).items()):
                    common = sorted(set(scores) & set((base or {}).get(task, {})))
                    if common:
                        pairs.append(([scores[s] for s in common], [base[task][s] for s in common]))
                if not pairs:
                    dout.append("—")
                    continue
                d = stratified_difference(pairs) if len(pairs) > 1 else paired_difference(*pairs[0])
                npair = sum(len(a) for a, _ in pairs)
                p = _sign_test(pairs)
                # a bootstrap over 1-3 pairs has a degenerate interval: significant only when the exact
                # sign test (McNemar for pass/fail) agrees
                sig = d.significant and (p is None or p < 0.05)
                mark = ("" if sig else " n.s.") + (f", sign test p={p:.2f}" if p is not None else "")
                ci = f"[{100 * d.low:+.0f}, {100 * d.high:+.0f}]"
                dout.append(f"{100 * d.mean:+.0f} {ci}{mark} (n={npair})")
            diff_lines[b].append(f"| `{m}` | " + " | ".join(dout) + " |")
    parts: list[str] = []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rows:
        tasks_seen = sorted({t for v in cell.values() for t in v})
        parts += [
            f"Scores ×100 (mean over {', '.join(tasks_seen)}; 95% interval; n = rows in the cell):",
            "",
            *lines,
            "",
        ]
        for b in baselines:
            parts += [
                f"Paired difference to `{b}` on the same samples, ×100 (95% paired bootstrap; n.s. unless "
                "the interval excludes 0 *and* the exact sign test on the discordant pairs gives p < 0.05):",
                "",
                *diff_lines[b],
                "",
            ]
        fig, ax = plt.subplots(figsize=(9, 4.2))
        for i, (m, pts) in enumerate(curves.items()):
            dodge = 2 ** (0.03 * (i - (len(curves) - 1) / 2))  # side by side, so the bars do not overlap
            xs = [p[0] * dodge for p in pts]
            ax.errorbar(
                xs,
                [100 * p[1] for p in pts],
                yerr=[[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]],
                marker="o",
                capsize=3,
                label=_short(m),
                alpha=0.85,
                **_style(i),
            )
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
        ax.set_xlabel("prompt length (tokens; methods side by side); dotted: SmolLM2's trained 8k")
        ax.set_ylabel("score ×100 (95% CI)")
        ax.set_title("SmolLM2-135M: " + ", ".join(tasks_seen))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(args.plots) / "position-score-vs-length.png", dpi=120)
        parts.append("![score vs length](position-score-vs-length.png)")
        parts.append("")
    if Path(args.ppl).exists():
        ppl = json.loads(Path(args.ppl).read_text())
        fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
        bins = None
        table = []
        order = sorted(ppl.items(), key=lambda kv: (kv[1]["method"] != "none", kv[0]))
        for i, (_key, rec) in enumerate(order):
            xs = [(b["lo"] + b["hi"]) / 2 for b in rec["bins"]]
            ys = [b["ppl"] for b in rec["bins"]]
            ax.plot(xs, ys, marker=".", label=_short(rec["method"]), **_style(i))
            if max(ys) < 20:  # the methods that stay near the base model: their own panel, linear scale
                zoom.plot(xs, ys, marker=".", label=_short(rec["method"]), **_style(i))
            bins = bins or [(b["lo"], b["hi"]) for b in rec["bins"]]
            table.append(
                (
                    rec["method"],
                    rec["length"],
                    {(b["lo"], b["hi"]): b["ppl"] for b in rec["bins"]},
                    rec["seconds"],
                )
            )
        for a in (ax, zoom):
            a.axvline(8192, color="grey", ls=":", lw=1)
            a.set_xlabel("token position")
        ax.set_yscale("log")
        ax.set_ylabel("perplexity of the tokens in the bin")
        ax.set_title("all methods (log scale); dotted: trained 8k", fontsize=10)
        zoom.set_title("methods with perplexity < 20 in every bin (linear)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.suptitle("SmolLM2-135M, pydoc text, chunked prefill (1,024)")
        fig.tight_layout()
        fig.savefig(Path(args.plots) / "position-ppl-vs-position.png", dpi=120)
        allbins = sorted({b for _, _, d, _ in table for b in d})
        parts += [
            "Perplexity by token position (Python's pydoc topics text; one pass per method):",
            "",
            "| method | " + " | ".join(f"{lo // 1024}-{hi // 1024}k" for lo, hi in allbins)
            + " | **0-8k** | **8-16k** | s |",
            "|---|" + "---|" * (len(allbins) + 3),
        ]
        for m, _, d, s in table:
            parts.append(
                f"| `{m}` | "
                + " | ".join(f"{d[b]:.1f}" if b in d else "—" for b in allbins)
                + f" | {_pooled(d, 0, 8192)} | {_pooled(d, 8192, 16384)} | {s:.0f} |"
            )
        parts += ["", "![perplexity vs position](position-ppl-vs-position.png)", ""]
    doc = Path(args.doc)
    text = doc.read_text() if doc.exists() else f"{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(head + START + "\n" + "\n".join(parts) + "\n" + END + tail)
    print("\n".join(parts))


if __name__ == "__main__":
    main()
