"""The generated block of ``docs/results/models.md``: full-cache accuracy of the shipped models side by side.

Reads one ``longlab eval`` store per model under ``bench/results/models_full/MODEL/`` (recipe ``full``,
greedy): per task and length the mean score ×100 with its 95% interval (Wilson for pass/fail, bootstrap
for a graded score), the average over tasks (stratified bootstrap), and per task the difference between
the models. The two models' samples are **not paired** (each tokenizer builds its own context for a
sample), so the difference is tested unpaired: Fisher's exact test for pass/fail scores, and a bootstrap
of the difference of means (each model's samples resampled apart) for graded ones.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Unpaired", "render", "unpaired_difference"]

STORE = Path("bench/results/models_full")
MODELS = ("qwen2.5-0.5b", "smollm2-135m")
TASKS = ("niah_single_1", "niah_multikey_1", "vt", "passkey")
COMMAND = (
    "bench/heavy.sh longlab eval --model {model} --recipes full --tasks {tasks} --lengths {length} "
    "--samples {n} --max-new-tokens 32 --threads 1 --out bench/results/models_full/{model}"
)


@dataclass(frozen=True)
class Unpaired:
    """A − B over independent samples: the mean difference, its 95% interval and, for pass/fail scores,
    Fisher's exact two-sided p (None for graded scores, whose test is the interval)."""

    mean: float
    low: float
    high: float
    p: float | None

    @property
    def significant(self) -> bool:
        return (self.p < 0.05) if self.p is not None else (self.low > 0 or self.high < 0)


def unpaired_difference(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> Unpaired:
    """``mean(a) − mean(b)`` for two independent samples: a percentile bootstrap resampling each side apart,
    and Fisher's exact test when every score is 0 or 1."""
    from scipy import stats

    if not a or not b:
        raise ValueError("unpaired_difference: a side has no samples")
    rng = random.Random(seed)
    diffs = sorted(
        statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    lo, hi = diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]
    p = None
    if all(x in (0.0, 1.0) for x in (*a, *b)):
        ka, kb = int(sum(a)), int(sum(b))
        p = float(stats.fisher_exact([[ka, len(a) - ka], [kb, len(b) - kb]]).pvalue)
    return Unpaired(statistics.fmean(a) - statistics.fmean(b), lo, hi, p)


def _scores(root: Path) -> dict[str, dict[tuple[str, int], list[float]]]:
    """model -> (task, length) -> scores of the ``full`` rows, in sample order."""
    from ..rows import load_rows

    out: dict = {}
    for model in MODELS:
        d = root / STORE / model
        if not d.is_dir():
            raise FileNotFoundError(f"models page: {d} is missing")
        cells: dict = defaultdict(list)
        rows = sorted(
            (r for r in load_rows(d) if r["recipe"] == "full" and r.get("score") is not None),
            key=lambda r: (r["task"], r["length"], len(str(r["sample_id"])), str(r["sample_id"])),
        )
        for r in rows:
            cells[(r["task"], int(r["length"]))].append(float(r["score"]))
        out[model] = dict(cells)
    return out


def _range(ns: list[int]) -> str:
    return str(ns[0]) if ns[0] == ns[-1] else f"{ns[0]}–{ns[-1]}"


def _cell(xs: list[float]) -> str:
    from ..stats import score_estimate

    e = score_estimate(xs)
    return f"{100 * e.mean:.1f} [{100 * e.low:.1f}, {100 * e.high:.1f}] (n={e.n})"


def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's ``models-full`` block (no plots)."""
    from ..stats import stratified_estimate

    data = _scores(root)
    lengths = sorted({n for cells in data.values() for _, n in cells})
    out: list[str] = []
    for length in lengths:
        tasks = [t for t in TASKS if all((t, length) in data[m] for m in MODELS)]
        out += [
            f"**{length:,} tokens**",
            "",
            "| model | " + " | ".join(tasks) + " | average over tasks |",
            "|---|" + "---:|" * (len(tasks) + 1),
        ]
        for m in MODELS:
            avg = stratified_estimate([data[m][(t, length)] for t in tasks])
            out.append(
                f"| {m} | "
                + " | ".join(_cell(data[m][(t, length)]) for t in tasks)
                + f" | {100 * avg.mean:.1f} [{100 * avg.low:.1f}, {100 * avg.high:.1f}] |"
            )
        out += [
            "",
            f"| {MODELS[0]} − {MODELS[1]} (unpaired) | difference ×100 [95% CI] | test | verdict |",
            "|---|---:|---|---|",
        ]
        diffs = {
            t: unpaired_difference(data[MODELS[0]][(t, length)], data[MODELS[1]][(t, length)]) for t in tasks
        }
        for t, d in diffs.items():
            test = f"Fisher exact p = {d.p:.2g}" if d.p is not None else "bootstrap interval"
            out.append(
                f"| {t} | {100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {test} | "
                f"{'**significant**' if d.significant else 'not significant'} |"
            )
        ns = sorted({len(v) for m in MODELS for k, v in data[m].items() if k[1] == length})
        sig = [t for t, d in diffs.items() if d.significant]
        rest = [t for t in tasks if t not in sig]
        better = {t: MODELS[0] if diffs[t].mean > 0 else MODELS[1] for t in sig}
        out += [
            "",
            f"**Verdict ({length:,} tokens).** "
            + (
                "; ".join(f"`{t}`: {better[t]} is better, significant" for t in sig)
                or "No task separates the models significantly"
            )
            + (
                f"; not significant: {', '.join(f'`{t}`' for t in rest)}"
                if rest and sig
                else f" ({', '.join(f'`{t}`' for t in rest)})"
                if rest
                else ""
            )
            + f" (n = {_range(ns)} per cell).",
        ]
        out += ["", "Reproduce (then `gzip -9` each `results.sqlite`, the committed form):", "", "```bash"]
        for m in MODELS:
            n = max(len(data[m][(t, length)]) for t in tasks)
            out.append(COMMAND.format(model=m, tasks=",".join(tasks), length=length, n=n))
        out += ["```", ""]
    return {"models-full": "\n".join(out)}
