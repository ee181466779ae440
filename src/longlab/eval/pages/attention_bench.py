"""The generated blocks of ``docs/results/attention-bench.md``: LongCA-bench on CPU (issue 16).

LongCA-bench (Bu et al., arXiv 2510.17896): attention kernels x 15 masks, the sparse-prefill executor's
time at density rho against rho x dense, and context-parallel strategies. Every block is computed from the
committed ``bench/results/attention_bench_*.json`` (written by ``bench/attention.py bench``) and
``sparse_prefill_backends.json`` (``bench/sparse_prefill.py backends``); the query-tile micro-benchmark
from ``attention_tile_micro_grid_8k.txt`` (``bench/attention.py tile 8192 --grid``).

Executor efficiency is ``rho x t_dense / t`` per interleaved repeat (paired with the dense call of the
same repeat); its interval is the distribution-free order-statistic interval of the median (coverage
``1 - 2 P(Bin(n, 1/2) < k)``, the largest ``k`` reaching 95%, else ``[min, max]`` with its coverage
stated). Backend comparisons pair the repeats: ratio per repeat, sign test over repeats.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

__all__ = ["GOAL", "goal_status", "median_interval", "render", "sign_test"]

GOAL = 0.8  # issue 16: executor time within 1.25x of rho x dense, i.e. efficiency >= 0.8, from 8k
GOAL_FROM = 8192
# longlab.ops.kernels.KERNELS order (kept here so rendering the page does not import torch)
KERNEL_ORDER = (
    "naive",
    "sdpa-math",
    "sdpa",
    "flex",
    "flex-eager",
    "gather",
    "grouped",
    "executor-gather",
    "executor-flex",
    "executor-split",
    "executor-grouped",
    "executor-flash",
    "flash-attn",
    "flashinfer",
)
EXECUTOR_FILES = (
    "attention_bench_executor_r5_oneshot_8k.json",
    "attention_bench_executor_r5_oneshot_16k.json",
    "attention_bench_executor_r5_oneshot_32k.json",
    "attention_bench_executor_r5_chunk.json",
)
RERUN_FILES = ("attention_bench_executor_r5b_oneshot_16k.json",)
KERNEL_FILES = ("attention_bench_kernels_1thread.json", "attention_bench_32k_mha.json")
BACKWARD_FILES = (
    "attention_bench_bwd_4k.json",
    "attention_bench_bwd_4k_mha.json",
    "attention_bench_bwd_8k.json",
)
FLASH_GRID = "attention_bench_kernels_r5_flash.json"
CP_FILE = "attention_bench_cp.json"
PREFILL_FILE = "sparse_prefill_backends.json"
TILE_FILE = "attention_tile_micro_grid_8k.txt"


# -- statistics ---------------------------------------------------------------------------------------------


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(low, high, coverage)``: order statistics ``(x_(k), x_(n+1-k))`` around the median with the largest
    ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) < k)`` reaches ``confidence``; with too few values for that,
    ``[min, max]`` and its (lower) coverage."""
    if not xs:
        raise ValueError("median_interval: no values")
    n, s = len(xs), sorted(xs)
    below = [sum(math.comb(n, i) for i in range(k)) / 2**n for k in range(1, n // 2 + 2)]  # P(Bin < k)
    ks = [k for k in range(1, n // 2 + 1) if 1 - 2 * below[k - 1] >= confidence]
    k = max(ks) if ks else 1
    return s[k - 1], s[n - k], 1 - 2 * below[k - 1]


def sign_test(wins: int, n: int) -> float:
    """Two-sided exact sign test p-value: ``wins`` of ``n`` paired repeats favour one side (ties dropped)."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, n - wins) + 1)) / 2**n
    return min(1.0, 2 * tail)


def goal_status(median: float, low: float, high: float, goal: float = GOAL) -> str:
    """``firm`` (interval above the goal), ``met`` (median at or above it), ``missed`` (median below)."""
    if low >= goal:
        return "firm"
    return "met" if median >= goal else "missed"


# -- loading -----------------------------------------------------------------------------------------------


def _load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(f"attention-bench page: {path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


def _command(meta: dict, sub: str = "bench") -> str:
    argv = " ".join(meta.get("argv") or [])
    return f"bench/heavy.sh python bench/attention.py {sub} {argv}".rstrip()


def _load_avg(meta: dict) -> str:
    def one(s: str | None) -> str:
        return s.split("load average:")[-1].split(",")[0].strip() if s else "?"

    return f"{one(meta.get('uptime'))}-{one(meta.get('uptime_end'))}"


def _mode(r: dict) -> str:
    return "chunked" if r.get("T_q", r["T"]) < r["T"] else "one-shot"


def _mask_label(m: str) -> str:
    m = m.replace("random-per-head keep=", "random keep ")
    return m


# -- executor ----------------------------------------------------------------------------------------------


def _eff(r: dict) -> tuple[float, float, float, float]:
    """Paired median efficiency, its interval and coverage."""
    xs = r["eff_paired"]
    lo, hi, cov = median_interval(xs)
    return statistics.median(xs), lo, hi, cov


def _ratios(a: dict, b: dict) -> list[float]:
    """Per-repeat time ratio a / b (the same interleaved repeat)."""
    return [x / y for x, y in zip(a["s_all"], b["s_all"])]


def executor_table(runs: list[dict], mode: str) -> str:
    rows = [(r, run["meta"]) for run in runs for r in run["executor"] if _mode(r) == mode]
    lines = [
        "| T | mask | density | repeats | dense ms | grouped: ms (efficiency [interval]) | "
        "**flash**: ms (efficiency [interval]) | grouped / flash per repeat: median [interval] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["T"], r["mask"], m["date"]) for r, m in rows))
    covs: set[str] = set()
    for T, mask, date in keys:
        sub = {r["backend"]: r for r, m in rows if (r["T"], r["mask"], m["date"]) == (T, mask, date)}
        any_r = next(iter(sub.values()))

        def cell(b: str, sub=sub) -> str:
            if b not in sub:
                return "-"
            med, lo, hi, cov = _eff(sub[b])
            covs.add(f"{len(sub[b]['eff_paired'])} repeats: {cov:.0%}")
            return f"{sub[b]['s'] * 1e3:.0f} ({med:.2f} [{lo:.2f}, {hi:.2f}])"

        ratio = "-"
        if "grouped" in sub and "flash" in sub:
            rs = _ratios(sub["grouped"], sub["flash"])
            lo, hi, _ = median_interval(rs)
            ratio = f"{statistics.median(rs):.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(
            f"| {T} | {_mask_label(mask)} | {any_r['density']:.3f} | {any_r['repeats']} | "
            f"{any_r['dense_s'] * 1e3:.0f} | {cell('grouped')} | **{cell('flash')}** | {ratio} |"
        )
    lines += [
        "",
        "Interval coverage (order statistics of the per-repeat values): " + "; ".join(sorted(covs)) + ".",
    ]
    return "\n".join(lines)


def _best_cells(runs: list[dict]) -> dict[tuple, dict]:
    """(mode, T, mask, backend) -> the row with the most repeats (a rerun with more repeats wins)."""
    out: dict[tuple, dict] = {}
    for run in runs:
        for r in run["executor"]:
            key = (_mode(r), r["T"], r["mask"], r["backend"])
            if key not in out or r["repeats"] > out[key]["repeats"]:
                out[key] = r
    return out


def executor_verdict(runs: list[dict], reruns: list[dict]) -> str:
    cells = _best_cells(runs + reruns)
    out = []
    for mode in ("one-shot", "chunked"):
        flash = [r for (m, T, _, b), r in cells.items() if m == mode and b == "flash" and T >= GOAL_FROM]
        stats = [(r, *_eff(r)) for r in flash]
        status = [goal_status(med, lo, hi) for _, med, lo, hi, _ in stats]
        soft = [
            f"{r['T']} {_mask_label(r['mask'])} {med:.2f} [{lo:.2f}, {hi:.2f}]"
            for (r, med, lo, hi, _), s in zip(stats, status)
            if s != "firm"
        ]
        meds = [s[1] for s in stats]
        n_rep = sorted({r["repeats"] for r in flash})
        out.append(
            f"**Verdict — executor goal, {mode} prefill, backend `flash`: "
            f"{'met' if 'missed' not in status else 'not met'} in "
            f"{status.count('firm') + status.count('met')} "
            f"of {len(status)} cells** (T = {', '.join(str(t) for t in sorted({r['T'] for r in flash}))}; "
            f"random per-head keep 0.2 / 0.5 / 0.8 and sink + 2k window; {'/'.join(map(str, n_rep))} paired "
            f"repeats per cell). Paired median efficiency {min(meds):.2f}-{max(meds):.2f}; the interval lies "
            f"above {GOAL} in {status.count('firm')} cells"
            + (f"; not firmly: {'; '.join(soft)}" if soft else "")
            + "."
        )
    # flash vs grouped: the same repeats
    pairs = []
    for run in runs:
        by = {(_mode(r), r["T"], r["mask"], r["backend"]): r for r in run["executor"]}
        for (m, T, mask, b), r in by.items():
            if b == "flash" and (m, T, mask, "grouped") in by:
                pairs.append(_ratios(by[(m, T, mask, "grouped")], r))
    flat = [x for p in pairs for x in p]
    wins = sum(x > 1 for x in flat)
    meds = [statistics.median(p) for p in pairs]
    lo, hi, cov = median_interval(flat)
    out.append(
        f"**Verdict — `flash` against `grouped` (the same repeats): `flash` is faster in {wins} of "
        f"{len(flat)} paired repeats over {len(pairs)} cells** "
        f"(sign test p = {sign_test(wins, len(flat)):.1g}); "
        f"grouped / flash time, median over all repeats {statistics.median(flat):.2f} [{lo:.2f}, {hi:.2f}] "
        f"({cov:.0%} order-statistic interval), per-cell medians {min(meds):.2f}-{max(meds):.2f}."
    )
    cmds = "\n".join(_command(run["meta"]) for run in runs + reruns)
    return (
        "\n\n".join(out) + "\n\nReproduce (each through one `bench/heavy.sh` slot, one thread):\n\n"
        f"```bash\n{cmds}\n```"
    )


def rerun_table(reruns: list[dict]) -> str:
    lines = [
        "| T | mask | density | repeats | dense ms | **flash**: ms (efficiency [interval], coverage) |",
        "|---|---|---|---|---|---|",
    ]
    for run in reruns:
        for r in run["executor"]:
            if r["backend"] != "flash":
                continue
            med, lo, hi, cov = _eff(r)
            lines.append(
                f"| {r['T']} | {_mask_label(r['mask'])} | {r['density']:.3f} | {r['repeats']} | "
                f"{r['dense_s'] * 1e3:.0f} | {r['s'] * 1e3:.0f} ({med:.2f} [{lo:.2f}, {hi:.2f}], "
                f"{cov:.0%}) |"
            )
    return "\n".join(lines)


# -- the model prefill -------------------------------------------------------------------------------------


def prefill_block(data: dict) -> str:
    keys = ("full", "xattention:backend=grouped", "xattention:backend=flash")
    lines = [
        "| tokens | `full` prefill s | `xattention`, `grouped` s (x full) | "
        "`xattention`, `flash` s (x full) | "
        "grouped / flash per repeat | same answer tokens |",
        "|---|---|---|---|---|---|",
    ]
    flat = []
    for r in data["rows"]:
        med = {k: statistics.median(r["prefill_s"][k]) for k in keys}
        rat = [g / f for g, f in zip(r["prefill_s"][keys[1]], r["prefill_s"][keys[2]])]
        flat += rat
        lines.append(
            f"| {r['context_tokens']:,} | {med['full']:.1f} | {med[keys[1]]:.1f} "
            f"({med['full'] / med[keys[1]]:.2f}x) | **{med[keys[2]]:.1f} "
            f"({med['full'] / med[keys[2]]:.2f}x)** | {', '.join(f'{x:.2f}' for x in rat)} | "
            f"{'yes' if r['answers_equal_across_backends'] else 'no'} |"
        )
    wins = sum(x > 1 for x in flat)
    lo, hi, cov = median_interval(flat)
    a = data["args"]
    cmd = (
        f"bench/heavy.sh python bench/sparse_prefill.py backends --lengths {a['lengths']} "
        f"--repeats {a['repeats']}"
    )
    hw = data["hardware"]
    lines += [
        "",
        f"{a['model']}, one RULER `niah_single_1` sample, `{a['selector']}` prefill in chunks of "
        f"{a['chunk_size']:,}, {a['repeats']} interleaved repeats, {hw['threads']} thread, commit "
        f"{hw['git_commit']}.",
        "",
        f"**Verdict — the whole prefill with `flash` against `grouped`: `flash` faster in {wins} of "
        f"{len(flat)} paired repeats** (sign test p = {sign_test(wins, len(flat)):.2g}"
        + (", not significant" if sign_test(wins, len(flat)) >= 0.05 else "")
        + f"); grouped / flash median {statistics.median(flat):.2f} [{lo:.2f}, {hi:.2f}] ({cov:.0%} "
        f"order-statistic interval, n = {len(flat)}). Reproduce: `{cmd}`.",
    ]
    return "\n".join(lines)


# -- kernel grids ------------------------------------------------------------------------------------------


def _kernels(rows: list[dict]) -> list[str]:
    return [k for k in KERNEL_ORDER if any(r["kernel"] == k for r in rows)]


def grid_tables(krows: list[dict], note: str = "") -> list[str]:
    """One table per (shape, T): forward ms (GFLOP/s) [mask build ms], the fastest kernel per mask."""
    rows = [r for r in krows if "fwd_s" in r]
    out = []
    for shape in sorted({r["shape"] for r in rows}):
        for T in sorted({r["T"] for r in rows if r["shape"] == shape}):
            sub = [r for r in rows if r["shape"] == shape and r["T"] == T]
            kern = _kernels(sub)
            s0 = sub[0]
            reps = sorted({r["repeats"] for r in sub})
            out += [
                f"**{shape.upper()} (H={s0['H']}, H_kv={s0['H_kv']}, D={s0['D']}), T = {T:,}** "
                f"({'/'.join(map(str, reps))} timed repeat(s)){note}",
                "",
                "| mask | density | " + " | ".join(kern) + " | fastest |",
                "|---|---|" + "---|" * (len(kern) + 1),
            ]
            for mask in dict.fromkeys(r["mask"] for r in sub):
                got = {r["kernel"]: r for r in sub if r["mask"] == mask}
                best = min(got.values(), key=lambda r: r["fwd_s"])["kernel"]
                cells = []
                for k in kern:
                    if k not in got:
                        cells.append("-")
                        continue
                    r = got[k]
                    c = f"{r['fwd_s'] * 1e3:.1f} ({r['tflops_fwd'] * 1e3:.0f}) "
                    c += f"[{r['mask_build_s'] * 1e3:.1f}]"
                    cells.append(f"**{c}**" if k == best else c)
                out.append(f"| {mask} | {got[best]['density']:.3f} | " + " | ".join(cells) + f" | {best} |")
            out.append("")
    return out


def kernels_block(runs: list[dict]) -> str:
    rows = [r for run in runs for r in run["kernels"]]
    err = max(r["max_abs_err"] for r in rows if "max_abs_err" in r)
    out = [
        f"Cells: forward ms (GFLOP/s of useful work, `4 area H D`) [mask construction ms]; bold: the fastest "
        f"kernel of the row. Every output matched fp64 attention on 32 sampled query rows (max error "
        f"{err:.1e}). Medians of interleaved repeats, one thread; per-repeat times are not stored, so "
        "differences under ~10% are not claims.",
        "",
    ]
    for run in runs:
        m = run["meta"]
        note = f"; run of {m['date'][:16]} UTC" + (
            f", commit {m['git_commit']}" if m.get("git_commit") else ""
        )
        out += grid_tables(run["kernels"], note)
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if "skipped" in r:
            why = r["skipped"].split(";")[0]
            why = re.sub(r"mask '[A-Z_0-9.]+' ", "", why.removeprefix("to_block_sparse: "))
            skipped.setdefault((r["kernel"], why.split(" (")[0]), []).append(r["mask"])
    out += ["Not run (the reason the benchmark recorded):", ""]
    for (k, why), masks in sorted(skipped.items()):
        out.append(f"- `{k}`: {why} ({', '.join(sorted(set(masks)))})")
    out += [
        "",
        "Reproduce (the parts merged in the committed files; each through `bench/heavy.sh`):",
        "",
        "```bash",
    ]
    for run in runs:
        for part in run["meta"].get("merged_from") or [run["meta"]]:
            out.append(_command(part))
    out.append("```")
    return "\n".join(out)


def flash_grid_block(run: dict) -> str:
    rows = [r for r in run["kernels"] if "fwd_s" in r]
    out = grid_tables(rows)
    cmp = {"executor-grouped": [], "flex": []}
    wins = total = 0
    for shape, T, mask in dict.fromkeys((r["shape"], r["T"], r["mask"]) for r in rows):
        if mask == "CAUSAL":
            continue
        got = {r["kernel"]: r for r in rows if (r["shape"], r["T"], r["mask"]) == (shape, T, mask)}
        if "executor-flash" not in got:
            continue
        total += 1
        wins += min(got.values(), key=lambda r: r["fwd_s"])["kernel"] == "executor-flash"
        for k in cmp:
            if k in got:
                cmp[k].append(got[k]["fwd_s"] / got["executor-flash"]["fwd_s"])
    gf = [r["tflops_fwd"] * 1e3 for r in rows if r["kernel"] == "executor-flash" and r["mask"] != "CAUSAL"]
    out += [
        f"`executor-flash` is the fastest kernel on {wins} of {total} block-sparse cells: "
        f"{min(cmp['executor-grouped']):.2f}-{max(cmp['executor-grouped']):.2f}x over `executor-grouped`, "
        f"{min(cmp['flex']):.2f}-{max(cmp['flex']):.2f}x over compiled flex (ratios of medians of "
        f"{run['meta']['repeats']} repeats; per-repeat times are not stored, so this is descriptive, not a "
        f"tested claim), at {min(gf):.0f}-{max(gf):.0f} GFLOP/s. Reproduce: `{_command(run['meta'])}`."
    ]
    return "\n".join(out)


def backward_block(kernel_runs: list[dict], bwd_runs: list[dict]) -> str:
    out = [
        "Cells: backward ms (GFLOP/s, backward FLOPs = 2.5 x forward) [forward ms of the same call]; bold: "
        "the fastest. flex has no CPU backward in torch 2.13; `grouped` and `executor-flash` are forward "
        "only.",
        "",
    ]
    groups = [[r for run in kernel_runs for r in run["kernels"] if "bwd_s" in r]]
    groups += [[r for r in run["kernels"] if "bwd_s" in r] for run in bwd_runs]
    for rows in groups:
        for shape, T in dict.fromkeys((r["shape"], r["T"]) for r in rows):
            sub = [r for r in rows if (r["shape"], r["T"]) == (shape, T)]
            kern = _kernels(sub)
            reps = sorted({r["repeats"] for r in sub})
            out += [
                f"**backward, {shape.upper()}, T = {T:,}** ({'/'.join(map(str, reps))} timed repeat(s))",
                "",
                "| mask | density | " + " | ".join(kern) + " | fastest |",
                "|---|---|" + "---|" * (len(kern) + 1),
            ]
            for mask in dict.fromkeys(r["mask"] for r in sub):
                got = {r["kernel"]: r for r in sub if r["mask"] == mask}
                best = min(got.values(), key=lambda r: r["bwd_s"])["kernel"]
                cells = []
                for k in kern:
                    if k not in got:
                        cells.append("-")
                        continue
                    r = got[k]
                    c = f"{r['bwd_s'] * 1e3:.1f} ({r['tflops_bwd'] * 1e3:.0f}) [{r['fwd_s'] * 1e3:.0f}]"
                    cells.append(f"**{c}**" if k == best else c)
                out.append(f"| {mask} | {got[best]['density']:.3f} | " + " | ".join(cells) + f" | {best} |")
            out.append("")
    out += ["Reproduce (the 1k rows come from the first kernel command above):", "", "```bash"]
    out += [_command(run["meta"]) for run in bwd_runs] + ["```"]
    return "\n".join(out)


# -- context parallel --------------------------------------------------------------------------------------


def cp_block(run: dict) -> str:
    m = run["meta"]
    out = [
        f"{m['cpu']}, {m['cores']} cores, each rank 1 thread, load average {_load_avg(m)}, "
        "interleaved repeats (the slowest rank's median). Bytes: what each rank sent (max over ranks) "
        "next to the paper's per-device formula; max err: the largest absolute difference of the output "
        "and dQ, dK, dV from one process's fp64 attention. \"(pad)\": SmolLM2's 9 query heads do not divide "
        'over 2 or 4 ranks, so Ulysses / USP ran with `head_fallback="pad"`.',
        "",
        "| mask | strategy | ws | u | fwd ms | bwd ms | fwd MiB sent | theory | bwd MiB sent | theory | "
        "max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    exact = total = 0
    for r in run["cp"]:
        err = max(r["errors"].values()) if r.get("errors") else float("nan")
        name = (
            "single process" if r["world"] == 1 else r["strategy"] + (" (pad)" if r["heads_padded"] else "")
        )
        if r["world"] > 1 and not r["heads_padded"]:
            total += 1
            exact += r["fwd_bytes"] == r["fwd_bytes_theory"] and r["bwd_bytes"] == r["bwd_bytes_theory"]
        out.append(
            f"| {r['mask']} | {name} | {r['world']} | {r['u']} | {r['fwd_s'] * 1e3:.1f} | "
            f"{r['bwd_s'] * 1e3:.1f} | {r['fwd_bytes'] / 2**20:.2f} | {r['fwd_bytes_theory'] / 2**20:.2f} | "
            f"{r['bwd_bytes'] / 2**20:.2f} | {r['bwd_bytes_theory'] / 2**20:.2f} | {err:.1e} |"
        )
    errs = [max(r["errors"].values()) for r in run["cp"] if r.get("errors")]
    out += [
        "",
        f"**Verdict — correctness and traffic: every strategy at world sizes 1, 2 and 4 is within "
        f"{max(errs):.1e} of fp64 (n = {len(errs)} runs), and the bytes sent equal the volume formulas in "
        f"{exact} of {total} unpadded runs.** Times are not compared: {m['cores']} shared cores cannot run "
        f"4 ranks at once. Reproduce: `{_command(m)}`.",
    ]
    return "\n".join(out)


# -- the query-tile micro-benchmark ------------------------------------------------------------------------


def tile_block(text: str) -> str:
    lines = text.strip().splitlines()
    out = [
        f"{lines[0]} (aten's fused CPU flash kernel, ns per visible (query, key) pair):",
        "",
        "| call | ns / pair | x dense |",
        "|---|---|---|",
    ]
    for line in lines[1:]:
        m = re.match(r"(.+?)\s+([\d.]+) ns/pair\s+x ([\d.]+)", line)
        if m:
            out.append(f"| {m.group(1).strip()} | {float(m.group(2)):.3f} | {float(m.group(3)):.2f} |")
    out += [
        "",
        "Reproduce: `bench/heavy.sh python bench/attention.py tile 8192 --grid` (one run: single "
        "medians, no interval).",
    ]
    return "\n".join(out)


# -- plots -------------------------------------------------------------------------------------------------


def plot_kernels(rows: list[dict], shape: str, path: Path) -> None:
    """Forward GFLOP/s against T, one panel per mask, one colour per kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "fwd_s" in r and r["shape"] == shape]
    kern = _kernels(rows)
    colour = {k: plt.get_cmap("tab10")(KERNEL_ORDER.index(k) % 10) for k in kern}
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    cols = 5
    nrow = math.ceil(len(masks) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(3.4 * cols, 2.6 * nrow + 0.9), squeeze=False)
    for ax, mask in zip(axes.flat, masks):
        for k in kern:
            pts = sorted(
                (r["T"], r["tflops_fwd"] * 1e3) for r in rows if r["mask"] == mask and r["kernel"] == k
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, color=colour[k])
        ax.set_xscale("log", base=2)
        ax.set_title(mask, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(masks) :]:
        ax.axis("off")
    for i in range(nrow):
        axes[i][0].set_ylabel("forward GFLOP/s", fontsize=7)
    handles = [plt.Line2D([], [], color=colour[k], marker="o", ms=3, label=k) for k in kern]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
    fig.suptitle(
        f"kernels x masks, {shape.upper()}, forward GFLOP/s (from the unmasked area) vs T, 1 thread",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.35 / (2.6 * nrow + 0.9), 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# -- the page ----------------------------------------------------------------------------------------------


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every generated block of ``docs/results/attention-bench.md`` (and its two PNGs when ``plots``)."""
    results = root / "bench" / "results"
    execs = [_load(results, n) for n in EXECUTOR_FILES]
    reruns = [_load(results, n) for n in RERUN_FILES]
    kruns = [_load(results, n) for n in KERNEL_FILES]
    bruns = [_load(results, n) for n in BACKWARD_FILES]
    if plots:
        rows = [r for run in kruns for r in run["kernels"]]
        for shape in ("gqa", "mha"):
            plot_kernels(rows, shape, root / "docs" / "results" / f"attention-bench-kernels-{shape}.png")
    return {
        "attention-executor-verdict": executor_verdict(execs, reruns),
        "attention-executor-oneshot": executor_table(execs, "one-shot"),
        "attention-executor-rerun": rerun_table(reruns),
        "attention-executor-chunk": executor_table(execs, "chunked"),
        "attention-prefill-model": prefill_block(_load(results, PREFILL_FILE)),
        "attention-kernels-flash": flash_grid_block(_load(results, FLASH_GRID)),
        "attention-kernels": kernels_block(kruns),
        "attention-backward": backward_block([kruns[0]], bruns),
        "attention-cp": cp_block(_load(results, CP_FILE)),
        "attention-tile": tile_block((results / TILE_FILE).read_text(encoding="utf-8")),
    }
