"""The generated blocks of ``docs/results/spec-decode.md``: speculative and parallel decoding (issue 12).

Reads ``bench/results/spec_eval/results.sqlite[.gz]`` (``longlab eval --speculative``: one row per sample
and configuration, ``extra`` holding acceptance, tokens per target forward, ``speed_vs_plain``,
``bytes_vs_plain``, ``same_as_plain``, ``load_1m``), ``bench/results/spec_decode.json`` (``bench/
spec_decode.py``: the bench run with self-Quest, offline Dustin heads and weights + K/V bytes) and
``bench/results/spec_losa.json`` (``bench/spec_decode.py --losa``: Jacobi blocks, dense vs per-query Quest
vs LoSA). Tables use :mod:`longlab.eval.spec_tables` (Wilson / bootstrap 95% intervals, paired bootstrap
against plain decoding on the same samples). The verdicts are computed from the same rows by the rules
of :func:`claims` (moved from ``bench/spec_decode.py --table`` / ``--eval-grid``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from .paired import Claim

__all__ = [
    "BENCH_CONFIGS",
    "Claim",
    "bench_table",
    "claims",
    "eval_grid_plot",
    "geo_ratio",
    "losa_table",
    "lossless_verdict",
    "render",
    "sparse_verify_verdict",
    "speed_verdict",
]

EVAL_DIR = Path("bench/results/spec_eval")
BENCH = Path("bench/results/spec_decode.json")
LOSA = Path("bench/results/spec_losa.json")
BENCH_CONFIGS = ("plain", "lookup", "lookup+dustin", "self-streaming", "self-streaming+dustin", "self-quest")
LOOKUP, SELF = "full~lookup;full;gamma=10", "full~self:streaming:budget=256;full;gamma=4"
SELF_DUSTIN, LOOKUP_DUSTIN = SELF.replace(";full;", ";dustin;"), LOOKUP.replace(";full;", ";dustin;")
COMMANDS = {
    "bench": "bench/heavy.sh python bench/spec_decode.py --lengths 1024 4096 --samples 1 --threads 1 "
    "--max-new-tokens 24; bench/heavy.sh python bench/spec_decode.py --lengths 8192 --samples 1 --threads 1 "
    "--max-new-tokens 24 --append; bench/heavy.sh python bench/spec_decode.py --lengths 1024 4096 "
    "--samples 1 "
    "--seed 1 --threads 1 --max-new-tokens 24 --append",
    "losa": "bench/heavy.sh python bench/spec_decode.py --losa --lengths 4096 --samples 3 --threads 1 "
    "--tasks niah_single_1 vt --max-new-tokens 12",
}
REPRODUCES, FAILS, NOT_SIG = "reproduces", "does not reproduce", "not significant"


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else f"{x:{spec}}"


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _ci(d: Any, nd: int = 2) -> str:
    ns = "" if d.significant else ", n.s."
    return f"{d.mean:+.{nd}f} [{d.low:+.{nd}f}, {d.high:+.{nd}f}]{ns}"


def geo_ratio(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-sample ratios (each measured side by side with plain decoding on the same
    prompt) with the 95% bootstrap interval of the mean log ratio (a paired test against 1)."""
    from ..stats import bootstrap_ci

    m, lo, hi = bootstrap_ci([[math.log(r) for r in ratios]])
    return math.exp(m), math.exp(lo), math.exp(hi)


def _fmt_geo(g: tuple[float, float, float]) -> str:
    return f"{g[0]:.2f}× [{g[1]:.2f}, {g[2]:.2f}]"


# -- Results 1: the eval grid ----------------------------------------------------------------------------


def grid_rows(root: Path) -> list[dict]:
    from ..rows import load_rows

    return [r for r in load_rows(root / EVAL_DIR) if "spec" in (r.get("extra") or {})]


def grid_commands(rows: list[dict]) -> dict[int, list[str]]:
    """The resumable ``longlab eval`` pieces that produced the grid's rows, per length (samples per task
    and the tasks from the stored plain-decoding rows; model, drafts and verifiers from the config)."""
    counts: dict[tuple[int, str], int] = {}
    for r in rows:
        if r["extra"]["spec"] == "plain":
            counts[(r["length"], r["task"])] = counts.get((r["length"], r["task"]), 0) + 1
    out: dict[int, list[str]] = {}
    for length in sorted({n for n, _ in counts}):
        by_n: dict[int, list[str]] = {}
        for (n, task), k in sorted(counts.items()):
            if n == length:
                by_n.setdefault(k, []).append(task)
        out[length] = [
            f"bench/heavy.sh longlab eval --config bench/configs/spec-eval.toml --lengths {length} "
            f"--samples {k} --tasks {','.join(tasks)}"
            for k, tasks in sorted(by_n.items(), reverse=True)
        ]
    return out


def commands_block(rows: list[dict]) -> str:
    cmds = [c for cs in grid_commands(rows).values() for c in cs]
    return "```bash\n" + "\n".join(cmds) + "\n```" if cmds else "_no rows_"


def dustin_budget(row: dict) -> int | None:
    """Dustin's budget from the row's recipe repr (None for rows verified by ``full``)."""
    m = re.search(r"Dustin\(budget=(\d+)", row.get("recipe_repr") or "")
    return int(m.group(1)) if m else None


def eval_grid_plot(rows: list[dict], path: Path) -> None:
    """Acceptance per task and K/V bytes read per token / plain vs context length, per configuration
    (means with 95% bootstrap intervals over samples)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..stats import bootstrap_ci

    spec = [r for r in rows if r["extra"]["spec"] != "plain"]
    tasks = sorted({r["task"] for r in spec})
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.8), squeeze=False)
    for col, (title, sel_task) in enumerate([(t, t) for t in tasks] + [("K/V bytes read / plain", None)]):
        ax = axes[0][col]
        for k, label in enumerate(sorted({r["recipe"] for r in spec})):
            mine = [r for r in spec if r["recipe"] == label and (sel_task is None or r["task"] == sel_task)]
            lengths = sorted({r["length"] for r in mine})
            mean, low, high = [], [], []
            for n in lengths:
                key = "bytes_vs_plain" if sel_task is None else "acceptance_rate"
                m, lo, hi = bootstrap_ci([[r["extra"][key] for r in mine if r["length"] == n]])
                mean.append(m)
                low.append(m - lo)
                high.append(hi - m)
            short = label.split("~", 1)[-1].replace(";gamma=", " g")
            shift = [n * 1.04**k for n in lengths]  # configs side by side at each length
            style = "--" if ";dustin" in label else "-"
            ax.errorbar(shift, mean, yerr=[low, high], marker="o", ls=style, capsize=3, label=short)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(f"acceptance: {title}" if sel_task else title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].axhline(1.0, color="gray", lw=0.8)
    axes[0][-1].set_title("K/V bytes read per token / plain (mean)", fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        "SmolLM2-135M, greedy, full cache: longlab eval --speculative "
        "(means, 95% bootstrap CIs over samples)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def grid_block(rows: list[dict]) -> str:
    from ..spec_tables import spec_markdown

    if not rows:
        return "_no rows_"
    when = sorted(r["created_at"] for r in rows if r.get("created_at"))
    commits = sorted({r["git_commit"] for r in rows if r.get("git_commit")})
    head = (
        f"{len(rows)} rows, measured {when[0][:16].replace('T', ' ')} to "
        f"{when[-1][:16].replace('T', ' ')} UTC, "
        f"commit {', '.join(commits)}."
    )
    return head + "\n\n" + (spec_markdown(rows) or "")


# -- Results 2: the bench run ----------------------------------------------------------------------------


def bench_table(data: dict) -> str:
    """Per (context, config): acceptance, tokens per forward, speed and bytes ratios to plain decoding of the
    same sample, accuracy (passkey + vt) with its paired difference to plain, identical-token count, load."""
    from ..spec_tables import mean_ci_cell, median_cell, paired_cell, score_ci_cell

    rows = data["rows"]
    plain = {(r["length"], r["sample"]): r for r in rows if r["config"] == "plain"}

    def cpu_ratio(r: dict) -> float | None:  # process CPU time: steadier than wall time on a shared machine
        p = plain.get((r["length"], r["sample"]))
        return (r["n_tokens"] / r["decode_cpu_s"]) / (p["n_tokens"] / p["decode_cpu_s"]) if p else None

    out = [
        "| context | config | n | acceptance [95% CI] | tokens / target forward [95% CI] | tok/s / plain "
        "(median, quartiles; CPU-time median) | KV bytes read per token / plain (median) | "
        "weights + KV bytes per token / plain (median) | accuracy, passkey + vt [95% CI] | "
        "accuracy - plain [paired 95% CI] | tokens = plain | load (1 min) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = list(BENCH_CONFIGS)
    keys = sorted(
        dict.fromkeys((r["length"], r["config"]) for r in rows),
        key=lambda x: (x[0], names.index(x[1]) if x[1] in names else len(names)),
    )
    for length, name in keys:
        sel = [r for r in rows if r["length"] == length and r["config"] == name]
        scored = [r for r in sel if r["score"] is not None]  # the summary prompt has no reference
        pairs = [(r, plain[(r["length"], r["sample"])]) for r in scored]
        is_plain = name == "plain"
        diff = (
            "—"
            if is_plain
            else paired_cell(
                [r["score"] for r, _ in pairs],
                [p["score"] for _, p in pairs],
                sum(bool(r["same_as_plain"]) for r, _ in pairs),
            )
        )
        acc = [r["acceptance_rate"] for r in sel if r["acceptance_rate"] is not None]
        loads = [r["load_1m"] for r in sel]
        cpu = [c for c in (cpu_ratio(r) for r in sel) if c is not None]
        out.append(
            f"| {length} | {name} | {len(sel)} | {mean_ci_cell(acc)} | "
            f"{'1.00' if is_plain else mean_ci_cell([r['tokens_per_forward'] for r in sel])} | "
            f"{median_cell([r['speed_ratio'] for r in sel])}; "
            f"{_fmt(statistics.median(cpu) if cpu else None)} | "
            f"{_fmt(statistics.median(r['bytes_ratio'] for r in sel))} | "
            f"{_fmt(statistics.median(r['total_bytes_ratio'] for r in sel))} | "
            f"{score_ci_cell([r['score'] for r in scored])} | {diff} | "
            f"{sum(bool(r['same_as_plain']) for r in sel)}/{len(sel)} | {min(loads):.1f}-{max(loads):.1f} |"
        )
    loads = [r["load_1m"] for r in rows]
    hw = data["hardware"]
    out.append(
        f"\nload average (1 min) while decoding: {min(loads):.1f}–{max(loads):.1f}; threads {hw['threads']}; "
        f"{hw['cpu']}; torch {hw['torch']}; commit {hw['git_commit']}"
    )
    return "\n".join(out)


def bench_plot(data: dict, path: Path) -> None:
    """Acceptance (mean) and K/V bytes read per token / plain (median) vs context, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["acceptance_rate"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["config"] for r in rows):
        lengths = sorted({r["length"] for r in rows if r["config"] == name})
        acc = [
            statistics.mean(r["acceptance_rate"] for r in rows if r["config"] == name and r["length"] == n)
            for n in lengths
        ]
        byt = [
            statistics.median(r["bytes_ratio"] for r in rows if r["config"] == name and r["length"] == n)
            for n in lengths
        ]
        axes[0].plot(lengths, acc, marker="o", label=name)
        axes[1].plot(lengths, byt, marker="o", label=name)
    for ax, title in zip(axes, ("acceptance rate", "K/V bytes read per token / plain")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, greedy, full cache (longlab.spec)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- Results 3: LoSA -------------------------------------------------------------------------------------

LOSA_KEYS = (
    ("pages_per_layer_step", "prefix pages loaded / layer-step"),
    ("token_agreement", "greedy-token agreement with dense"),
    ("score", "accuracy"),
)


def losa_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(LoSA row, per-query Quest row) of the same sample."""
    by = {(r["sample"], r["attention"]): r for r in rows}
    return [(by[(s, "losa")], by[(s, "quest")]) for s, a in by if a == "losa" and (s, "quest") in by]


def losa_diffs(rows: list[dict]) -> dict[str, Any]:
    from ..stats import paired_difference

    pairs = losa_pairs(rows)
    if not pairs:
        return {}
    return {k: paired_difference([x[k] for x, _ in pairs], [y[k] for _, y in pairs]) for k, _ in LOSA_KEYS}


def losa_table(data: dict) -> str:
    from ..spec_tables import mean_ci_cell, score_ci_cell

    rows = data["rows"]
    out = [
        "| context | task | attention | n | prefix pages loaded / layer-step [95% CI] | active fraction "
        "| logit L∞ vs dense (mean / max) | greedy tokens = dense (per step) [95% CI] | tokens / forward "
        "| accuracy [95% CI] |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, task, att in dict.fromkeys((r["length"], r["task"], r["attention"]) for r in rows):
        sel = [r for r in rows if (r["length"], r["task"], r["attention"]) == (length, task, att)]
        worst = max(r["logit_linf_max"] for r in sel)
        out.append(
            f"| {length} | {task} | {att} | {len(sel)} | "
            f"{mean_ci_cell([r['pages_per_layer_step'] for r in sel], 1)} | "
            f"{_fmt(_mean([r['active_fraction'] for r in sel]))} | "
            f"{_fmt(_mean([r['logit_linf'] for r in sel]))} / {_fmt(worst)} | "
            f"{mean_ci_cell([r['token_agreement'] for r in sel], 3)} | "
            f"{_fmt(_mean([r['tokens_per_forward'] for r in sel]))} | "
            f"{score_ci_cell([r['score'] for r in sel])} |"
        )
    diffs = losa_diffs(rows)
    if diffs:
        out.append(f"\nLoSA − per-query Quest, paired over {len(losa_pairs(rows))} samples (95% CI):")
        for key, what in LOSA_KEYS:
            out.append(f"- {what}: {_ci(diffs[key])}")
    loads = [r["load_1m"] for r in rows]
    hw = data["hardware"]
    out.append(
        f"\nload average (1 min): {min(loads):.1f}–{max(loads):.1f}; threads {hw['threads']}; {hw['cpu']}; "
        f"commit {hw['git_commit']}"
    )
    return "\n".join(out)


# -- verdicts --------------------------------------------------------------------------------------------



def lossless_verdict(identical: int, total: int) -> str:
    """Exact verification: reproduces when every row's tokens equal plain greedy decoding's, else not."""
    if total == 0:
        return "not measured"
    return REPRODUCES if identical == total else FAILS


def speed_verdict(g: tuple[float, float, float]) -> str:
    """'faster than plain decoding': reproduces when the geometric-mean ratio's interval lies above 1, does
    not reproduce when it lies below 1, otherwise not significant."""
    return REPRODUCES if g[1] > 1 else FAILS if g[2] < 1 else NOT_SIG


def sparse_verify_verdict(bytes_diff: Any, accept_diff: Any) -> str:
    """Dustin vs full verification on the same samples: reproduces when it reads significantly fewer K/V
    bytes and its acceptance is not significantly lower; does not reproduce when the bytes are not lower
    or acceptance is significantly lower."""
    if bytes_diff.high >= 0 or accept_diff.high < 0:
        return FAILS
    return REPRODUCES


def ddiff_verdict(d: Any) -> str:
    """'keeps accuracy' (an equality claim): does not reproduce when the paired difference to plain lies
    below 0; otherwise not significant (an interval around 0 does not prove equality)."""
    return FAILS if d.high < 0 else NOT_SIG


def losa_verdict(diffs: dict[str, Any]) -> str:
    """'fewer pages than per-query Quest at equal accuracy': reproduces when the pages are significantly
    fewer and neither accuracy nor agreement with dense attention is significantly lower; does not
    reproduce when the pages are not fewer or either is significantly lower."""
    if not diffs:
        return "not measured"
    pages, agree, acc = diffs["pages_per_layer_step"], diffs["token_agreement"], diffs["score"]
    if pages.high >= 0 or agree.high < 0 or acc.high < 0:
        return FAILS
    return REPRODUCES


def _paired_by_sample(rows: list[dict], a: str, b: str, length: int, key: str) -> Any:
    """Paired bootstrap of ``extra[key]`` of config ``a`` minus config ``b`` over the samples both have."""
    from ..stats import paired_difference

    def by(label: str) -> dict:
        return {
            (r["task"], r["sample_id"], r["seed"]): r["extra"][key]
            for r in rows
            if r["recipe"] == label and r["length"] == length and r["extra"].get(key) is not None
        }

    ra, rb = by(a), by(b)
    ids = sorted(set(ra) & set(rb))
    return paired_difference([ra[i] for i in ids], [rb[i] for i in ids]) if ids else None


def claims(grid: list[dict], bench: dict | None, losa: dict | None) -> list[Claim]:
    """The checked claims, each with the measured figures (95% intervals) and its verdict."""
    from ..spec_tables import mean_ci_cell

    out: list[Claim] = []
    lengths = sorted({r["length"] for r in grid})
    cmds = grid_commands(grid)
    every = "; ".join(c for n in lengths for c in cmds[n])
    # 1. exact verification is lossless
    full_rows = [r for r in grid if r["extra"]["spec"] != "plain" and dustin_budget(r) is None]
    covered = [r for r in grid if (b := dustin_budget(r)) is not None and b >= r["length"]]
    ident = sum(bool(r["extra"]["same_as_plain"]) for r in full_rows)
    ident_cov = sum(bool(r["extra"]["same_as_plain"]) for r in covered)
    here = (
        f"eval grid: {ident}/{len(full_rows)} `full`-verified rows give plain greedy decoding's tokens; "
        "Dustin "
        f"with a budget at least the context length: {ident_cov}/{len(covered)}"
    )
    total, same = len(full_rows) + len(covered), ident + ident_cov
    if bench:
        brows = [r for r in bench["rows"] if r["config"] != "plain" and r.get("verify") == "full"]
        b_same = sum(bool(r["same_as_plain"]) for r in brows)
        here += f"; bench run: {b_same}/{len(brows)} `full`-verified rows"
        total, same = total + len(brows), same + b_same
    out.append(
        Claim(
            "Speculation with exact (`full`) verification is lossless (Leviathan et al.; Chen et al.)",
            here,
            lossless_verdict(same, total),
            every + "; " + COMMANDS["bench"],
        )
    )
    # 2. prompt lookup and self-speculation: tokens/s vs plain, per length
    for label, name in (
        (LOOKUP, "prompt lookup (γ = 10)"),
        (SELF, "self-speculation, StreamingLLM view (γ = 4)"),
    ):
        parts, gs = [], []
        for n in lengths:
            ratios = [r["extra"]["speed_vs_plain"] for r in grid if r["recipe"] == label and r["length"] == n]
            if ratios:
                g = geo_ratio(ratios)
                gs.append(g)
                parts.append(f"{n}: {_fmt_geo(g)} (n = {len(ratios)})")
        verdicts = {speed_verdict(g) for g in gs}
        v = (
            verdicts.pop()
            if len(verdicts) == 1
            else "mixed: " + ", ".join(f"{n} {speed_verdict(g)}" for n, g in zip(lengths, gs))
        )
        out.append(
            Claim(
                f"{name} decodes faster than plain decoding (tokens/s, same prompt side by side)",
                "geometric mean of per-sample tok/s ratios [95% bootstrap CI] by context: "
                + "; ".join(parts),
                v,
                every,
            )
        )
    # 3. MagicDec: self-speculation's K/V read shrinks with context; its acceptance holds
    from ..stats import bootstrap_ci

    byt, acc = {}, {}
    for n in lengths:
        mine = [r["extra"] for r in grid if r["recipe"] == SELF and r["length"] == n]
        if mine:
            byt[n] = bootstrap_ci([[e["bytes_vs_plain"] for e in mine]])
            acc[n] = [e["acceptance_rate"] for e in mine]
    if len(byt) >= 2:
        lo_n, hi_n = min(byt), max(byt)
        shrinks = byt[hi_n][2] < byt[lo_n][1]  # the intervals do not overlap
        v = REPRODUCES if shrinks else NOT_SIG
        out.append(
            Claim(
                "MagicDec: self-speculation reads a shrinking share of the K/V as the context grows",
                "K/V bytes read per token / plain, mean [95% CI]: "
                + "; ".join(f"{n}: {m:.2f} [{lo:.2f}, {hi:.2f}]" for n, (m, lo, hi) in byt.items())
                + "; acceptance: "
                + "; ".join(f"{n}: {mean_ci_cell(a)}" for n, a in acc.items())
                + " (different samples per length: intervals compared, not paired)",
                v,
                every,
            )
        )
    # 4. Dustin: sparse verification reads fewer bytes at equal acceptance (where the budget < context)
    for n in lengths:
        if not any((b := dustin_budget(r)) is not None and b < n for r in grid if r["length"] == n):
            continue  # the budget covers the context: Dustin is exact there (claim 1)
        for full_label, dustin_label, name in (
            (SELF, SELF_DUSTIN, "self-draft"),
            (LOOKUP, LOOKUP_DUSTIN, "lookup"),
        ):
            bd = _paired_by_sample(grid, dustin_label, full_label, n, "bytes_vs_plain")
            ad = _paired_by_sample(grid, dustin_label, full_label, n, "acceptance_rate")
            if bd is None or ad is None:
                continue
            mine = [r for r in grid if r["recipe"] == dustin_label and r["length"] == n]
            same = sum(bool(r["extra"]["same_as_plain"]) for r in mine)
            out.append(
                Claim(
                    "Dustin: sparse verification reads a fraction of the K/V and keeps acceptance "
                    f"({name}, {n})",
                    f"Dustin − full verification, paired over {bd.n} samples: K/V bytes / plain {_ci(bd)}, "
                    f"acceptance {_ci(ad)}; lossy: tokens = plain on {same}/{len(mine)} rows",
                    sparse_verify_verdict(bd, ad),
                    "; ".join(cmds[n]),
                )
            )
    # 4b. Dustin keeps accuracy (sparse rows only), paired with plain decoding on the same samples
    from ..stats import paired_difference

    plain = {
        (r["task"], r["length"], r["sample_id"], r["seed"]): r for r in grid if r["extra"]["spec"] == "plain"
    }
    sparse = [r for r in grid if (b := dustin_budget(r)) is not None and b < r["length"]]
    pairs = [
        (r, plain[k]) for r in sparse if (k := (r["task"], r["length"], r["sample_id"], r["seed"])) in plain
    ]
    if pairs:
        d = paired_difference([r["score"] for r, _ in pairs], [p["score"] for _, p in pairs])
        base = statistics.mean(p["score"] for _, p in pairs)
        sparse_lengths = sorted({r["length"] for r in sparse})
        out.append(
            Claim(
                "Dustin: sparse verification keeps accuracy (every configuration with budget < context)",
                f"score − plain, paired over {d.n} rows: {_ci(d, 3)}; plain decoding's mean score on those "
                f"samples {base:.3f}, so a loss could hardly show; tokens = plain on "
                f"{sum(bool(r['extra']['same_as_plain']) for r, _ in pairs)}/{len(pairs)} rows",
                ddiff_verdict(d),
                "; ".join(c for n in sparse_lengths for c in cmds[n]),
            )
        )
    # 5. LoSA
    if losa:
        d = losa_diffs(losa["rows"])
        if d:
            out.append(
                Claim(
                    "LoSA: fewer prefix pages than per-query Quest at equal accuracy (Jacobi blocks)",
                    f"LoSA − Quest, paired over {len(losa_pairs(losa['rows']))} samples: "
                    + ", ".join(f"{what} {_ci(d[k])}" for k, what in LOSA_KEYS),
                    losa_verdict(d),
                    COMMANDS["losa"],
                )
            )
    return out


def claims_block(cl: list[Claim]) -> str:
    out = []
    for c in cl:
        cmd = "; ".join(f"`{x.strip()}`" for x in c.command.split("; "))
        out.append(f"- **{c.claim}: {c.verdict}.** {c.here.rstrip('.')}. Reproduce: {cmd}.")
    return "\n".join(out)


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every block of the page; with ``plots`` the eval-grid and bench PNGs under ``docs/results/``."""
    grid = grid_rows(root)
    bench, losa = _load(root / BENCH), _load(root / LOSA)
    if plots:
        if grid:
            eval_grid_plot(grid, root / "docs" / "results" / "spec-decode-eval-acceptance.png")
        if bench:
            bench_plot(bench, root / "docs" / "results" / "spec-decode-bench.png")
    return {
        "eval-grid": grid_block(grid),
        "bench": bench_table(bench) if bench else "_no bench run_",
        "losa": losa_table(losa) if losa else "_no LoSA run_",
        "verdicts": claims_block(claims(grid, bench, losa)),
        "commands": commands_block(grid),
    }
