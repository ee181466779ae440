"""The generated block of ``docs/results/position.md``: the position sweep's tables and plots.

Reads the committed rows of ``longlab eval --positions`` (``bench/results/position/task_rows.json``,
``gemma_rows.json``; model ``smollm2-135m|METHOD``, ``smollm2-135m`` alone being the model's own RoPE, the
baseline; rows with ``compress: chunk`` cut the cache after every chunk), the perplexity JSONs of
``bench/position.py ppl``, the UPI runs
(``upi_passkey*.json``) and the retrained variants' figures (``variants.json``). Scores: mean x100 over
every task's samples with a 95% interval (Wilson for pass/fail cells, else bootstrap; stratified by task
when several), and the paired difference to no scaling on the same samples (paired bootstrap; n.s. when
the interval holds 0). Moved from ``longlab report --docs --page results/position``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

__all__ = ["render"]



def _label(model: str) -> str:
    return model.split("|", 1)[1] if "|" in model else "none"


def _short(method: str) -> str:
    """A plot label: trained-weight and factor-file paths replaced by a word."""
    import re

    out = re.sub(r",?weights=[^,]+", "", method)
    out = re.sub(r",?factors=[^,]+", "", out)
    out = out.replace(":,", ":").rstrip(":")
    budget = re.search(r"weights=[^,]*-s(\d+)(?:,|$)", method)  # runs/position/repo-smollm2-s80: 80 steps
    if budget:
        out += f" (recal., {budget.group(1)} steps)"
    elif "weights=" in method:
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


def _style(i: int) -> dict:
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10").colors
    return {"color": colours[i % 10], "ls": ("-", "--", ":")[(i // 10) % 3]}


# the papers' training budgets, in tokens: DroPE recalibrates on 0.5-2% of the pretraining tokens
# (SmolLM2-135M: 2T), RePo continues pretraining OLMo-2 1B on 50B tokens (the specs)
PAPER_TOKENS = {"drope": (0.005 * 2e12, 0.02 * 2e12), "ropeid": (0.005 * 2e12, 0.02 * 2e12),
                "repo": (50e9, 50e9)}


def _variants_section(variants: dict) -> list[str]:
    """The retrained variants: budget (and its fraction of the paper's), held-out loss per window before and
    after training (mean, 95% bootstrap over windows) with the paired difference, RePo's learned offsets.
    ``own RoPE``: the base model on the same windows, which an untrained RePo (δ = 0) is exactly."""
    from ..stats import paired_difference, score_estimate

    def est(xs: list[float]) -> str:
        e = score_estimate(xs)
        return f"{e.mean:.3f} [{e.low:.3f}, {e.high:.3f}]"

    def diff(a: list[float], b: list[float]) -> str:
        d = paired_difference(a, b)
        return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]{'' if d.significant else ' n.s.'}"

    base = {}  # (data, seq_len, windows) -> the base model's losses (an untrained RePo is the base model)
    for v in variants.values():
        held = v.get("heldout_losses_before")
        if v["position"].startswith("repo") and held:
            base[(v.get("data_source"), v["seq_len"], len(held))] = held
    lines = [
        "Retrained variants (`bench/results/position/variants.json`, from each variant's manifest): the "
        "budget and its fraction of the paper's (DroPE: 0.5–2% of SmolLM2's 2T pretraining tokens; RePo: "
        "50B tokens of continued pretraining), then the next-token loss on the held-out windows before → "
        "after training (mean, 95% bootstrap over windows), the paired change (after − before) and the "
        "change against own RoPE on the same windows (an untrained RePo is own RoPE exactly, δ = 0). n.s. "
        "when the interval holds 0. RePo: |δ| = how far the learned positions moved from i, over the "
        "held-out tokens and KV heads.",
        "",
        "| variant | text | steps × seq | tokens | of the paper's | lr, trained | time | train loss "
        "first → last 10 | held-out before → after | after − before | after − own RoPE | "
        "RePo mean / median / max \\|δ\\| |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, v in variants.items():
        before, after = v.get("heldout_losses_before"), v.get("heldout_losses_after")
        if not before or not after:
            continue
        lo, hi = PAPER_TOKENS.get(v["position"].split(":")[0], (0, 0))
        frac = f"{v['tokens'] / hi:.1e}–{v['tokens'] / lo:.1e}" if lo != hi else f"{v['tokens'] / lo:.1e}"
        key = (v.get("data_source"), v["seq_len"], len(before))
        vs_base = diff(after, base[key]) if key in base else "—"
        offsets = (f"{v['repo_offset_abs_mean']:.2f} / {v['repo_offset_abs_median']:.2f} / "
                   f"{v['repo_offset_abs_max']:.1f}" if "repo_offset_abs_mean" in v else "—")
        trained = f"{v['lr']:g}, {v['train']} ({v['trained_parameters'] / 1e6:.1f}M)"
        lines.append(
            f"| `{_short(spec)}` | {v.get('data_source', 'essay')} | {v['steps']} × {v['seq_len']} | "
            f"{v['tokens']:,} | {frac} | {trained} | {v['seconds'] / 60:.0f} min | "
            f"{v['train_loss_first']:.2f} → {v['train_loss_last']:.2f} | "
            f"{est(before)} → {est(after)} (n={len(before)}) | {diff(after, before)} | {vs_base} | "
            f"{offsets} |"
        )
    return lines + [""]


def _load_rows(rows_json: Path) -> list[tuple]:
    """The committed task rows (``bench/results/position/*_rows.json``) as
    ``(model, recipe, task, length, sample_id, score, prefill_s)`` tuples."""
    if not rows_json.is_file():
        return []
    export = json.loads(rows_json.read_text(encoding="utf-8"))
    return [(r["model"], _shown_recipe(r), r["task"], r["length"], r["sample_id"], r["score"], r["prefill_s"])
            for r in export]


def _gemma_section(rows: list[tuple]) -> list[str]:
    """Gemma-3-270M (trained to 32k): score per method and length, prefill time, paired YaRN - own RoPE."""
    from ..stats import paired_difference

    grid: dict[tuple[str, str, int], dict[str, float]] = defaultdict(dict)
    prefill: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for model, _recipe, task, length, sid, score, prefill_s in rows:
        key = (_label(model), task, length)
        grid[key][sid] = float(score)
        prefill[key].append(float(prefill_s or 0.0))
    methods = sorted({k[0] for k in grid}, key=lambda m: (m != "none", m))
    parts = ["Gemma-3-270M (trained to 32,768 positions; 15 sliding layers of 512 keys keep their RoPE, the "
             "method changes the 3 global layers), full cache, chunk 1,024, greedy, one thread "
             "(`runs/position/gemma/results.sqlite`, copied to `bench/results/position/gemma_rows.json`). "
             "Cell: score ×100 [95% Wilson] (n); median prefill seconds.", ""]
    for task in sorted({k[1] for k in grid}):
        lengths = sorted({k[2] for k in grid if k[1] == task})
        head = " | ".join(f"{n // 1024}k" for n in lengths)
        parts += [f"**{task}** (Gemma 3):", "", f"| method | {head} |", "|---|" + "---|" * len(lengths)]
        for m in methods:
            cells = []
            for n in lengths:
                sc = grid.get((m, task, n))
                if not sc:
                    cells.append("—")
                    continue
                cells.append(f"{_cell(list(sc.values()))}; {statistics.median(prefill[(m, task, n)]):.0f} s")
            parts.append(f"| `{m}` | " + " | ".join(cells) + " |")
        for m in methods:
            if m == "none":
                continue
            cells = []
            for n in lengths:
                x, y = grid.get((m, task, n), {}), grid.get(("none", task, n), {})
                ids = sorted(set(x) & set(y))
                a, b = [x[i] for i in ids], [y[i] for i in ids]
                cells.append(_diff_cell(a, b, paired_difference) if ids else "—")
            parts.append(f"| `{m}` − `none` | " + " | ".join(cells) + " |")
        parts.append("")
    return parts


def _row_key(r: dict) -> tuple:
    return (r["model"], r["recipe"], r.get("compress", "end"), r["task"], r["length"], r["sample_id"])


def _shown_recipe(r: dict) -> str:
    """The recipe as the tables name it: ``snapkv:budget=4096 (per chunk)`` for ``--compress chunk`` rows."""
    return f"{r['recipe']} (per chunk)" if r.get("compress", "end") == "chunk" else r["recipe"]


SCALED = ("pi", "ntk", "dynamic-ntk", "yarn", "longrope")
DEFAULT_FACTOR = 4.0  # a scaled method's factor when its spec names none (format_position drops defaults)
METHOD_ORDER = ("none", *SCALED, "drope", "ropeid", "repo")


def _family(label: str) -> tuple[str, float | None]:
    """``yarn:factor=4`` -> (``yarn``, 4.0); the recalibrated weights' paths become ``(recal.)``."""
    import re

    name = label.split(":", 1)[0]
    factor = None
    if name in SCALED:
        m = re.search(r"(?:^|[:,])factor=([0-9.]+)", label)
        factor = float(m.group(1)) if m else DEFAULT_FACTOR
    fam = re.sub(r"(?:^|(?<=[:,]))factor=[0-9.]+,?", "", label).replace(":,", ":").rstrip(",:")
    return _short(fam), factor


def _convention(length: int) -> float:
    """The page's factor: s = 2 up to 16k, s = L / 8k beyond."""
    return max(2.0, length / 8192) if length > 16384 else 2.0


def _column(length: int, recipe: str | None) -> tuple[int, str]:
    return (length, "full" if recipe in (None, "full") else recipe)


def _column_name(col: tuple[int, str]) -> str:
    length, recipe = col
    k = f"{length // 1024}k"
    if recipe == "full":
        return k
    short = recipe.replace("snapkv:budget=", "SnapKV ").replace(" (per chunk)", "/chunk")
    return f"{k}, {short}"


def _sign_p(a: list[float], b: list[float]) -> tuple[float, int, int]:
    """Two-sided exact sign test on the pairs that differ (McNemar's exact test for pass/fail scores):
    (p, wins of a, wins of b)."""
    from math import comb

    up = sum(1 for x, y in zip(a, b) if x > y)
    down = sum(1 for x, y in zip(a, b) if x < y)
    n = up + down
    if n == 0:
        return 1.0, 0, 0
    tail = sum(comb(n, k) for k in range(min(up, down) + 1)) / 2**n
    return min(1.0, 2 * tail), up, down


def _cell(scores: list[float]) -> str:
    """``mean ×100 [95% interval] (n)``: Wilson for pass/fail; partial scores (vt finds some of several
    variables) give the mean, and the Wilson interval of the samples with every value found."""
    from ..stats import is_binary, wilson_interval

    n = len(scores)
    if is_binary(scores):
        k = int(sum(scores))
        lo, hi = wilson_interval(k, n)
        return f"{100 * k / n:.0f} [{100 * lo:.0f}, {100 * hi:.0f}] (n={n})"
    full = sum(1 for v in scores if v == 1.0)
    lo, hi = wilson_interval(full, n)
    return f"{100 * sum(scores) / n:.0f}; all found {full}/{n} [{100 * lo:.0f}, {100 * hi:.0f}] (n={n})"


def _grid_section(rows: list[tuple], plots: str, plt) -> list[str]:
    """The length x task x method grid: one table per task (rows: methods; columns: length and KV budget),
    pooled paired comparisons with own RoPE and YaRN, and one score-vs-length panel per task."""
    from ..stats import paired_difference, score_estimate

    # (family, task, column) -> sample id -> score; factors seen per (family, column)
    grid: dict[tuple[str, str, tuple[int, str]], dict[str, float]] = defaultdict(dict)
    factors: dict[tuple[str, tuple[int, str]], set[float]] = defaultdict(set)
    for model, recipe, task, length, sid, score, _prefill in rows:
        fam, factor = _family(_label(model))
        col = _column(length, recipe)
        grid[(fam, task, col)][sid] = float(score)
        if factor is not None:
            factors[(fam, col)].add(factor)
    fams = sorted({k[0] for k in grid}, key=lambda f: (
        next((i for i, m in enumerate(METHOD_ORDER) if f.split(":")[0].split(" ")[0] == m), 99), f))
    tasks = sorted({k[1] for k in grid}, key=lambda t: (t != "passkey", t))
    cols = sorted({k[2] for k in grid}, key=lambda c: (c[0], c[1] != "full", c[1]))
    parts = [
        "Task grid (greedy, chunk 1,024; `runs/position/eval/results.sqlite`, kept in "
        "`bench/results/position/task_rows.json` by `bench/position.py tasks`). "
        "Cell: score ×100, 95% Wilson interval, n = samples. "
        "Scaled methods (PI, NTK, dynamic NTK, YaRN, LongRoPE) use s = 2 up to 16k and s = L/8k = 4 at 32k; "
        "a cell with another factor says so. Columns named *SnapKV 4096/chunk*: chunked prefill with "
        "SnapKV cutting every head back to 4,096 cached entries after every 1,024-token chunk "
        "(`--recipe snapkv:budget=4096 --compress chunk`); other columns keep the full cache. — = not run.",
        "",
    ]
    for task in tasks:
        tcols = [c for c in cols if any(k[1] == task and k[2] == c for k in grid)]
        parts += [f"**{task}**:", "", "| method | " + " | ".join(_column_name(c) for c in tcols) + " |",
                  "|---|" + "---|" * len(tcols)]
        for fam in fams:
            cells = []
            for c in tcols:
                sc = grid.get((fam, task, c))
                if not sc:
                    cells.append("—")
                    continue
                fs = factors.get((fam, c), set())
                odd = sorted(f for f in fs if f != _convention(c[0]))
                note = f" (s={'/'.join(f'{f:g}' for f in odd)})" if odd else ""
                cells.append(_cell(list(sc.values())) + note)
            if any(x != "—" for x in cells):
                parts.append(f"| `{fam}` | " + " | ".join(cells) + " |")
        parts.append("")
    # coverage: samples per task and column, one line per method (what the "Not done" list is made from)
    parts += ["Coverage: samples per cell (passkey / niah_single_1 / vt; 0 = not run).", "",
              "| method | " + " | ".join(_column_name(c) for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for fam in fams:
        parts.append(f"| `{fam}` | " + " | ".join(
            " / ".join(str(len(grid.get((fam, t, c), {}))) for t in ("passkey", "niah_single_1", "vt"))
            for c in cols) + " |")
    parts.append("")
    # pooled paired comparisons: same task, same column, same sample
    groups = (("≤ 8k", lambda c: c[0] <= 8192), ("> 8k", lambda c: c[0] > 8192), ("all", lambda c: True))
    parts += [
        "Paired comparisons pooled over tasks (and over lengths in the last three columns): mean difference "
        "×100 on the samples both methods ran (same task, length, KV budget, sample), 95% paired bootstrap, "
        "then the wins–losses of the first method and the exact two-sided sign test on them. n.s. unless "
        "the interval excludes 0 *and* p < 0.05.",
        "",
        "| comparison | " + " | ".join(_column_name(c) for c in cols) + " | " + " | ".join(
            g for g, _ in groups) + " |",
        "|---|" + "---|" * (len(cols) + len(groups)),
    ]
    yarn = next((f for f in fams if f == "yarn"), None)
    base_list = ["none"] + ([yarn] if yarn else [])
    for base in base_list:
        for fam in fams:
            if fam == base or (base == "yarn" and fam == "none"):
                continue
            per_col: dict[tuple[int, str], tuple[list[float], list[float]]] = {}
            for c in cols:
                a, b = [], []
                for task in tasks:
                    x, y = grid.get((fam, task, c), {}), grid.get((base, task, c), {})
                    for sid in sorted(set(x) & set(y)):
                        a.append(x[sid])
                        b.append(y[sid])
                if a:
                    per_col[c] = (a, b)
            if not per_col:
                continue
            cells = [_diff_cell(*per_col[c], paired_difference) if c in per_col else "—" for c in cols]
            for _, keep in groups:
                a = [v for c, (x, _) in per_col.items() if keep(c) for v in x]
                b = [v for c, (_, y) in per_col.items() if keep(c) for v in y]
                cells.append(_diff_cell(a, b, paired_difference) if a else "—")
            parts.append(f"| `{fam}` − `{base}` | " + " | ".join(cells) + " |")
    parts.append("")
    # one panel per task: score vs length, one curve per method
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks) + 2.4, 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        shown = [f for f in fams if any(k[0] == f and k[1] == task for k in grid)]
        for i, fam in enumerate(shown):
            dodge = 2 ** (0.035 * (i - (len(shown) - 1) / 2))  # side by side, so the bars do not overlap
            pts = []
            for c in cols:
                sc = grid.get((fam, task, c))
                if sc:
                    est = score_estimate(list(sc.values()))  # Wilson for pass/fail, else bootstrap
                    pts.append((c[0] * dodge, 100 * est.mean, 100 * est.low, 100 * est.high, c[1] != "full"))
            style = _style(_colour_index(fam))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, alpha=0.8, label=_short(fam), **style)
            for budget in (False, True):
                sel = [p for p in pts if p[4] == budget]
                if sel:
                    ax.errorbar([p[0] for p in sel], [p[1] for p in sel],
                                yerr=[[p[1] - p[2] for p in sel], [p[3] - p[1] for p in sel]],
                                marker="s" if budget else "o", mfc="white" if budget else style["color"],
                                capsize=2, elinewidth=0.8, alpha=0.8, color=style["color"], ls="none")
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        lengths = sorted({c[0] for c in cols})
        ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
        ax.set_xlabel("prompt length; dotted: trained 8k", fontsize=8)
        ax.set_ylabel("score ×100 (95% CI)")
        ax.set_ylim(-5, 105)
        ax.set_title(f"SmolLM2-135M: {task}", fontsize=10)
    handles, labels = {}, []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, fontsize=7, loc="upper left",
               bbox_to_anchor=(1.0 - 2.3 / (4.6 * len(tasks) + 2.4), 0.95), borderaxespad=0,
               title="filled: full cache\nhollow: SnapKV 4096/chunk", title_fontsize=7)
    fig.tight_layout(rect=(0, 0, 1.0 - 2.4 / (4.6 * len(tasks) + 2.4), 1))
    fig.savefig(Path(plots) / "position-score-vs-length.png", dpi=120, metadata={"Software": None})
    return parts + ["![score vs length](position-score-vs-length.png)", ""]


def _diff_cell(a: list[float], b: list[float], paired_difference) -> str:
    d = paired_difference(a, b)
    p, up, down = _sign_p(a, b)
    sig = d.significant and p < 0.05
    return (f"{100 * d.mean:+.0f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}] {up}–{down}, p={p:.2f}"
            f"{'' if sig else ' n.s.'} (n={len(a)})")


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
        fig.savefig(Path(args.plots) / "position-ppl-vs-position.png", dpi=120, metadata={"Software": None})
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

    from ..stats import bootstrap_ci, paired_difference

    data = json.loads(Path(args.ppl_blocks).read_text())
    old = json.loads(Path(args.ppl).read_text()) if Path(args.ppl).exists() else {}
    recs = sorted(data.values(), key=lambda r: (r["method"] != "none", r["method"] != "yarn:factor=2",
                                               r["method"]))
    blocks = {r["method"]: {h: _half_blocks(r, lo, hi) for lo, hi, h in HALVES} for r in recs}
    lines = [
        f"Perplexity with intervals (`bench/results/position/ppl_blocks.json`): the same text and "
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
    fig.savefig(Path(args.plots) / "position-ppl-intervals.png", dpi=120, metadata={"Software": None})
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


def _upi_section(data: dict, plots: str, plt, name: str = "position-upi") -> list[str]:
    """UPI on the hybrid (``bench/upi_hybrid.py --task passkey``): the seed-pooled score per variant and
    length (mean of seed means; 95% bootstrap over test sequences inside each seed), the per-seed means,
    and paired differences on the same test sequences (stratified by seed); the plot is ``name``.png."""
    from ..stats import stratified_difference, stratified_estimate

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
    pairs = [(upi, "none"), (upi, "yarn only"), (upi, "all heads + YaRN"), ("yarn only", "none"),
             ("all heads + YaRN", "none")]
    if "top 20% Δ/n only" in variants:  # --more: the Mamba heads' part without YaRN
        pairs += [("top 20% Δ/n only", "none"), (upi, "top 20% Δ/n only"), ("all heads Δ/n only", "none")]
    for a, b in pairs:
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
    fig.savefig(Path(plots) / f"{name}.png", dpi=120, metadata={"Software": None})
    return lines + [f"![UPI on the hybrid]({name}.png)", ""]



def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's ``position-tables`` block; with ``plots`` the PNGs go to ``docs/results/``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = root / "bench" / "results" / "position"
    with tempfile.TemporaryDirectory() as scratch:
        out = root / "docs" / "results" if plots else Path(scratch)
        args = SimpleNamespace(
            ppl=str(res / "ppl.json"), plots=str(out), vs="none,yarn:factor=2",
            ppl_blocks=str(res / "ppl_blocks.json"), upi=str(res / "upi_passkey.json"),
            upi_more=str(res / "upi_passkey_more.json"), variants=str(res / "variants.json"),
        )
        rows = _load_rows(res / "task_rows.json")
        parts: list[str] = []
        if Path(args.variants).exists():
            parts += _variants_section(json.loads(Path(args.variants).read_text(encoding="utf-8")))
        if rows:
            parts += _grid_section(rows, args.plots, plt)
        parts += _ppl_section(args, plt)
        if Path(args.ppl_blocks).exists():
            parts += _ppl_blocks_section(args, plt)
        gemma_rows = _load_rows(res / "gemma_rows.json")
        if gemma_rows:
            parts += _gemma_section(gemma_rows)
        if Path(args.upi).exists():
            parts += _upi_section(json.loads(Path(args.upi).read_text(encoding="utf-8")), args.plots, plt)
        if Path(args.upi_more).exists():
            more = json.loads(Path(args.upi_more).read_text(encoding="utf-8"))
            parts += _upi_section(more, args.plots, plt, name="position-upi-more")
        plt.close("all")
    return {"position-tables": "\n".join(parts)}
