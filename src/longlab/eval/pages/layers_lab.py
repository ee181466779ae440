"""The generated blocks of ``docs/results/layers-lab.md``: the layers lab, train short, test long (issue 15).

Reads the committed lab stores (``bench/results/lab_results/results.sqlite.gz``: passkey, flip-flop,
MQMTAR, MTD, the first L-CUBE runs; ``lab_results/round3/results.sqlite.gz``: the task matrix, MQAR,
copy, algebra and its mechanism sets, PCFG, L-CUBE; ``lab_results/attempts/``: the LSSAR learning-rate
attempt) and the analysis files beside them (``pcfg_baselines.json``, ``pcfg_long_reference.json``,
``pcfg_probe_*.json``, ``lcube_ceiling.json``, ``mtd_md.json``, ``flops.json``, ``l2a_rate_cost.json``,
``bench/results/lab_mixers.json``).

Cells are :func:`longlab.lab.plot.cell_estimate` (what ``longlab lab plot --table`` prints): one seed,
the interval over the 24 test sequences (Wilson for 0/1, else bootstrap); several seeds, the hull of the
Student-t interval over seed means and the interval over seed-averaged sequences. A difference A − B
(:func:`seed_difference`, as ``bench/lab.py seeds``) is *significant* only when the Welch interval over
seed means (with >= 2 seeds a side) and the paired bootstrap over the same test sequences both exclude 0.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SeedDiff", "render", "seed_difference"]

LENGTHS = (64, 128, 256, 512, 1024)
ORDER = (
    "softmax",
    "softmax+nape",
    "softmax+nope",
    "softmax+ropeid",
    "asentmax",
    "asentmax+rope",
    "ssmax",
    "l2a",
    "l2a:hard_rate=true",
    "linear",
    "lssa",
    "lssar",
    "race",
    "lact",
    "ultramem",
    "mamba:expand=1,d_state=8",
)
MAMBA = "mamba:expand=1,d_state=8"
PCFG_N8 = "pcfg:max_length=64,nonterminals=8,terminals=32,alpha=0.02"
PCFG_LONG = "pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string"
ALGEBRA = 'algebra:groups=["C3","C4","C5","C6","C8","C9","C10","D3","D4","D5"]'
MQAR = "mqar:key_len=1,pairs=8,queries=8"

Cell = dict[int, dict[str, float]]  # training seed -> sample id -> score


def _load_rows(path: Path) -> list[dict]:
    from ...lab.plot import lab_rows

    if not path.is_dir():
        raise FileNotFoundError(f"layers-lab page: {path} is missing")
    return lab_rows(path)


def cells_of(
    rows: list[dict], task: str, field: str = "score", steps: bool = False
) -> dict[str, dict[int, Cell]]:
    """recipe -> length -> seed -> sample id -> score (or ``extra[field]``) for one task spec; ``steps``:
    the recipe label carries the training steps (a task trained for two budgets)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        extra = r.get("extra") or {}
        if r["task"] != task or r.get("score") is None or extra.get("answers_per_sample") == 0:
            continue
        v = r["score"] if field == "score" else extra[field]
        label = f"{r['recipe']}, {extra.get('train_steps')} steps" if steps else r["recipe"]
        out[label][int(r["length"])][int(r.get("seed") or 0)][str(r["sample_id"])] = float(v)
    return out


def _label(recipe: str) -> str:
    pos = {"asentmax": " (NAPE)", "linear": " (NoPE)", "mamba:expand=1,d_state=8": " (NoPE)"}
    return f"`{recipe}`{pos.get(recipe, '')}"


def _cell_text(by_seed: dict[int, dict[str, float]], nd: int = 2) -> str:
    from ...lab.plot import cell_estimate

    mean, lo, hi, what = cell_estimate(by_seed)
    seeds = f" ({len(by_seed)} seeds)" if len(by_seed) > 1 else ""
    return f"{mean:.{nd}f} [{lo:.{nd}f}, {hi:.{nd}f}]{seeds}" if what else f"{mean:.{nd}f}"


def score_table(
    cells: dict[str, dict[int, Cell]], head: str, lengths: tuple[int, ...] | None = None, nd: int = 2
) -> str:
    lengths = lengths or tuple(sorted({n for c in cells.values() for n in c}))
    recipes = sorted(cells, key=lambda r: (ORDER.index(r) if r in ORDER else len(ORDER), r))
    seeds = {len(s) for c in cells.values() for s in c.values()}
    n = {len(v) for c in cells.values() for s in c.values() for v in s.values()}
    lines = [f"| {head} | " + " | ".join(str(x) for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for r in recipes:
        row = [_cell_text(cells[r][x], nd) if cells[r].get(x) else "–" for x in lengths]
        lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append(
        f"Test sequences per cell: {'/'.join(map(str, sorted(n)))}; training seeds per row: "
        f"{'/'.join(map(str, sorted(seeds)))} (one seed unless the cell says)."
    )
    return "\n".join(lines)


# -- differences ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedDiff:
    """A − B at one length: Δ of seed means, its Welch interval over seed means (None with one seed a
    side), the paired bootstrap over the common test sequences of seed-averaged scores, and the verdict."""

    delta: float
    seeds_a: int
    seeds_b: int
    welch: tuple[float, float] | None
    paired: tuple[float, float]
    n: int

    @property
    def verdict(self) -> str:
        p_sig = self.paired[0] > 0 or self.paired[1] < 0
        if self.welch is None:
            return "test sequences only (one seed a side): " + ("significant" if p_sig else "not significant")
        w_sig = self.welch[0] > 0 or self.welch[1] < 0
        return "significant" if (p_sig and w_sig) else "not significant"

    def text(self, nd: int = 2, verdict: bool = True) -> str:
        w = f"seeds [{self.welch[0]:+.{nd}f}, {self.welch[1]:+.{nd}f}], " if self.welch else ""
        tail = f"; {self.verdict}" if verdict else ""
        return (
            f"{self.delta:+.{nd}f} ({w}tests [{self.paired[0]:+.{nd}f}, {self.paired[1]:+.{nd}f}]; "
            f"{self.seeds_a}/{self.seeds_b} seeds, n = {self.n}{tail})"
        )


def seed_difference(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> SeedDiff:
    """``a``, ``b``: seed -> sample id -> score at one length (``bench/lab.py seeds``' statistics)."""
    from scipy import stats

    from ..stats import paired_difference

    ma = [sum(v.values()) / len(v) for v in a.values()]
    mb = [sum(v.values()) / len(v) for v in b.values()]
    d = statistics.mean(ma) - statistics.mean(mb)
    welch = None
    if len(ma) > 1 and len(mb) > 1:
        va, vb = statistics.variance(ma) / len(ma), statistics.variance(mb) / len(mb)
        se = math.sqrt(va + vb)
        if se > 0:
            parts = [v * v / (len(m) - 1) for v, m in ((va, ma), (vb, mb)) if v > 0]
            dfs = (va + vb) ** 2 / sum(parts)
            half = float(stats.t.ppf(0.975, dfs)) * se
            welch = (d - half, d + half)
        else:
            welch = (d, d)
    ids = sorted(set.intersection(*[set(v) for v in [*a.values(), *b.values()]]))
    sa = [sum(v[i] for v in a.values()) / len(ma) for i in ids]
    sb = [sum(v[i] for v in b.values()) / len(mb) for i in ids]
    pd = paired_difference(sa, sb)
    return SeedDiff(d, len(ma), len(mb), welch, (pd.low, pd.high), len(ids))


def diff_table(
    cells: dict[str, dict[int, Cell]], pairs: list[tuple[str, str]], lengths: tuple[int, ...]
) -> str:
    lines = ["| A − B | " + " | ".join(str(x) for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for a, b in pairs:
        row = []
        for x in lengths:
            if x in cells.get(a, {}) and x in cells.get(b, {}):
                row.append(seed_difference(cells[a][x], cells[b][x]).text())
            else:
                row.append("–")
        lines.append(f"| `{a}` − `{b}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


# -- analysis files ------------------------------------------------------------------------------------------


def _json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"layers-lab page: {path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


def mechanisms_table(data: dict) -> str:
    sets = (
        "commuted",
        "absent",
        "commuted-absent",
        "identity",
        "elimination",
        "only C7",
        "only C6",
        "only C8",
    )
    out = []
    for length in ("64", "256"):
        out += [
            f"**length {length}**",
            "",
            "| mixer | " + " | ".join(sets) + " |",
            "|---|" + "---|" * len(sets),
        ]
        for mixer in sorted(data, key=lambda r: (ORDER.index(r) if r in ORDER else 99, r)):
            cell = data[mixer].get(length, {})
            row = []
            for s in sets:
                c = cell.get(s)
                row.append(
                    "–"
                    if c is None
                    else f"{c['diff']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
                    if s == "commuted-absent"
                    else f"{c['mean']:.2f} [{c['low']:.2f}, {c['high']:.2f}]"
                )
            out.append(f"| {_label(mixer)} | " + " | ".join(row) + " |")
        out.append("")
    n = {
        c["n"]
        for m in data.values()
        for length in m.values()
        for s, c in length.items()
        if "n" in c and s != "all facts"
    }
    out.append(
        f"Query sequences per set: {'/'.join(map(str, sorted(n)))} (one training seed); commuted − absent: "
        "paired over the same queries."
    )
    return "\n".join(out)


def probe_table(data: dict) -> str:
    widths = [str(w) for w in data["trained"]["widths"]]
    layers = sorted(data["trained"]["r2"], key=int)
    lines = [
        "| R² (held out), trained / untrained | " + " | ".join(f"w = {w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for layer in layers:
        tr, un = data["trained"]["r2"][layer], data["untrained"]["r2"][layer]
        lines.append(
            f"| layer {layer}{' (embedding)' if layer == '0' else ''} | "
            + " | ".join(f"{tr[w]:.2f} / {un[w]:.2f}" for w in widths)
            + " |"
        )
    best = data["trained"]["best_layer"]
    lines += [
        "",
        f"`{data['task']}`, {data['mixer']} seed 0, {data['train_steps']} steps at {data['train_len']} "
        f"tokens; ridge λ = {data['ridge']}; fitted on {data['trained']['n_train']} strings, R² on "
        f"{data['trained']['n_test']} others; best layer per width: "
        + ", ".join(f"w = {w}: {best[w]}" for w in widths)
        + " (one probe fit: no interval).",
    ]
    return "\n".join(lines)


def pcfg_baselines_table(data: dict) -> str:
    lengths = sorted(data["lengths"], key=int)
    lines = [
        "| reference (no training; grammar of task seed 0) | " + " | ".join(lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name in ("unigram", "bigram"):
        cells = [data["lengths"][n][name] for n in lengths]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{c['score']:.3f} [{c['low']:.3f}, {c['high']:.3f}]" for c in cells)
            + " |"
        )
    lines.append(
        "| oracle entropy (nats per token) | "
        + " | ".join(f"{data['lengths'][n]['oracle_entropy']:.3f}" for n in lengths)
        + " |"
    )
    return "\n".join(lines)


def pcfg_vs_bigram(cells: dict[str, dict[int, Cell]], base: dict) -> str:
    from ..stats import paired_difference

    lengths = sorted(int(n) for n in base["lengths"])
    lines = [
        "| mixer (seed 0) − bigram, paired over the same strings | "
        + " | ".join(f"{n}" for n in lengths)
        + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for r in sorted(cells, key=lambda r: (ORDER.index(r) if r in ORDER else 99, r)):
        row = []
        for n in lengths:
            mine = cells[r].get(n, {}).get(0)
            ref = base["lengths"][str(n)]["bigram"]["scores"]
            if not mine:
                row.append("–")
                continue
            ids = sorted(mine, key=int)
            pd = paired_difference([mine[i] for i in ids], [ref[int(i)] for i in ids])
            row.append(f"{pd.mean:+.3f} [{pd.low:+.3f}, {pd.high:+.3f}]")
        lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def pcfg_long_table(e_cells: dict[str, dict[int, Cell]], ref: dict) -> str:
    """exp(−mean excess NLL) per cell; the hull interval on the e scale, mapped through exp(−·), at most 1."""
    from ...lab.plot import cell_estimate

    lengths = sorted({n for c in e_cells.values() for n in c})

    def fmt(by_seed: dict) -> str:
        m, lo, hi, _ = cell_estimate(by_seed, clip=False)
        return f"{math.exp(-m):.3f} [{math.exp(-hi):.3f}, {min(1.0, math.exp(-lo)):.3f}]"

    lines = [
        "| mixer (3 seeds × 24 strings) | " + " | ".join(f"{n} ({n // 16}×)" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for r in sorted(e_cells, key=lambda r: (ORDER.index(r) if r in ORDER else 99, r)):
        lines.append(
            f"| {_label(r)} | "
            + " | ".join(fmt(e_cells[r][n]) if n in e_cells[r] else "–" for n in lengths)
            + " |"
        )
    for name in ("unigram", "bigram"):
        by = {
            n: {int(s): dict(enumerate(ref["seeds"][s][str(n)][name])) for s in ref["seeds"]} for n in lengths
        }
        lines.append(f"| ({name}, no training) | " + " | ".join(fmt(by[n]) for n in lengths) + " |")
    return "\n".join(lines)


def lcube_ceiling_table(data: dict) -> str:
    ws = ("1", "2", "4", "16", "64")
    lines = ["| L | " + " | ".join(f"w = {w}" for w in ws) + " |", "|---|" + "---|" * len(ws)]
    for length in ("64", "1024"):
        c = data["ceiling"][length]
        lines.append(f"| {length} | " + " | ".join(f"{c[w]:.3f}" for w in ws) + " |")
    return "\n".join(lines)


def mtd_table(data: dict) -> str:
    from ..stats import paired_difference, score_estimate

    lines = [
        "| T | KL(Bayes ‖ model) | KL(MD-0 ‖ model) (uniform λ) | nearest MD-n, n ≥ 1: KL(MD ‖ model) | "
        "its paired Δ vs MD-0 |",
        "|---|---|---|---|---|",
    ]
    for length, d in sorted(data["lengths"].items(), key=lambda kv: int(kv[0])):

        def est(xs: list[float]) -> str:
            e = score_estimate(xs)
            return f"{e.mean:.4f} [{e.low:.4f}, {e.high:.4f}]"

        md0 = d["md"]["n=0,eta=0.5"]["kl_md_model"]
        near = min(
            (k for k in d["md"] if not k.startswith("n=0,")),
            key=lambda k: statistics.mean(d["md"][k]["kl_md_model"]),
        )
        x = d["md"][near]["kl_md_model"]
        pd = paired_difference(x, md0)
        lines.append(
            f"| {length} | {est(d['kl_bayes_model'])} | {est(md0)} | {near}: {est(x)} | "
            f"{pd.mean:+.4f} [{pd.low:+.4f}, {pd.high:+.4f}]"
            + ("" if pd.significant else ", not significant")
            + " |"
        )
    lines += [
        "",
        f"{len(data['lengths']['64']['kl_bayes_model'])} sequences per length; KL in nats, mean over "
        "positions; MD-n: mirror descent on the lag weights, n steps, step size η (grid n ∈ {0, 1, 2, 5, "
        "20}, η ∈ {0.5, 1, 2, 4}).",
    ]
    return "\n".join(lines)


def mixers_cost_table(data: dict) -> str:
    rows = data["rows"]
    lengths = sorted({r["length"] for r in rows})
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    by = {(r["mixer"], r["length"]): r for r in rows}
    lines = [
        "| mixer | " + " | ".join(str(n) for n in lengths) + f" | peak MB at {lengths[-1]} |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for m in mixers:
        cells = []
        for n in lengths:
            r = by.get((m, n))
            cells.append(
                "–"
                if r is None
                else f"{r['median_ms']:.1f} ms"
                if m == "softmax"
                else f"{r['ratio_to_softmax']:.2f}×"
            )
        last = by.get((m, lengths[-1])) or by.get((m, max(x for mm, x in by if mm == m)))
        cells.append(
            f"{last['peak_mb']:.1f}" + ("" if last["length"] == lengths[-1] else f" (at {last['length']})")
        )
        lines.append(
            f"| `{by[(m, lengths[0])]['spec'] if (m, lengths[0]) in by else m}` | " + " | ".join(cells) + " |"
        )
    loads = [r["load"] for r in rows]
    lines += [
        "",
        f"{data['header']}; load {min(loads):.2f}-{max(loads):.2f}; median of "
        f"{rows[0]['repeats']} interleaved repeats, ratio to softmax in the same run (one run: no interval).",
    ]
    return "\n".join(lines)


def l2a_cost_table(data: dict) -> str:
    rows = data["rows"]
    lengths = sorted({r["length"] for r in rows})
    by = {(r["mixer"], r["length"]): r for r in rows}
    lines = ["| routed | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in dict.fromkeys(r["mixer"] for r in rows):
        cells = []
        for n in lengths:
            r = by.get((m, n))
            cells.append(
                "–"
                if r is None
                else f"{r['median_ms']:.1f} ms"
                if m == "softmax"
                else f"{r['ratio_to_softmax']:.2f}×"
            )
        rate = [by[(m, n)].get("global_rate") for n in lengths if (m, n) in by]
        label = "softmax (ms)" if m == "softmax" else f"`{m}` (routed {statistics.mean(rate):.0%})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{data['header']}; median of {rows[0]['repeats']} interleaved repeats (one run: no interval).",
    ]
    return "\n".join(lines)


def flops_table(data: dict, passkey: dict[str, dict[int, Cell]]) -> str:
    rows = data["rows"]
    by = {(r["mixer"], r["length"]): r for r in rows}
    lo, hi = min(r["length"] for r in rows), max(r["length"] for r in rows)
    sm_lo, sm_hi = by[("softmax", lo)], by[("softmax", hi)]
    lines = [
        f"| model | FLOPs / token at {lo} | vs softmax | at {hi} | vs softmax | mixer layers at {lo} / {hi}: "
        f"counted (analytic ideal) | passkey at {lo} / {hi} (seed means) |",
        "|---|---|---|---|---|---|---|",
    ]
    spec = {"mamba": MAMBA}
    for m in dict.fromkeys(r["mixer"] for r in rows):
        a, b = by[(m, lo)], by[(m, hi)]

        def mix(r: dict) -> str:
            an = r.get("analytic_mixer_per_token")
            return f"{r['mixer_flops_per_token'] / 1e3:.0f} k" + (f" ({an / 1e3:.0f} k)" if an else "")

        pk = passkey.get(spec.get(m, m), {})

        def score(n: int, pk=pk) -> str:
            if n not in pk:
                return "–"
            return f"{statistics.mean(sum(v.values()) / len(v) for v in pk[n].values()):.2f}"

        lines.append(
            f"| `{m}` | {a['flops_per_token'] / 1e3:.0f} k | "
            f"{a['flops_per_token'] / sm_lo['flops_per_token']:.2f}× | "
            f"{b['flops_per_token'] / 1e3:.0f} k | {b['flops_per_token'] / sm_hi['flops_per_token']:.2f}× | "
            f"{mix(a)} / {mix(b)} | {score(lo)} / {score(hi)} |"
        )
    return "\n".join(lines)


# -- verdicts ------------------------------------------------------------------------------------------


def verdicts(stores: dict[str, dict[str, dict[str, dict[int, Cell]]]]) -> str:
    """Each claim's deciding comparison, computed from the rows: (claim, store task, A, B, length)."""
    pk, mx = stores["passkey"], stores["matrix"]
    claims = [
        (
            "ASEntmax extrapolates on passkey (vs softmax, RoPE)",
            pk["passkey"],
            "asentmax",
            "softmax",
            1024,
            "passkey",
        ),
        (
            "... and it is NAPE's: ASEntmax − softmax with NAPE positions",
            pk["passkey"],
            "asentmax",
            "softmax+nape",
            1024,
            "passkey",
        ),
        (
            "entmax + adaptive scale alone (RoPE) vs softmax",
            pk["passkey"],
            "asentmax+rope",
            "softmax",
            1024,
            "passkey",
        ),
        ("ASEntmax beyond NAPE on copy", mx["copy"], "asentmax", "softmax+nape", 1024, "copy"),
        ("SSMax vs softmax at 16×", pk["passkey"], "ssmax", "softmax", 1024, "passkey"),
        ("SSMax vs softmax at 4×", pk["passkey"], "ssmax", "softmax", 256, "passkey"),
        ("L2A vs softmax at 16×", pk["passkey"], "l2a", "softmax", 1024, "passkey"),
        ("L2A vs softmax at 4×", pk["passkey"], "l2a", "softmax", 256, "passkey"),
        (
            "LSSAR's re-weighting keeps L-CUBE utilisation (LSSAR − LSSA)",
            mx["lcube"],
            "lssar",
            "lssa",
            1024,
            "lcube",
        ),
        ("LSSAR vs softmax on L-CUBE at 16×", mx["lcube"], "lssar", "softmax", 1024, "lcube"),
        ("ASEntmax vs softmax on L-CUBE at 16×", mx["lcube"], "asentmax", "softmax", 1024, "lcube"),
        ("Mamba vs softmax on L-CUBE at 16×", mx["lcube"], MAMBA, "softmax", 1024, "lcube"),
        ("LaCT vs softmax on L-CUBE at 1×", mx["lcube"], "lact", "softmax", 64, "lcube"),
        ("LaCT vs softmax on L-CUBE at 16×", mx["lcube"], "lact", "softmax", 1024, "lcube"),
        ("RACE vs softmax on passkey at 2×", pk["passkey"], "race", "softmax", 128, "passkey"),
        ("UltraMemV2 vs softmax on MQAR at 1×", mx[MQAR], "ultramem", "softmax", 64, "mqar"),
        (
            "ASEntmax vs softmax on PCFG at 4× (per-prefix oracle)",
            mx[PCFG_N8],
            "asentmax",
            "softmax",
            64,
            "pcfg",
        ),
        ("LSSAR vs LSSA on PCFG at 4×", mx[PCFG_N8], "lssar", "lssa", 64, "pcfg"),
        (
            "ASEntmax vs softmax on PCFG at 16× (string oracle, exp(−e) per string)",
            mx[PCFG_LONG],
            "asentmax",
            "softmax",
            256,
            "pcfg-long",
        ),
        ("linear vs softmax on PCFG at 16×", mx[PCFG_LONG], "linear", "softmax", 256, "pcfg-long"),
    ]
    R3 = "bench/results/lab_results/round3"
    cmd = {
        "passkey": "python bench/lab.py seeds bench/results/lab_results --task passkey --pairs A:B",
        "copy": "python bench/lab.py seeds bench/results/lab_results/round3 --task copy --pairs A:B",
        "lcube": "python bench/lab.py seeds bench/results/lab_results/round3 --task lcube --pairs A:B",
        "mqar": f"python bench/lab.py seeds bench/results/lab_results/round3 --task '{MQAR}' --pairs A:B",
        "pcfg": f"python bench/lab.py seeds bench/results/lab_results/round3 --task '{PCFG_N8}' --pairs A:B",
        "pcfg-long": f"python bench/lab.py seeds {R3} --task '{PCFG_LONG}' --pairs A:B",
    }
    lines = [
        "| claim | A − B | length | Δ (Welch over seeds; paired bootstrap over tests) | verdict |",
        "|---|---|---|---|---|",
    ]
    for name, cells, a, b, n, _key in claims:
        if n not in cells.get(a, {}) or n not in cells.get(b, {}):
            lines.append(f"| {name} | `{a}` − `{b}` | {n} | not measured | – |")
            continue
        d = seed_difference(cells[a][n], cells[b][n])
        lines.append(f"| {name} | `{a}` − `{b}` | {n} | {d.text(verdict=False)} | **{d.verdict}** |")
    lines += [
        "",
        "Reproduce a row (`bench/lab.py seeds` reads the gzipped store as it is): "
        + "; ".join(f"{k}: `{v}`" for k, v in cmd.items())
        + ".",
    ]
    return "\n".join(lines)


# -- the page ----------------------------------------------------------------------------------------------


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every generated block of ``docs/results/layers-lab.md`` (the two PNGs too when ``plots``)."""
    res = root / "bench" / "results"
    lab = res / "lab_results"
    pk_rows, mx_rows = _load_rows(lab), _load_rows(lab / "round3")
    at_rows = _load_rows(lab / "attempts")
    pk = {t: cells_of(pk_rows, t) for t in ("passkey", "flipflop", "mtd")}
    pk["mqar"] = cells_of(pk_rows, "mqar", steps=True)
    mx = {t: cells_of(mx_rows, t) for t in (MQAR, "copy", ALGEBRA, "pcfg:max_length=64", PCFG_N8, "lcube")}
    mx[PCFG_LONG] = cells_of(mx_rows, PCFG_LONG)
    if plots:
        from ...lab.plot import plot_results

        plot_results(lab, root / "docs" / "results" / "layers-lab.png")
        plot_results(
            lab / "round3",
            root / "docs" / "results" / "layers-lab-matrix.png",
            skip=("query=", 'groups=["C7"]', 'groups=["C6"]', 'groups=["C8"]', "oracle=string"),
        )
    passkey_pairs = [
        ("asentmax", "softmax"),
        ("softmax+nape", "softmax"),
        ("asentmax", "softmax+nape"),
        ("l2a", "softmax"),
        ("ssmax", "softmax"),
        ("asentmax+rope", "softmax"),
        ("l2a:hard_rate=true", "softmax"),
        ("linear", "softmax"),
    ]
    attempt = cells_of(at_rows, "passkey")
    mqar_lr = json.loads((lab / "round3" / "mqar_lr1e-3_attempt.json").read_text(encoding="utf-8"))
    from ..stats import score_estimate

    lr = score_estimate([r["score"] for r in mqar_lr if r["length"] == 64])
    e_long = cells_of(mx_rows, PCFG_LONG, field="excess_nll")
    return {
        "lab-verdicts": verdicts({"passkey": pk, "matrix": mx}),
        "lab-passkey": score_table(pk["passkey"], "mixer (passkey, 1000 steps)", LENGTHS),
        "lab-passkey-diffs": diff_table(pk["passkey"], passkey_pairs, LENGTHS[1:]),
        "lab-mqar": score_table(mx[MQAR], "mixer (MQAR, 8 pairs, 800 steps)", LENGTHS)
        + "\n\n"
        + f"The lr 1e-3 attempt (softmax, 800 steps; `round3/mqar_lr1e-3_attempt.json`): {lr.mean:.2f} "
        f"[{lr.low:.2f}, {lr.high:.2f}] at 64 (n = {lr.n}).",
        "lab-copy": score_table(mx["copy"], "mixer (copy, 400 steps)", LENGTHS)
        + "\n\n"
        + diff_table(mx["copy"], [("asentmax", "softmax+nape"), ("softmax+nape", "softmax")], LENGTHS[1:]),
        "lab-algebra": score_table(mx[ALGEBRA], "mixer (algebra, 400 steps)", LENGTHS),
        "lab-algebra-mechanisms": mechanisms_table(_json(lab / "round3" / "algebra_mechanisms.json")),
        "lab-pcfg-defaults": score_table(
            mx["pcfg:max_length=64"], "mixer (PCFG defaults, 600 steps at 16)", nd=3
        )
        + "\n\n"
        + probe_table(_json(lab / "round3" / "pcfg_probe_softmax.json")),
        "lab-pcfg-baselines": pcfg_baselines_table(_json(lab / "round4" / "pcfg_baselines.json")),
        "lab-pcfg": score_table(mx[PCFG_N8], "mixer (PCFG n8/t32/α 0.02, 600 steps at 16)"),
        "lab-pcfg-vs-bigram": pcfg_vs_bigram(mx[PCFG_N8], _json(lab / "round4" / "pcfg_baselines.json")),
        "lab-pcfg-long": pcfg_long_table(e_long, _json(lab / "round4" / "pcfg_long_reference.json")),
        "lab-pcfg-probe": probe_table(_json(lab / "round4" / "pcfg_probe_softmax_n8a002.json")),
        "lab-lcube": score_table(mx["lcube"], "mixer (L-CUBE utilisation, 500 steps)", LENGTHS),
        "lab-lcube-ceiling": lcube_ceiling_table(_json(lab / "lcube_ceiling.json")),
        "lab-other": "**Flip-flop** (400 steps):\n\n"
        + score_table(pk["flipflop"], "mixer", LENGTHS)
        + "\n\n**MQMTAR** (2-token keys, as many pairs as fit; 400 / 2000 steps, the 2000-step run is the "
        "second "
        "softmax row):\n\n"
        + score_table(pk["mqar"], "mixer", LENGTHS)
        + "\n\n**LSSAR at lr 6e-3** (passkey, 1000 steps; `lab_results/attempts`):\n\n"
        + score_table(attempt, "mixer", LENGTHS),
        "lab-mtd": score_table(pk["mtd"], "mixer (MTD, 500 steps)")
        + "\n\n"
        + mtd_table(_json(lab / "mtd_md.json")),
        "lab-mixers-cost": mixers_cost_table(_json(res / "lab_mixers.json")),
        "lab-l2a-cost": l2a_cost_table(_json(lab / "l2a_rate_cost.json")),
        "lab-flops": flops_table(_json(lab / "flops.json"), pk["passkey"]),
    }
