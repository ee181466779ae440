"""The generated blocks of ``docs/results/rag-reuse.md``: KV reuse for RAG prompts (issue 11).

Reads ``bench/results/rag_reuse/v2/multidoc_qa_1/results.sqlite[.gz]`` (SmolLM2-135M) and
``bench/results/rag_reuse/v2/qwen/multidoc_qa_1/`` (Qwen2.5-0.5B), written by ``bench/rag_reuse.py
accuracy`` (``longlab.eval.reuse_grid`` rows: ``score`` forced-answer 0/1, ``extra.fidelity``,
``extra.recompute_fraction``, ``extra.cost_fraction``), and ``bench/results/rag_reuse/v2/ttft.json``
(``bench/rag_reuse.py ttft``: every round's TTFT per method, interleaved). Statistics: Wilson intervals for
accuracy, the paired bootstrap (:func:`longlab.eval.stats.paired_difference`) for every difference on the
same samples, *share of full* by inverting the paired test of ``mean(a_i − c·full_i) = 0`` over ``c``,
and TTFT ratios as the geometric mean of per-round ratios (each round's full prefill over the same
round's method) with a Student-t 95% interval of the log ratios over rounds. Moved from
``bench/rag_reuse.py report``; the verdicts are computed from the same rows by the rules in
:func:`claims`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .paired import Claim
from .paired import log_ratio_interval as ratio_interval

__all__ = [
    "Claim",
    "RunSummary",
    "claims",
    "ratio_interval",
    "render",
    "share_of_full",
    "summarize",
    "ttft_verdict",
    "prophet_claim_verdict",
    "beats_verdict",
]

RESULTS = Path("bench/results/rag_reuse/v2")
RUNS = (  # (key, model label, results subdirectory, PNG name)
    ("smollm2", "SmolLM2-135M", "multidoc_qa_1", "rag-reuse-multidoc_qa_1.png"),
    ("qwen", "Qwen2.5-0.5B", "qwen/multidoc_qa_1", "rag-reuse-qwen-multidoc_qa_1.png"),
)
PAIRS = (("prophetkv", "cacheblend"), ("prophetkv", "epic"), ("cacheblend", "epic"))
COMMANDS = {
    "smollm2": "RAG_REUSE_OUT=bench/results/rag_reuse/v2 bench/heavy.sh python bench/rag_reuse.py accuracy "
    "--task multidoc_qa_1 --samples 200 --max-minutes 10.5",
    "qwen": "RAG_REUSE_OUT=bench/results/rag_reuse/v2/qwen bench/heavy.sh python bench/rag_reuse.py accuracy "
    '--model qwen2.5-0.5b --task multidoc_qa_1 --samples 100 --ratios 0.1,0.2 --extra "" --max-minutes 10.5',
    "ttft": "RAG_REUSE_OUT=bench/results/rag_reuse/v2 bench/heavy.sh python bench/rag_reuse.py ttft "
    "--num-docs 4,8 --doc-tokens 400 --rounds 3",
}
FULL = "full-prefill"
CACHEBLEND_TTFT = "cacheblend@0.15"
EPIC_TTFT = "epic:k=16"
REPRODUCES, FAILS, NOT_SIG = "reproduces", "does not reproduce", "not significant"


def _display(label: str) -> str:
    """``prophetkv@0.2:dual_stage=true`` -> ``prophetkv:dual_stage=true`` (the ratio has its own column)."""
    name, _, rest = label.partition("@")
    params = rest.partition(":")[2]
    return name + (f":{params}" if params else "")


def _pts(d: Any) -> str:
    """A paired difference of 0/1 scores in points with its CI, ``(n.s.)`` when it contains 0."""
    sig = "" if d.significant else " (n.s.)"
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{sig}"


def share_of_full(scores: list[float], full: list[float]) -> tuple[float | None, float, float]:
    """``acc / acc_full`` with a 95% CI: the ``c`` on a 0.01 grid in [0, 3] where the paired bootstrap test
    of ``mean(a_i − c·f_i) = 0`` does not reject (:func:`longlab.eval.stats.paired_difference`).

    The set is an interval around the point estimate (the tested mean falls as ``c`` grows), so each end
    is found by bisection on the grid. ``(None, 0, inf)`` when the full prefill answers nothing."""
    from ..stats import paired_difference

    if not sum(full):
        return None, 0.0, float("inf")
    point = sum(scores) / sum(full)

    def kept(i: int) -> bool:
        return not paired_difference(scores, [i * 0.01 * f for f in full]).significant

    mid = min(300, max(0, round(point * 100)))
    if not kept(mid):
        return point, point, point
    lo, hi = 0, mid  # lowest kept grid point: kept(hi) is True
    if kept(0):
        hi = 0
    while hi - lo > 1:
        m = (lo + hi) // 2
        lo, hi = (lo, m) if kept(m) else (m, hi)
    low = hi
    lo, hi = mid, 300  # highest kept: kept(lo) is True
    if kept(300):
        lo = 300
    while hi - lo > 1:
        m = (lo + hi) // 2
        lo, hi = (m, hi) if kept(m) else (lo, m)
    return point, low * 0.01, lo * 0.01


@dataclass
class RunSummary:
    """One model's accuracy grid: per-label statistics, method-vs-method pairs and the 96% claim tests."""

    model: str
    n: int
    rows: list[dict] = field(default_factory=list)  # one per label, in table order
    pairs: dict[tuple[str, str, str], tuple[Any, Any]] = field(
        default_factory=dict
    )  # (a, b, ρ) -> (acc, fid)
    claim96: dict[str, Any] = field(default_factory=dict)  # label -> paired difference of a − 0.96·full
    ratios: list[str] = field(default_factory=list)

    def row(self, label: str) -> dict | None:
        return next((r for r in self.rows if r["label"] == label), None)


def _order(label: str) -> tuple:
    name, _, ratio = label.partition("@")
    rank = {"full": 0, "no-recompute": 1, "ape": 2}
    return (rank.get(name, 3), name.split(":")[0], float(ratio.split(":")[0]) if ratio else -1, label)


def summarize(rows: list[dict], model: str) -> RunSummary | None:
    """Statistics of one model's rows (``recipe`` = method label, ``sample_id``, ``score``, ``extra``)
    over the samples every label has; None when there are none."""
    from ..stats import paired_difference, wilson_interval

    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["recipe"], {})[r["sample_id"]] = r
    if "full" not in by:
        return None
    ids = sorted(set.intersection(*(set(v) for v in by.values())))
    if not ids:
        return None
    out = RunSummary(model, len(ids))
    full = [by["full"][i]["score"] for i in ids]
    for label in sorted(by, key=_order):
        scores = [by[label][i]["score"] for i in ids]
        extra = [by[label][i]["extra"] for i in ids]
        fids = [e["fidelity"] for e in extra]
        k = int(sum(scores))
        ratio = label.partition("@")[2].split(":")[0]
        out.rows.append(
            {
                "label": label,
                "ratio": float(ratio) if ratio else None,
                "k": k,
                "acc": k / len(ids),
                "wilson": wilson_interval(k, len(ids)),
                "share": share_of_full(scores, full),
                "diff": paired_difference(scores, full),
                "fidelity": statistics.mean(fids),
                "fidelity_ci": paired_difference(fids, [0.0] * len(fids)),
                "recomputed": statistics.mean(e["recompute_fraction"] for e in extra),
                "cost": statistics.mean(e["cost_fraction"] for e in extra),
            }
        )
    out.ratios = sorted({lab.partition("@")[2] for lab in by if "@" in lab and ":" not in lab}, key=float)

    def mean_of(labels: list[str], i: str, key: str) -> float:
        vals = [by[lab][i]["score"] if key == "score" else by[lab][i]["extra"][key] for lab in labels]
        return statistics.mean(vals)

    groups = [(r, [r]) for r in out.ratios] + ([("all", out.ratios)] if len(out.ratios) > 1 else [])
    for a, b in PAIRS:
        for name, rs in groups:
            la, lb = [f"{a}@{r}" for r in rs], [f"{b}@{r}" for r in rs]
            if not all(lab in by for lab in la + lb):
                continue
            d = paired_difference(
                [mean_of(la, i, "score") for i in ids], [mean_of(lb, i, "score") for i in ids]
            )
            f = paired_difference(
                [mean_of(la, i, "fidelity") for i in ids], [mean_of(lb, i, "fidelity") for i in ids]
            )
            out.pairs[(a, b, name)] = (d, f)
    for label in (lab for lab in by if lab.startswith("prophetkv@0.2")):
        scores = [by[label][i]["score"] for i in ids]
        out.claim96[label] = paired_difference(scores, [0.96 * f for f in full])
    return out


def accuracy_block(s: RunSummary) -> str:
    """The accuracy table, the method-vs-method pairs and the 96%-of-full claim tests of one model."""
    out = [
        f"{s.model}: n = {s.n} samples (every method on the same samples); accuracy with 95% Wilson "
        "interval; *% of full* with a 95% CI from the paired bootstrap test inverted; Δ vs full: paired "
        "bootstrap 95% CI; fidelity: bootstrap 95% CI.",
        "",
        "| method | ρ | accuracy % | 95% CI | % of full [95% CI] | Δ vs full (pts) | fidelity % [95% CI] | "
        "recomputed % | cost % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s.rows:
        share, s_lo, s_hi = r["share"]
        rel = f"{100 * share:.0f} [{100 * s_lo:.0f}, {100 * s_hi:.0f}]" if share is not None else "–"
        lo, hi = r["wilson"]
        fc = r["fidelity_ci"]
        ratio = r["label"].partition("@")[2].split(":")[0]
        out.append(
            f"| {_display(r['label'])} | {ratio or '–'} | {100 * r['acc']:.1f} | "
            f"{100 * lo:.0f}–{100 * hi:.0f} | {rel} | {_pts(r['diff'])} | {100 * r['fidelity']:.1f} "
            f"[{100 * fc.low:.0f}, {100 * fc.high:.0f}] | {100 * r['recomputed']:.1f} | "
            f"{100 * r['cost']:.1f} |"
        )
    out += [
        "",
        "Paired differences between methods at the same ρ on the same samples, accuracy and fidelity "
        "(points, paired bootstrap 95% CI); *all ρ*: each sample's mean over the ratios above, then paired:",
        "",
        "| ρ | " + " | ".join(f"{a} − {b}" for a, b in PAIRS) + " |",
        "|---:|" + "---:|" * len(PAIRS),
    ]
    for name in [*s.ratios, *(["all"] if len(s.ratios) > 1 else [])]:
        cells = []
        for a, b in PAIRS:
            pair = s.pairs.get((a, b, name))
            cells.append(f"{_pts(pair[0])}; fid {_pts(pair[1])}" if pair else "–")
        out.append(f"| {'all ρ' if name == 'all' else name} | " + " | ".join(cells) + " |")
    for label, t in s.claim96.items():
        side = "below 96% of full" if t.high < 0 else "above 96% of full" if t.low > 0 else "neither"
        out += [
            "",
            f"Claim test, {_display(label)} at ρ = 0.2 vs 96% of full: mean(a − 0.96·full) = {_pts(t)} "
            f"points ({side} at 95%).",
        ]
    return "\n".join(out)


def _per_round(data: dict, m: int, num: str, den: str) -> list[float]:
    """Each round's TTFT of ``num`` over the same round's TTFT of ``den`` at ``m`` documents."""
    runs = {r["method"]: r for r in data["runs"] if r["num_docs"] == m}
    if num not in runs or den not in runs:
        return []
    return [a["ttft"] / b["ttft"] for a, b in zip(runs[num]["all"], runs[den]["all"])]


def _fmt_ratio(g: tuple[float, float, float]) -> str:
    return f"{g[0]:.2f}×" if math.isnan(g[1]) else f"{g[0]:.2f}× [{g[1]:.2f}, {g[2]:.2f}]"


def _load_avg(uptime: str) -> str:
    return uptime.split("load average:")[-1].strip() if "load average:" in uptime else "?"


def ttft_block(data: dict) -> str:
    """TTFT medians per method and the per-round ratios full / method (geometric mean, t-interval)."""
    rounds = len(data["runs"][0]["all"])
    hw = data.get("hardware", {})
    out = [
        f"{hw.get('cpu', '?')}, {data['threads']} torch thread, torch {hw.get('torch', '?')}, commit "
        f"{hw.get('git_commit', '?')}; {rounds} interleaved rounds; load average (1, 5, 15 min) "
        f"{_load_avg(data['uptime_before'])} before, {_load_avg(data['uptime_after'])} after. Seconds, "
        "median over rounds; *full / method*: geometric mean of the per-round ratios (each round's full "
        "prefill over the same round's method) with a 95% t-interval over rounds.",
        "",
        "| docs | tokens | method | recomputed % | fetch | assemble | compute | TTFT | "
        "full / method [95% CI] |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sorted({r["num_docs"] for r in data["runs"]}):
        for r in (r for r in data["runs"] if r["num_docs"] == m):
            md = r["median"]
            ratio = (
                "1"
                if r["method"] == FULL
                else _fmt_ratio(ratio_interval(_per_round(data, m, FULL, r["method"])))
            )
            out.append(
                f"| {m} | {r['prompt_tokens']} | {r['method']} | {100 * r['recompute_fraction']:.1f} | "
                f"{md['fetch']:.3f} | {md['assemble']:.3f} | {md['compute']:.3f} | {md['ttft']:.3f} | "
                f"{ratio} |"
            )
    return "\n".join(out)


def bytes_block(data: dict) -> str:
    entries = [e for e in data.get("store_entries", []) if e["start"] == 0]
    if not entries:
        return "_no store entries recorded_"
    per_tok = statistics.mean(e["nbytes"] / e["n_tokens"] for e in entries)
    per_doc = statistics.mean(e["nbytes"] for e in entries)
    return (
        f"Bytes on disk ({entries[0]['dtype']}), from the TTFT run's store: {per_tok / 1024:.1f} KiB per "
        "token, "
        f"{per_doc / 2**20:.2f} MiB per document on average ({len(entries)} documents, "
        f"{statistics.mean(e['n_tokens'] for e in entries):.0f} tokens each)."
    )


# -- verdicts: computed from the rows by the rules below ----------------------------------------------------



def ttft_verdict(intervals: list[tuple[float, float, float]], lo: float, hi: float) -> str:
    """A speed-up claim ``lo``–``hi``× against per-setting ratio intervals: reproduces when every interval
    lies above 1 and every point estimate is within [lo, hi]; 'direction reproduces, size does not' when
    every interval lies above 1 but a point falls outside; does not reproduce when one lies below 1;
    otherwise not significant."""
    if any(not math.isnan(i[2]) and i[2] < 1 for i in intervals):
        return FAILS
    if not intervals or any(math.isnan(i[1]) or i[1] <= 1 for i in intervals):
        return NOT_SIG
    if all(lo <= i[0] <= hi for i in intervals):
        return REPRODUCES
    return "direction reproduces, size does not"


def prophet_claim_verdict(t96: Any) -> str:
    """'keeps ≥ 96% of full': does not reproduce when mean(a − 0.96·full) lies significantly below 0,
    reproduces when its interval lies above 0 or contains it with the point at or above 0, else
    not significant (the interval contains 0, the point is below)."""
    if t96.high < 0:
        return FAILS
    if t96.low > 0 or t96.mean >= 0:
        return REPRODUCES
    return NOT_SIG


def beats_verdict(diffs: list[Any]) -> str:
    """'A beats B and C': reproduces when every paired difference lies above 0, does not when one lies
    below 0, otherwise not significant."""
    if any(d.high < 0 for d in diffs):
        return FAILS
    if diffs and all(d.low > 0 for d in diffs):
        return REPRODUCES
    return NOT_SIG


def claims(summaries: dict[str, RunSummary], ttft: dict | None) -> list[Claim]:
    """The papers' claims, each with the measured figures and its verdict."""
    out: list[Claim] = []
    if ttft is not None:
        ms = sorted({r["num_docs"] for r in ttft["runs"]})
        rounds = len(ttft["runs"][0]["all"])
        cb = {m: ratio_interval(_per_round(ttft, m, FULL, CACHEBLEND_TTFT)) for m in ms}
        rec = next(r["recompute_fraction"] for r in ttft["runs"] if r["method"] == CACHEBLEND_TTFT)
        out.append(
            Claim(
                "CacheBlend: 2.2–3.3× lower TTFT than full prefill (ρ≈15%)",
                "full / CacheBlend-15 TTFT, geometric mean of per-round ratios [95% t-interval], n = "
                f"{rounds} rounds: "
                + "; ".join(f"{m} docs {_fmt_ratio(cb[m])}" for m in ms)
                + f" ({100 * rec:.1f}% of token-layers recomputed: layer 0 in full + 15% of the rest)",
                ttft_verdict(list(cb.values()), 2.2, 3.3),
                COMMANDS["ttft"],
            )
        )
        ep = {m: ratio_interval(_per_round(ttft, m, CACHEBLEND_TTFT, EPIC_TTFT)) for m in ms}
        v = ttft_verdict(list(ep.values()), 1.0, 8.0)
        if v == REPRODUCES and all(ep[m][0] < 8.0 * 0.9 for m in ms):
            v = "direction reproduces, size does not (8× not reached)"
        out.append(
            Claim(
                "EPIC: faster than CacheBlend (up to 8× vs CacheBlend-15)",
                "CacheBlend-15 / EPIC k=16 TTFT in the same rounds [95% t-interval], n = "
                f"{rounds} rounds: " + "; ".join(f"{m} docs {_fmt_ratio(ep[m])}" for m in ms),
                v,
                COMMANDS["ttft"],
            )
        )
    for key, s in summaries.items():
        label = "prophetkv@0.2"
        r, t96 = s.row(label), s.claim96.get(label)
        if r is None or t96 is None:
            continue
        full = s.row("full")
        share, lo, hi = r["share"]
        out.append(
            Claim(
                f"ProphetKV: 96–101% of full-prefill accuracy at ρ = 20% ({s.model})",
                f"n = {s.n}: {100 * r['acc']:.1f}% vs {100 * full['acc']:.1f}% full = {100 * share:.0f}% of "
                f"full [{100 * lo:.0f}, {100 * hi:.0f}]; paired test mean(a − 0.96·full) = {_pts(t96)} "
                "points",
                prophet_claim_verdict(t96),
                COMMANDS[key],
            )
        )
        diffs = [
            s.pairs[("prophetkv", b, "0.2")][0]
            for b in ("cacheblend", "epic")
            if ("prophetkv", b, "0.2") in s.pairs
        ]
        pooled = [
            s.pairs[("prophetkv", b, "all")][0]
            for b in ("cacheblend", "epic")
            if ("prophetkv", b, "all") in s.pairs
        ]
        here = f"n = {s.n}, ρ = 0.2, paired: {_pts(diffs[0])} vs CacheBlend, {_pts(diffs[1])} vs EPIC"
        if pooled:
            here += f"; pooled over ρ = {', '.join(s.ratios)}: {_pts(pooled[0])}, {_pts(pooled[1])}"
        out.append(
            Claim(
                f"ProphetKV beats CacheBlend and EPIC at the same budget ({s.model}, ρ = 0.2)",
                here,
                beats_verdict(diffs),
                COMMANDS[key],
            )
        )
    return out


def claims_block(cl: list[Claim]) -> str:
    out = ["| claim (paper) | here (95% intervals) | verdict | reproduce with |", "|---|---|---|---|"]
    for c in cl:
        out.append(f"| {c.claim} | {c.here} | **{c.verdict}** | `{c.command}` |")
    return "\n".join(out)


def _plot(title: str, s: RunSummary, path: Path) -> None:
    """Accuracy and fidelity vs recompute ratio per method (ρ = 0: no-recompute, ρ = 1: full), 95% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    full, base = s.row("full"), s.row("no-recompute")
    for name, color in (("epic", "tab:green"), ("cacheblend", "tab:orange"), ("prophetkv", "tab:blue")):
        pts = sorted(
            (r for r in s.rows if r["label"].split("@")[0] == name and ":" not in r["label"]),
            key=lambda r: r["ratio"],
        )
        ends = [p for p in (base, *pts, full) if p is not None]
        xs = [0.0 if p is base else 1.0 if p is full else p["ratio"] for p in ends]
        ax.plot(xs, [100 * p["acc"] for p in ends], "o-", color=color, label=name)
        ax.fill_between(
            xs,
            [100 * p["wilson"][0] for p in ends],
            [100 * p["wilson"][1] for p in ends],
            color=color,
            alpha=0.12,
        )
        ax2.plot(xs, [100 * p["fidelity"] for p in ends], "o-", color=color, label=name)
        ax2.fill_between(
            xs,
            [100 * p["fidelity_ci"].low for p in ends],
            [100 * p["fidelity_ci"].high for p in ends],
            color=color,
            alpha=0.12,
        )
    ape = s.row("ape")
    if ape:
        err = [[100 * (ape["acc"] - ape["wilson"][0])], [100 * (ape["wilson"][1] - ape["acc"])]]
        ax.errorbar(
            [0.0], [100 * ape["acc"]], yerr=err, fmt="s", color="tab:purple", label="ape (ρ=0)", capsize=3
        )
        ax2.plot([0.0], [100 * ape["fidelity"]], "s", color="tab:purple", label="ape (ρ=0)")
    for a, ylabel, sub in (
        (ax, "accuracy % (95% Wilson band)", f"{title}, n={s.n}: exact answer"),
        (ax2, "fidelity % (95% bootstrap band)", "answer positions = full prefill's argmax"),
    ):
        a.set_xlabel("recompute ratio ρ (0 = no-recompute, 1 = full prefill)")
        a.set_ylabel(ylabel)
        a.set_title(sub, fontsize=10)
        a.set_xscale("symlog", linthresh=0.05)
        a.set_xticks([0, 0.05, 0.1, 0.2, 0.4, 1.0])
        a.set_xticklabels(["0", "0.05", "0.1", "0.2", "0.4", "1"])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every block of the page from ``ROOT/bench/results/rag_reuse/v2``; with ``plots`` the two PNGs."""
    from ..rows import load_rows

    results = root / RESULTS
    summaries: dict[str, RunSummary] = {}
    blocks: dict[str, str] = {}
    for key, model, sub, png in RUNS:
        s = summarize(load_rows(results / sub), model)
        blocks[f"accuracy-{key}"] = accuracy_block(s) if s else "_no rows_"
        if s is not None:
            summaries[key] = s
            if plots:
                _plot(f"{model}, multidoc_qa_1", s, root / "docs" / "results" / png)
    path = results / "ttft.json"
    ttft = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    blocks["ttft"] = ttft_block(ttft) if ttft else "_no TTFT run_"
    blocks["bytes"] = bytes_block(ttft) if ttft else "_no TTFT run_"
    blocks["claims"] = claims_block(claims(summaries, ttft))
    return blocks
