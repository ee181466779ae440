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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="runs/position/eval/results.sqlite")
    ap.add_argument("--ppl", default="bench/results/position/ppl.json")
    ap.add_argument("--doc", default="docs/results/position.md")
    ap.add_argument("--plots", default="docs/results")
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
    diff_lines = [
        "| method | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    curves: dict[str, list[tuple[int, float, float, float]]] = {}
    for m in methods:
        out, dout = [], []
        for n in lengths:
            tasks = cell.get((m, n))
            if not tasks:
                out.append("—")
                dout.append("—")
                continue
            strata = [list(v.values()) for _, v in sorted(tasks.items())]
            est = stratified_estimate(strata)
            out.append(f"{100 * est.mean:.0f} [{100 * est.low:.0f}, {100 * est.high:.0f}] (n={est.n})")
            curves.setdefault(m, []).append((n, est.mean, est.low, est.high))
            base = cell.get(("none", n))
            if m == "none" or not base:
                dout.append("baseline" if m == "none" else "—")
                continue
            pairs = []
            for task, scores in sorted(tasks.items()):
                common = sorted(set(scores) & set(base.get(task, {})))
                if common:
                    pairs.append(([scores[s] for s in common], [base[task][s] for s in common]))
            if not pairs:
                dout.append("—")
                continue
            d = stratified_difference(pairs) if len(pairs) > 1 else paired_difference(*pairs[0])
            mark = "" if d.significant else " n.s."
            dout.append(f"{100 * d.mean:+.0f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{mark}")
        lines.append(f"| `{m}` | " + " | ".join(out) + " |")
        diff_lines.append(f"| `{m}` | " + " | ".join(dout) + " |")
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
            "Paired difference to no scaling (`none`) on the same samples, ×100 (95% paired bootstrap):",
            "",
            *diff_lines,
            "",
        ]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for m, pts in curves.items():
            xs = [p[0] for p in pts]
            ax.errorbar(
                xs,
                [100 * p[1] for p in pts],
                yerr=[[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]],
                marker="o",
                capsize=3,
                label=m,
                alpha=0.85,
            )
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens); dotted: SmolLM2's trained 8k")
        ax.set_ylabel("score ×100 (95% CI)")
        ax.set_title("SmolLM2-135M: " + ", ".join(tasks_seen))
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(args.plots) / "position-score-vs-length.png", dpi=120)
        parts.append("![score vs length](position-score-vs-length.png)")
        parts.append("")
    if Path(args.ppl).exists():
        ppl = json.loads(Path(args.ppl).read_text())
        fig, ax = plt.subplots(figsize=(7, 4.2))
        bins = None
        table = []
        for _key, rec in sorted(ppl.items(), key=lambda kv: (kv[1]["method"] != "none", kv[0])):
            xs = [(b["lo"] + b["hi"]) / 2 for b in rec["bins"]]
            ax.plot(xs, [b["ppl"] for b in rec["bins"]], marker=".", label=rec["method"])
            bins = bins or [(b["lo"], b["hi"]) for b in rec["bins"]]
            table.append(
                (
                    rec["method"],
                    rec["length"],
                    {(b["lo"], b["hi"]): b["ppl"] for b in rec["bins"]},
                    rec["seconds"],
                )
            )
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("token position")
        ax.set_ylabel("perplexity of the tokens in the bin")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(Path(args.plots) / "position-ppl-vs-position.png", dpi=120)
        allbins = sorted({b for _, _, d, _ in table for b in d})
        parts += [
            "Perplexity by token position (Python's pydoc topics text; one pass per method):",
            "",
            "| method | " + " | ".join(f"{lo // 1024}-{hi // 1024}k" for lo, hi in allbins) + " | s |",
            "|---|" + "---|" * (len(allbins) + 1),
        ]
        for m, _, d, s in table:
            parts.append(
                f"| `{m}` | "
                + " | ".join(f"{d[b]:.1f}" if b in d else "—" for b in allbins)
                + f" | {s:.0f} |"
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
