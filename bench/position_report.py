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
    ap.add_argument("--long", default="bench/results/position/long.json", help="position_long.py output")
    ap.add_argument("--ppl-blocks", default="bench/results/position/ppl_blocks.json",
                    help="position_ppl.py --block output (intervals and paired tests)")
    ap.add_argument("--upi", default="bench/results/position/upi_passkey.json", help="upi_hybrid.py output")
    args = ap.parse_args()
    from longlab.eval.stats import paired_difference, stratified_difference, stratified_estimate

    rows = []
    if Path(args.db).exists():
        con = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True)
        rows = con.execute(
            "select model, recipe, task, length, sample_id, score, prefill_s from results"
        ).fetchall()
        con.close()
    if Path(args.long).exists():  # bench/position_long.py: chunked prefill compressing after every chunk
        for r in json.loads(Path(args.long).read_text()):
            model = "smollm2-135m" + ("" if r["position"] == "none" else f"|{r['position']}")
            recipe = r["recipe"] + " (per chunk)"
            rows.append((model, recipe, r["task"], r["length"], r["sample_id"], r["score"], r["prefill_s"]))
    parts: list[str] = []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks_seen = sorted({r[2] for r in rows}, key=lambda t: (t != "passkey", t))
    if rows:
        width = 9 + 3 * (len(tasks_seen) - 1)
        fig, axes = plt.subplots(1, len(tasks_seen), figsize=(width, 4.2), squeeze=False)
    for ti, task_name in enumerate(tasks_seen):
        task_rows = [r for r in rows if r[2] == task_name]
        parts += _task_tables(args, task_name, task_rows, axes[0][ti], stratified_estimate,
                              stratified_difference, paired_difference)
    if rows:
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(args.plots) / "position-score-vs-length.png", dpi=120)
        parts.append("![score vs length](position-score-vs-length.png)")
        parts.append("")
    parts += _ppl_section(args, plt)
    if Path(args.ppl_blocks).exists():
        parts += _ppl_blocks_section(args, plt)
    if Path(args.upi).exists():
        parts += _upi_section(json.loads(Path(args.upi).read_text()), args.plots, plt)
    doc = Path(args.doc)
    text = doc.read_text() if doc.exists() else f"{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(head + START + "\n" + "\n".join(parts) + "\n" + END + tail)
    print("\n".join(parts))


def _task_tables(args, task_name, rows, ax, stratified_estimate, stratified_difference, paired_difference):
    """The score table, paired-difference tables and one plot panel of one task."""
    cell: dict[tuple[str, int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for model, recipe, task, length, sid, score, _prefill in rows:
        label = _label(model) + ("" if recipe in (None, "full") else f" + {recipe}")
        cell[(label, length)][task][sid] = float(score)
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
            if any(c != "—" for c in dout):
                diff_lines[b].append(f"| `{m}` | " + " | ".join(dout) + " |")
    parts: list[str] = [
        f"**{task_name}**: scores ×100 (mean; 95% interval, Wilson for pass/fail; n = samples in the cell):",
        "",
        *lines,
        "",
    ]
    for b in baselines:
        if len(diff_lines[b]) > 2 and any("(n=" in ln for ln in diff_lines[b][2:]):
            parts += [
                f"{task_name}: paired difference to `{b}` on the same samples, ×100 (95% paired bootstrap; "
                "n.s. unless the interval excludes 0 *and* the exact sign test on the discordant pairs gives "
                "p < 0.05):",
                "",
                *diff_lines[b],
                "",
            ]
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
            **_style(_colour_index(m)),
        )
    ax.axvline(8192, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("prompt length (methods side by side); dotted: trained 8k", fontsize=8)
    ax.set_ylabel("score ×100 (95% CI)")
    ax.set_ylim(-5, 105)
    ax.set_title(f"SmolLM2-135M: {task_name}")
    return parts


_COLOURS: dict[str, int] = {}


def _colour_index(method: str) -> int:
    """One colour per method across every panel."""
    return _COLOURS.setdefault(method, len(_COLOURS))


def _ppl_section(args, plt) -> list[str]:
    parts: list[str] = []
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
    return parts


BLOCK = 256  # tokens per bootstrap block (the stored 64-token sums, four at a time)
HALVES = ((0, 8192, "0-8k"), (8192, 16384, "8-16k"))


def _half_blocks(rec: dict, lo: int, hi: int) -> list[float]:
    """Mean NLL per token of each ``BLOCK``-token block of ``nll[lo:hi]`` (``nll[i]`` predicts token
    ``i + 1``), from the stored ``rec["block"]``-token sums."""
    b, sums = rec["block"], rec["block_nll"]
    total = rec["tokens"] - 1  # predicted tokens
    group = BLOCK // b
    out = []
    for start in range(lo, min(hi, total), BLOCK):
        js = range(start // b, min((start + BLOCK) // b, len(sums)))
        count = sum(min(b, total - j * b) for j in js)
        out.append(sum(sums[j] for j in js) / count)
    assert BLOCK % b == 0 and lo % BLOCK == 0 and group >= 1
    return out


def _ppl_blocks_section(args, plt) -> list[str]:
    """Perplexity of each half (0-8k, 8-16k) with a 95% bootstrap interval over 256-token blocks, and
    paired ratios between methods on the same blocks (bench/position_ppl.py --block)."""
    import math

    from longlab.eval.stats import bootstrap_ci, paired_difference

    data = json.loads(Path(args.ppl_blocks).read_text())
    old = json.loads(Path(args.ppl).read_text()) if Path(args.ppl).exists() else {}
    recs = sorted(data.values(), key=lambda r: (r["method"] != "none", r["method"] != "yarn:factor=2",
                                               r["method"]))
    blocks = {r["method"]: {h: _half_blocks(r, lo, hi) for lo, hi, h in HALVES} for r in recs}
    lines = [
        f"Perplexity with intervals (wave 5; `bench/results/position/ppl_blocks.json`): the same text and "
        f"pass as above, with the NLL kept per 64-token block. Interval: 95% percentile bootstrap over the "
        f"32 {BLOCK}-token blocks of each half (resampling positions of this one text: it says how stable "
        "the number is along the text, not across texts).",
        "",
        "| method | 0-8k | 8-16k | s | load | bins vs the earlier pass |",
        "|---|---|---|---|---|---|",
    ]
    cis = {}
    for r in recs:
        cells = []
        for _lo, _hi, h in HALVES:
            mean, low, high = bootstrap_ci([blocks[r["method"]][h]])
            cis[(r["method"], h)] = (math.exp(mean), math.exp(low), math.exp(high))
            cells.append(f"{math.exp(mean):.2f} [{math.exp(low):.2f}, {math.exp(high):.2f}]")
        prev = old.get(f"{r['method']}@{r['length']}")
        if prev:
            dev = max(abs(a["ppl"] - b["ppl"]) / b["ppl"] for a, b in zip(r["bins"], prev["bins"]))
            same = f"max rel. diff {dev:.1e}"
        else:
            same = "—"
        lines.append(f"| `{r['method']}` | " + " | ".join(cells) + f" | {r['seconds']:.0f} | "
                     f"{r['load']:.1f} | {same} |")
    lines += [
        "",
        "Paired ratio of perplexities on the same blocks, exp(mean NLL difference), 95% paired bootstrap "
        "over "
        f"the {BLOCK}-token blocks; significant when the interval excludes 1, else n.s.:",
        "",
        "| comparison | 0-8k | 8-16k |",
        "|---|---|---|",
    ]
    methods = [r["method"] for r in recs]
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            cells = []
            for _lo, _hi, h in HALVES:
                d = paired_difference(blocks[b][h], blocks[a][h])
                mark = "" if d.significant else " n.s."
                cells.append(f"{math.exp(d.mean):.3f} [{math.exp(d.low):.3f}, {math.exp(d.high):.3f}]{mark}")
            lines.append(f"| `{b}` / `{a}` | " + " | ".join(cells) + " |")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (_lo, _hi, h) in zip(axes, HALVES):
        for i, m in enumerate(methods):
            v, lo_, hi_ = cis[(m, h)]
            ax.errorbar([v], [i], xerr=[[v - lo_], [hi_ - v]], marker="o", capsize=3,
                        **{**_style(_colour_index(m)), "ls": "none"})
        ax.set_yticks(range(len(methods)), [_short(m) for m in methods], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("perplexity (95% block bootstrap)")
        ax.set_title(f"tokens {h}", fontsize=10)
        ax.invert_yaxis()
    fig.suptitle("SmolLM2-135M, pydoc text, 16k pass: perplexity per half with intervals", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(args.plots) / "position-ppl-intervals.png", dpi=120)
    return lines + ["", "![perplexity with intervals](position-ppl-intervals.png)", ""]


def _seed_interval(values: list[float]) -> tuple[float, float]:
    """95% t-interval of the mean of ``values`` (one per training seed); zero width when they agree."""
    import statistics

    from scipy import stats

    if len(values) < 2:
        return float("-inf"), float("inf")
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.975, len(values) - 1) * sd / len(values) ** 0.5
    return mean - half, mean + half


def _upi_section(data: dict, plots: str, plt) -> list[str]:
    """UPI on the hybrid (``bench/upi_hybrid.py --task passkey``): the seed-pooled score per variant and
    length (mean of seed means; 95% bootstrap over test sequences inside each seed), the per-seed means,
    and paired differences on the same test sequences (stratified by seed)."""
    from longlab.eval.stats import stratified_difference, stratified_estimate

    seeds = data["seeds"]
    variants = list(dict.fromkeys(r["variant"] for r in seeds[0]["rows"]))
    lengths = sorted({r["length"] for r in seeds[0]["rows"]})
    scores = {(sd["seed"], r["variant"], r["length"]): r["scores"] for sd in seeds for r in sd["rows"]}
    ids = [sd["seed"] for sd in seeds]
    n = len(seeds[0]["rows"][0]["scores"])
    train_len = data["train_len"]
    lines = [
        f"UPI on the hybrid (passkey, trained at {train_len} tokens, "
        f"{data['steps']} steps × {data['batch']}; "
        f"{len(ids)} training seeds × {n} test sequences per length, the same sequences for every variant): "
        "score ×100 = mean of the seed means, 95% bootstrap over test sequences within seeds; per-seed means "
        "after it.",
        "",
        "| variant | " + " | ".join(f"{n_ // train_len}× ({n_})" for n_ in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    curves = {}
    for v in variants:
        cells = []
        for length in lengths:
            est = stratified_estimate([scores[(sd, v, length)] for sd in ids])
            per = "/".join(f"{100 * sum(scores[(sd, v, length)]) / n:.0f}" for sd in ids)
            cells.append(f"{100 * est.mean:.0f} [{100 * est.low:.0f}, {100 * est.high:.0f}] ({per})")
            curves.setdefault(v, []).append((length, est.mean, est.low, est.high))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences on the same test sequences, ×100: first the 95% paired bootstrap over "
              "test sequences (stratified by seed), then in braces the 95% t-interval over the training "
              "seeds' mean differences (per seed after it). Significant only when both intervals exclude 0; "
              "otherwise n.s.:", "",
              "| comparison | " + " | ".join(f"{n_ // train_len}×" for n_ in lengths[1:]) + " |",
              "|---|" + "---|" * (len(lengths) - 1)]
    upi = next(v for v in variants if v.startswith("UPI"))
    for a, b in ((upi, "none"), (upi, "yarn only"), (upi, "all heads + YaRN"), ("yarn only", "none"),
                 ("all heads + YaRN", "none")):
        cells = []
        for length in lengths[1:]:
            d = stratified_difference([(scores[(sd, a, length)], scores[(sd, b, length)]) for sd in ids])
            per = "/".join(
                f"{100 * (sum(scores[(sd, a, length)]) - sum(scores[(sd, b, length)])) / n:+.0f}"
                for sd in ids
            )
            lo, hi = _seed_interval(
                [(sum(scores[(sd, a, length)]) - sum(scores[(sd, b, length)])) / n for sd in ids]
            )
            mark = "" if d.significant and (lo > 0 or hi < 0) else " n.s."
            cells.append(
                f"{100 * d.mean:+.0f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}] {{{100 * lo:+.0f}, "
                f"{100 * hi:+.0f}}}{mark} ({per})"
            )
        lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    meta = ", ".join(
        f"seed {sd['seed']}: {sd['train_seconds']:.0f} s, final loss {sd['final_train_loss']:.3f}, "
        f"load {sd['load']:.1f}" for sd in seeds
    )
    lines += ["", f"Training: {meta}.", ""]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (v, pts) in enumerate(curves.items()):
        dodge = 2 ** (0.03 * (i - (len(curves) - 1) / 2))
        ax.errorbar([p[0] * dodge for p in pts], [100 * p[1] for p in pts],
                    yerr=[[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]],
                    marker="osD^vP"[i % 6], ms=9 - i, capsize=3, label=v, alpha=0.85,
                    **{**_style(i), "ls": ("-", "--", "-.", ":")[i % 4]})
    ax.axvline(train_len, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n_) for n_ in lengths])
    ax.set_ylim(-5, 105)
    ax.set_xlabel(f"test length (tokens); dotted: training length {train_len}")
    ax.set_ylabel("passkey digits right ×100 (95% CI)")
    ax.set_title(f"Hybrid Mamba2-attention ({data.get('layers', 'MAMA')}), {len(ids)} seeds × {n} sequences "
                 "(overlapping curves: equal scores)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(Path(plots) / "position-upi.png", dpi=120)
    return lines + ["![UPI on the hybrid](position-upi.png)", ""]


if __name__ == "__main__":
    main()
