"""The generated blocks of ``docs/results/modalities.md``: layers from other modalities (issue 33).

Tables, verdicts and commands are computed from the compact rows ``bench/results/lab_modalities/*.json``
(written by ``bench/lab_modalities.py``, ≥ 3 training seeds per cell): means with two-sided 95% Student-t
intervals over seeds, paired differences over the same seeds, and each claim's verdict by a fixed rule
(reproduces / does not reproduce / not significant). (Once ``bench/lab_modalities.py page``.)
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TABLES", "render"]

_RESULTS: list[Path] = [Path("bench/results/lab_modalities")]


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95 % Student-t interval over ``values`` (the seeds)."""
    from scipy import stats

    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return m, m - half, m + half


def fmt_ci(m: float, lo: float, hi: float, nd: int = 3, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{nd}f}}"
    if math.isnan(lo):
        return f.format(m)
    return f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]"


def verdict(lo: float, hi: float) -> str:
    if math.isnan(lo):
        return "one seed"
    return "significant" if lo > 0 or hi < 0 else "not significant"


def load(pattern: str) -> list[dict]:
    """The stored rows of ``bench/results/lab_modalities/PATTERN`` (the directory :func:`render` sets)."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(_RESULTS[0].glob(pattern))]


def table_emformer() -> str:
    from ..stats import paired_difference

    docs = load("emformer_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    leads = sorted({int(k) for r in rows for k in r["rmse"]})
    seeds = sorted({r["seed"] for r in rows})
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["arm"], r["seed"]): r for r in rows}

    def mean_rmse(arm: str, s: int, k: int) -> float:
        return statistics.mean(by[(arm, s)]["rmse"][str(k)])

    lines = [
        "| arm | " + " | ".join(f"RMSE lead {k}" for k in leads) + " | θ at the end |",
        "|---|" + "---|" * (len(leads) + 1),
    ]
    for arm in arms:
        if all((arm, s) in by for s in seeds):
            cells = [fmt_ci(*t_interval([mean_rmse(arm, s, k) for s in seeds])) for k in leads]
            thetas = [by[(arm, s)]["theta"] for s in seeds]
            cells.append(f"{min(thetas):.7f} … {max(thetas):.7f}")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| rollout − one-step (same fine-tuning lr) | lead | Δ RMSE (t-interval over 3 seeds) | verdict | "
        "Δ pooled over seeds × test trajectories (paired bootstrap) |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        if not arm.startswith("rollout"):
            continue
        base = "one-step" + arm[len("rollout") :]
        ok = [s for s in seeds if (arm, s) in by and (base, s) in by]
        for k in leads if ok else []:
            m, lo, hi = t_interval([mean_rmse(arm, s, k) - mean_rmse(base, s, k) for s in ok])
            pd = paired_difference(
                [v for s in ok for v in by[(arm, s)]["rmse"][str(k)]],
                [v for s in ok for v in by[(base, s)]["rmse"][str(k)]],
            )
            lines.append(
                f"| {arm} − {base} | {k} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
                f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} |"
            )
    return "\n".join(lines)


def table_conv_time() -> str:
    docs = load("conv_time.json")
    if not docs:
        return "_no rows yet_"
    d = docs[0]
    hw = d["hardware"]
    lines = [
        f"{hw['cpu']}, {hw['threads']} thread, torch {hw['torch']}, load average {hw['load_avg_1m']:.2f} "
        f"at the end, {d['settings']['repeats']} interleaved repeats, commit {hw['git_commit']}",
        "",
        "| case | shape | merged (ms, median) | three convs (ms, median) | speed-up (median [q25, q75] "
        "of per-repeat ratios) |",
        "|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        q = r["speedup_q25_q75"]
        lines.append(
            f"| {r['case']} | B{r['B']}-T{r['T']}-C{r['channels']} | {r['merged_ms']:.3f} | "
            f"{r['separate_ms']:.3f} | {r['speedup_median']:.2f}× [{q[0]:.2f}, {q[1]:.2f}] |"
        )
    return "\n".join(lines)


def table_meg() -> str:
    from ..stats import paired_difference

    docs = load("meg_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    ctxs = sorted({r["context"] for r in rows})
    by = {(r["context"], r["encoder"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    labels = rows[0]["labels"]
    n_test = len(rows[0]["correct"])
    lines = [
        f"Probe: {labels} labelled events, {n_test} test events per cell (chance 1/8 = 0.125; knowing the "
        "response but not the state: 0.25).",
        "",
        "| pretraining context (steps × 16 channels) | encoder | probe accuracy (t-interval over seeds) | "
        "final masked-token loss |",
        "|---|---|---|---|",
    ]
    for c in ctxs:
        for enc in ("pretrained", "untrained"):
            accs = [statistics.mean(by[(c, enc, s)]) for s in seeds if (c, enc, s) in by]
            losses = [r["final_loss"] for r in rows if r["context"] == c and r["encoder"] == enc]
            loss = f"{statistics.mean(losses):.3f}" if enc == "pretrained" else "–"
            lines.append(f"| {c} | {enc} | {fmt_ci(*t_interval(accs))} | {loss} |")
    if len(ctxs) == 2:
        lo_c, hi_c = ctxs
        lines += [
            "",
            f"| {hi_c} − {lo_c} (pretrained) | seeds | Δ accuracy (t-interval over seeds) | verdict | "
            "Δ pooled (paired bootstrap over seeds × test events) |",
            "|---|---|---|---|---|",
        ]
        ok = [s for s in seeds if (hi_c, "pretrained", s) in by and (lo_c, "pretrained", s) in by]
        diffs = [
            statistics.mean(by[(hi_c, "pretrained", s)]) - statistics.mean(by[(lo_c, "pretrained", s)])
            for s in ok
        ]
        m, lo, hi = t_interval(diffs)
        a = [v for s in ok for v in by[(hi_c, "pretrained", s)]]
        b = [v for s in ok for v in by[(lo_c, "pretrained", s)]]
        pd = paired_difference(a, b)
        lines.append(
            f"| probe accuracy | {len(ok)} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
            f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} |"
        )
    return "\n".join(lines)


def _bucket(n: int) -> str:
    return "5–19" if n < 20 else "20–40" if n <= 40 else "100–200" if n >= 100 else "41–99"


def table_vlta() -> str:
    from ..stats import paired_difference

    docs = load("vlta_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    cells: dict = {}
    for r in rows:
        for occ, c in zip(r["occ_len"], r["correct"]):
            key = (r["variant"] or "default", r["length"], _bucket(occ))
            cells.setdefault(key, {}).setdefault((r["mixer"], r["seed"]), []).append(int(c))
    lines = [
        "| occlusions | video frames | occlusion length | reacquisitions per seed | "
        + " | ".join(mixers)
        + " | vlta − ema (t over seeds; paired bootstrap) |",
        "|---|---|---|---|" + "---|" * len(mixers) + "---|",
    ]
    for key in sorted(cells, key=lambda k: (k[0] != "default", k[1], k[2])):
        cell = cells[key]
        n = len(cell.get((mixers[0], seeds[0]), []))
        parts = []
        for m in mixers:
            accs = [statistics.mean(cell[(m, s)]) for s in seeds if cell.get((m, s))]
            parts.append(fmt_ci(*t_interval(accs)) if accs else "–")
        diff = "–"
        if "vlta" in mixers and "ema" in mixers:
            ok = [s for s in seeds if cell.get(("vlta", s)) and cell.get(("ema", s))]
            d = [statistics.mean(cell[("vlta", s)]) - statistics.mean(cell[("ema", s)]) for s in ok]
            m_, lo, hi = t_interval(d)
            pd = paired_difference(
                [v for s in ok for v in cell[("vlta", s)]], [v for s in ok for v in cell[("ema", s)]]
            )
            diff = f"{fmt_ci(m_, lo, hi, sign=True)}, {verdict(lo, hi)}; [{pd.low:+.3f}, {pd.high:+.3f}]"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {n} | " + " | ".join(parts) + f" | {diff} |")
    return "\n".join(lines)


def table_ts(task: str) -> str:
    from ..stats import paired_difference

    docs = load(f"ts_{task}_seed*.json")
    if not docs:
        return "_no rows yet_"
    rows = [r for d in docs for r in d["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    ts_ = sorted({r["T"] for r in rows})
    by = {(r["neuron"], r["T"], r["seed"]): r for r in rows}
    acc = {k: statistics.mean(int(c) for c in r["correct"]) for k, r in by.items()}
    lines = [
        "| T | LIF accuracy | TS accuracy | TS − LIF (t over seeds) | verdict | TS − LIF pooled (paired "
        "bootstrap) | ‖∂L/∂u_1‖/‖∂L/∂u_T‖ LIF (trained; init) | TS (trained; init) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in ts_:
        ok = [s for s in seeds if ("lif", t, s) in by and ("ts", t, s) in by]
        if not ok:
            continue
        la = [acc[("lif", t, s)] for s in ok]
        ta = [acc[("ts", t, s)] for s in ok]
        m, lo, hi = t_interval([b - a for a, b in zip(la, ta)])
        pd = paired_difference(
            [int(c) for s in ok for c in by[("ts", t, s)]["correct"]],
            [int(c) for s in ok for c in by[("lif", t, s)]["correct"]],
        )

        ratio = {}
        for neuron in ("lif", "ts"):
            g = statistics.median(by[(neuron, t, s)]["grad_ratio"] for s in ok)
            g0 = statistics.median(by[(neuron, t, s)]["grad_ratio_init"] for s in ok)
            ratio[neuron] = f"{fmt_ratio(g)}; {fmt_ratio(g0)}"
        lines.append(
            f"| {t} | {fmt_ci(*t_interval(la))} | {fmt_ci(*t_interval(ta))} | "
            f"{fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} | "
            f"{fmt_ci(pd.mean, pd.low, pd.high, sign=True)} | {ratio['lif']} | {ratio['ts']} |"
        )
    # the decline: accuracy at the largest T minus the smallest, per neuron
    lines += [
        "",
        f"| neuron | accuracy(T={ts_[-1]}) − accuracy(T={ts_[0]}) (t over seeds) | verdict |",
        "|---|---|---|",
    ]
    for neuron in ("lif", "ts"):
        ok = [s for s in seeds if (neuron, ts_[0], s) in by and (neuron, ts_[-1], s) in by]
        if ok:
            m, lo, hi = t_interval([acc[(neuron, ts_[-1], s)] - acc[(neuron, ts_[0], s)] for s in ok])
            lines.append(f"| {neuron} | {fmt_ci(m, lo, hi, sign=True)} | {verdict(lo, hi)} |")
    return "\n".join(lines)


def commands_block() -> str:
    """The exact training commands of seed 0 of every experiment (other seeds differ in --seed/--out)."""
    out = []
    for pattern in (
        "emformer_seed0.json",
        "meg_seed0.json",
        "vlta_seed0.json",
        "ts_xor_seed0.json",
        "ts_blobs_seed0.json",
    ):
        for d in load(pattern):
            out.append(f"# {d['experiment']} (seed 0)")
            out += [re.sub(r"\S*?(runs/modalities/)", r"\1", c) for c in d["commands"].values()]
    return "```bash\n" + "\n".join(out) + "\n```" if out else "_no rows yet_"


# -- verdicts: written from the stored rows by the rules below, never by hand ------------------------------

REPRODUCES, FAILS, NOT_SIG = "reproduces", "does not reproduce", "not significant"
COMMANDS = {
    "emformer": "bench/heavy.sh python bench/lab_modalities.py emformer --seeds 0 1 2",
    "conv-time": "bench/heavy.sh python bench/lab_modalities.py conv-time",
    "meg": "bench/heavy.sh python bench/lab_modalities.py meg --seeds 0 1 2",
    "vlta": "bench/heavy.sh python bench/lab_modalities.py vlta --seeds 0 1 2",
    "ts-xor": "bench/heavy.sh python bench/lab_modalities.py ts --task xor --seeds 0 1 2",
    "ts-blobs": "bench/heavy.sh python bench/lab_modalities.py ts --task blobs --seeds 0 1 2",
}


@dataclass
class Paired:
    """A per-seed paired difference: mean, 95 % t-interval and paired t-test p over ``n`` seeds, and
    (when the samples pair) the paired-bootstrap interval over seeds × test samples pooled."""

    mean: float
    low: float
    high: float
    p: float
    n: int
    boot: tuple[float, float] | None = None

    @property
    def sign(self) -> int:
        """+1 / −1 when the t-interval lies above / below 0, else 0 (also with fewer than 2 seeds)."""
        if math.isnan(self.low):
            return 0
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def brief(self, nd: int = 3) -> str:
        return f"{fmt_ci(self.mean, self.low, self.high, nd, sign=True)}, p = {self.p:.2g}"

    def text(self, nd: int = 3) -> str:
        s = f"{fmt_ci(self.mean, self.low, self.high, nd, sign=True)} (paired t over {self.n} seeds, p = "
        s += f"{self.p:.2g}" + (", not significant" if self.sign == 0 else "")
        if self.boot is not None:
            s += f"; pooled paired bootstrap [{self.boot[0]:+.{nd}f}, {self.boot[1]:+.{nd}f}]"
        return s + ")"


def paired_seeds(diffs: list[float], a: list[float] | None = None, b: list[float] | None = None) -> Paired:
    """``diffs``: one difference per seed; ``a``, ``b``: the pooled per-sample scores that pair."""
    from scipy import stats

    from ..stats import paired_difference

    m, lo, hi = t_interval(diffs)
    if len(diffs) < 2:
        p = float("nan")
    elif statistics.stdev(diffs) == 0:
        p = 1.0 if m == 0 else 0.0
    else:
        p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
    boot = None
    if a is not None and b is not None:
        pd = paired_difference(a, b)
        boot = (pd.low, pd.high)
    return Paired(m, lo, hi, p, len(diffs), boot)


@dataclass
class Claim:
    section: str  # the page region it belongs to (verdict-<section>)
    name: str
    verdict: str  # REPRODUCES, FAILS, NOT_SIG, or "not measured yet"
    figures: str  # the numbers it rests on
    command: str
    short: str = ""  # the deciding numbers alone, for the summary table


def claims_emformer() -> list[Claim]:
    """Rollout − one-step RMSE, per fine-tuning lr. Reproduces when leads 20 and 40 are significantly lower
    and lead 1 is not significantly higher; does not reproduce when any of them goes significantly the
    wrong way (a long lead higher, lead 1 higher); otherwise not significant."""
    docs = load("emformer_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        if not arm.startswith("rollout"):
            continue
        base = "one-step" + arm[len("rollout") :]
        ok = [s for s in seeds if (arm, s) in by and (base, s) in by]
        cmp = {}
        for k in (1, 20, 40):
            ra = [by[(arm, s)]["rmse"][str(k)] for s in ok]
            rb = [by[(base, s)]["rmse"][str(k)] for s in ok]
            cmp[k] = paired_seeds(
                [statistics.mean(x) - statistics.mean(y) for x, y in zip(ra, rb)],
                [v for x in ra for v in x],
                [v for y in rb for v in y],
            )
        if cmp[20].sign > 0 or cmp[40].sign > 0 or cmp[1].sign > 0:
            v = FAILS
        elif cmp[20].sign < 0 and cmp[40].sign < 0:
            v = REPRODUCES
        else:
            v = NOT_SIG
        lr = arm.split("@", 1)[1] if "@" in arm else "?"
        figs = "; ".join(f"lead {k} {cmp[k].text()}" for k in (20, 40, 1))
        out.append(
            Claim(
                "emformer",
                f"EMFormer: rollout fine-tuning improves leads 20 and 40 without hurting lead 1 "
                f"(fine-tuning lr {lr}, {len(ok)} seeds)",
                v if len(ok) >= 2 else "not measured yet",
                "rollout − one-step RMSE: " + figs,
                COMMANDS["emformer"],
                "Δ RMSE " + ", ".join(f"lead {k} {cmp[k].brief()}" for k in (20, 40, 1)),
            )
        )
    return out or [
        Claim("emformer", "EMFormer: rollout fine-tuning", "not measured yet", "", COMMANDS["emformer"])
    ]


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95 % interval (binomial order statistics, coverage ≥ 95 %)."""
    from scipy import stats

    x = sorted(values)
    n = len(x)
    j = int(stats.binom.ppf(0.025, n, 0.5))  # x_(j) ≤ median ≤ x_(n−j+1) with probability ≥ 0.95
    if j < 1:
        return statistics.median(x), float("nan"), float("nan")
    return statistics.median(x), x[j - 1], x[n - j]


def claims_conv() -> list[Claim]:
    """Merged vs three convolutions, per timed case: the median per-repeat speed-up (three convs / merged,
    interleaved repeats) with its 95 % interval and a paired Wilcoxon signed-rank test of the log ratios.
    Reproduces when every conv case (forward; forward+backward; every shape) has its interval above 1; does
    not reproduce when one lies below 1; otherwise not significant. The mixer case is reported, not judged
    (attention dominates it)."""
    from scipy import stats

    docs = load("conv_time.json")
    rows = [r for r in docs[0]["rows"] if "ratios" in r] if docs else []
    if not rows:
        return [
            Claim(
                "conv",
                "EMFormer: the merged conv is faster than three convs",
                "not measured yet",
                "",
                COMMANDS["conv-time"],
            )
        ]
    parts, signs, conv = [], [], []
    for r in rows:
        m, lo, hi = median_interval(r["ratios"])
        p = float(stats.wilcoxon([math.log(v) for v in r["ratios"]]).pvalue)
        sign = 0 if math.isnan(lo) else 1 if lo > 1 else -1 if hi < 1 else 0
        if r["case"].startswith("conv"):
            signs.append(sign)
            conv.append((m, lo, hi, p))
        parts.append(
            f"{r['case']} B{r['B']}-T{r['T']}-C{r['channels']} {m:.2f}× [{lo:.2f}, {hi:.2f}] "
            f"(Wilcoxon p = {p:.2g}, {len(r['ratios'])} paired repeats)"
        )
    v = FAILS if -1 in signs else REPRODUCES if signs and all(s > 0 for s in signs) else NOT_SIG
    return [
        Claim(
            "conv",
            "EMFormer: the merged conv is faster than the three convs (one CPU thread)",
            v,
            "speed-up (three convs / merged, per repeat), median with its 95 % interval: " + "; ".join(parts),
            COMMANDS["conv-time"],
            f"{len(conv)} conv cases: median speed-up {min(c[0] for c in conv):.2f}×–"
            f"{max(c[0] for c in conv):.2f}×, 95 % intervals from {min(c[1] for c in conv):.2f}× to "
            f"{max(c[2] for c in conv):.2f}×, Wilcoxon p ≤ {max(c[3] for c in conv):.2g}"
            if conv
            else "",
        )
    ]


def claims_meg() -> list[Claim]:
    """Probe accuracy, long − short pretraining context (pretrained encoders). Reproduces when the
    t-interval over seeds lies above 0, does not reproduce when below, otherwise not significant."""
    docs = load("meg_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    name = "MEG-XL: block-masked pretraining at the long context beats the short one on the 1 %-label probe"
    ctxs = sorted({r["context"] for r in rows})
    if len(ctxs) != 2:
        return [Claim("meg", name, "not measured yet", "", COMMANDS["meg"])]
    by = {(r["context"], r["encoder"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    seeds = sorted({r["seed"] for r in rows})

    def cmp(a_key, b_key) -> Paired:
        ok = [s for s in seeds if (*a_key, s) in by and (*b_key, s) in by]
        return paired_seeds(
            [statistics.mean(by[(*a_key, s)]) - statistics.mean(by[(*b_key, s)]) for s in ok],
            [v for s in ok for v in by[(*a_key, s)]],
            [v for s in ok for v in by[(*b_key, s)]],
        )

    lo_c, hi_c = ctxs
    main = cmp((hi_c, "pretrained"), (lo_c, "pretrained"))
    v = REPRODUCES if main.sign > 0 else FAILS if main.sign < 0 else NOT_SIG
    ctrl = "; ".join(
        f"context {c}: pretrained − untrained {cmp((c, 'pretrained'), (c, 'untrained')).text()}" for c in ctxs
    )
    figs = f"probe accuracy, context {hi_c} − {lo_c} steps: {main.text()}. Control, {ctrl}"
    short = f"Δ accuracy {main.brief()}"
    return [Claim("meg", name, v if main.n >= 2 else "not measured yet", figs, COMMANDS["meg"], short)]


def claims_vlta() -> list[Claim]:
    """Reacquisition accuracy after the long occlusions (100–200 frames, never seen in training), VLTA −
    EMA, at each video length. Reproduces when every length's t-interval lies above 0; does not reproduce
    when one lies below 0; otherwise not significant."""
    docs = load("vlta_seed*.json")
    rows = [r for d in docs for r in d["rows"] if r["variant"]]
    name = "TAPTRv3: VLTA keeps reacquisition accuracy after long occlusions where the EMA memory drifts"
    by = {(r["mixer"], r["length"], r["seed"]): [int(c) for c in r["correct"]] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    if not lengths or len(seeds) < 2:
        return [Claim("vlta", name, "not measured yet", "", COMMANDS["vlta"])]

    def cmp(a: str, b: str, n: int) -> Paired:
        ok = [s for s in seeds if (a, n, s) in by and (b, n, s) in by]
        return paired_seeds(
            [statistics.mean(by[(a, n, s)]) - statistics.mean(by[(b, n, s)]) for s in ok],
            [v for s in ok for v in by[(a, n, s)]],
            [v for s in ok for v in by[(b, n, s)]],
        )

    main = {n: cmp("vlta", "ema", n) for n in lengths}
    signs = [c.sign for c in main.values()]
    v = FAILS if -1 in signs else REPRODUCES if all(s > 0 for s in signs) else NOT_SIG
    accs = []
    for n in lengths:
        cell = []
        for m in ("vlta", "ema", "softmax"):
            vals = [statistics.mean(by[(m, n, s)]) for s in seeds if (m, n, s) in by]
            if vals:
                cell.append(f"{m} {fmt_ci(*t_interval(vals))}")
        accs.append(f"{n} frames: " + ", ".join(cell))
    figs = "VLTA − EMA reacquisition accuracy after 100–200-frame occlusions: " + "; ".join(
        f"{n} frames {c.text()}" for n, c in main.items()
    )
    figs += ". Accuracies (t over seeds): " + "; ".join(accs)
    if all(("softmax", n, s) in by for n in lengths for s in seeds):
        figs += ". VLTA − causal softmax: " + "; ".join(
            f"{n} frames {cmp('vlta', 'softmax', n).text()}" for n in lengths
        )
    short = "Δ accuracy " + ", ".join(f"{n} frames {c.brief()}" for n, c in main.items())
    return [Claim("vlta", name, v, figs, COMMANDS["vlta"], short)]


def fmt_ratio(g: float) -> str:
    """A gradient ratio; ``∞`` when ‖∂L/∂u_T‖ was 0 (the stored value divides by the 1e-30 floor)."""
    return "∞" if g >= 1e15 else f"{g:.2g}"


def claims_ts(task: str) -> list[Claim]:
    """Accuracy at the largest T minus the smallest, per neuron (paired by seed). Reproduces when LIF's
    change lies significantly below 0 and TS's does not; does not reproduce when LIF's lies above 0 or TS
    declines significantly as well; otherwise (LIF's decline not significant) not significant."""
    docs = load(f"ts_{task}_seed*.json")
    rows = [r for d in docs for r in d["rows"]]
    name = f"TS neuron ({task}): LIF accuracy declines with T, TS accuracy does not"
    seeds = sorted({r["seed"] for r in rows})
    ts_ = sorted({r["T"] for r in rows})
    if len(ts_) < 2 or len(seeds) < 2:
        return [Claim("ts", name, "not measured yet", "", COMMANDS[f"ts-{task}"])]
    by = {(r["neuron"], r["T"], r["seed"]): r for r in rows}
    acc = {k: statistics.mean(int(c) for c in r["correct"]) for k, r in by.items()}
    t0, t1 = ts_[0], ts_[-1]
    change = {}
    for neuron in ("lif", "ts"):
        ok = [s for s in seeds if (neuron, t0, s) in by and (neuron, t1, s) in by]
        change[neuron] = paired_seeds([acc[(neuron, t1, s)] - acc[(neuron, t0, s)] for s in ok])
    ok = [s for s in seeds if ("lif", t1, s) in by and ("ts", t1, s) in by]
    gap = paired_seeds(
        [acc[("ts", t1, s)] - acc[("lif", t1, s)] for s in ok],
        [int(c) for s in ok for c in by[("ts", t1, s)]["correct"]],
        [int(c) for s in ok for c in by[("lif", t1, s)]["correct"]],
    )
    lif, ts = change["lif"].sign, change["ts"].sign
    v = FAILS if lif > 0 or ts < 0 else REPRODUCES if lif < 0 else NOT_SIG
    ratios = "; ".join(
        f"{n.upper() if n == 'lif' else 'TS'} "
        + fmt_ratio(statistics.median(by[(n, t1, s)]["grad_ratio"] for s in ok))
        + " (init "
        + fmt_ratio(statistics.median(by[(n, t1, s)]["grad_ratio_init"] for s in ok))
        + ")"
        for n in ("lif", "ts")
    )
    figs = (
        f"accuracy(T={t1}) − accuracy(T={t0}): LIF {change['lif'].text()}, TS {change['ts'].text()}; "
        f"TS − LIF at T={t1}: {gap.text()}; ‖∂L/∂u_1‖/‖∂L/∂u_T‖ at T={t1}, median over seeds: {ratios}"
    )
    short = f"Δ accuracy T={t1} − T={t0}: LIF {change['lif'].brief()}, TS {change['ts'].brief()}"
    return [Claim("ts", name, v, figs, COMMANDS[f"ts-{task}"], short)]


@functools.cache
def all_claims() -> list[Claim]:
    return [
        *claims_emformer(),
        *claims_conv(),
        *claims_meg(),
        *claims_vlta(),
        *claims_ts("xor"),
        *claims_ts("blobs"),
    ]


def verdicts_summary() -> str:
    lines = [
        "| claim | verdict | deciding differences (mean [95 % t-interval over seeds], paired t-test p) | "
        "reproduce with |",
        "|---|---|---|---|",
    ]
    for c in all_claims():
        lines.append(f"| {c.name} | **{c.verdict}** | {c.short or c.figures or '–'} | `{c.command}` |")
    return "\n".join(lines)


def verdicts_section(section: str, rule_of) -> str:
    rule = " ".join((rule_of.__doc__ or "").split())
    out = [f"_Rule (applied by `longlab report --docs --page results/modalities`)_: {rule}", ""]
    for c in all_claims():
        if c.section == section:
            out.append(f"**Verdict — {c.name}: {c.verdict}.** {c.figures}. Reproduce: `{c.command}`.")
            out.append("")
    return "\n".join(out).rstrip()


TABLES = {
    "emformer": table_emformer,
    "conv-time": table_conv_time,
    "meg": table_meg,
    "vlta": table_vlta,
    "ts-xor": lambda: table_ts("xor"),
    "ts-blobs": lambda: table_ts("blobs"),
    "commands": commands_block,
    "verdicts": verdicts_summary,
    "verdict-emformer": lambda: verdicts_section("emformer", claims_emformer),
    "verdict-conv": lambda: verdicts_section("conv", claims_conv),
    "verdict-meg": lambda: verdicts_section("meg", claims_meg),
    "verdict-vlta": lambda: verdicts_section("vlta", claims_vlta),
    "verdict-ts": lambda: verdicts_section("ts", claims_ts),
}


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every block of :data:`TABLES`, from ``ROOT/bench/results/lab_modalities``."""
    _RESULTS[0] = root / "bench" / "results" / "lab_modalities"
    return {name: make() for name, make in TABLES.items()}
