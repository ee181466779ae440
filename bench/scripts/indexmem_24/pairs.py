"""IndexMem against SnapKV at equal ratio, from a ``longlab eval`` store (issue 10, item 6).

    .venv/bin/python bench/scripts/indexmem_24/pairs.py runs/indexmem/results.sqlite bench/results/indexmem_24

Writes ``rows.csv`` (every scored row: recipe, task, length, sample, score, prediction, timings, KV
bytes) and ``pairs.json``: per recipe, task and length the mean score with its 95% interval
(Wilson for pass/fail cells, percentile bootstrap for graded ones, :func:`score_estimate`); per recipe
and length the average over the tasks with a stratified bootstrap interval; and every
``indexmem@r`` − ``snapkv@r`` difference (and ``indexmem@r`` − ``indexmem@r:memory=false``) as a paired
stratified bootstrap on the same samples (:func:`stratified_difference`, 10,000 resamples, seed 0),
with the count of samples better / worse and an exact two-sided sign test on them. The newest row per
(recipe, task, length, sample) counts. Prints a markdown table.
"""

from __future__ import annotations

import csv
import json
import math
import sqlite3
import sys
from pathlib import Path

from longlab.eval.stats import score_estimate, stratified_difference, stratified_estimate

TASKS = ("niah_single_1", "niah_multikey_1", "vt")


def sign_test(up: int, down: int) -> float:
    """Exact two-sided binomial sign test on ``up`` better and ``down`` worse samples (ties dropped)."""
    n = up + down
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(up, down) + 1)) / 2**n)


def main(db: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    cols = ("recipe", "task", "length", "sample_id", "score", "prediction", "answers", "prefill_s",
            "compress_s", "decode_s", "kv_bytes_after", "created_at")
    rows = conn.execute(f"select {', '.join(cols)} from results order by created_at, id").fetchall()
    newest = {(r[0], r[1], r[2], r[3]): r for r in rows}  # later rows replace earlier ones
    with open(out / "rows.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for key in sorted(newest):
            w.writerow(newest[key])
    S = {k: float(r[4]) for k, r in newest.items()}
    recipes = sorted({k[0] for k in S})
    lengths = sorted({k[2] for k in S})

    def ids(recipe: str, task: str, length: int) -> set[str]:
        return {k[3] for k in S if k[:3] == (recipe, task, length)}

    cells, avgs, diffs = {}, {}, []
    for r in recipes:
        for n in lengths:
            if not any(ids(r, t, n) for t in TASKS):
                continue
            strata = []
            for t in TASKS:
                vals = [S[(r, t, n, i)] for i in sorted(ids(r, t, n))]
                if vals:
                    e = score_estimate(vals)
                    cells[f"{r}|{t}|{n}"] = [100 * e.mean, 100 * e.low, 100 * e.high, e.n, e.method]
                    strata.append(vals)
            if len(strata) == len(TASKS):
                e = stratified_estimate(strata)
                avgs[f"{r}|{n}"] = [100 * e.mean, 100 * e.low, 100 * e.high, e.n]
    pairs = []
    for r in recipes:
        if r.startswith("indexmem@"):
            ratio = r.split("@", 1)[1].split(":", 1)[0]
            pairs.append((f"snapkv@{ratio}", r))
            if r.endswith(":memory=false"):
                pairs.append((r, f"indexmem@{ratio}"))
    for b, m in pairs:
        if b not in recipes or m not in recipes:
            continue
        for n in lengths:
            common = {t: sorted(ids(b, t, n) & ids(m, t, n)) for t in TASKS}
            if not all(common.values()):
                continue
            d = stratified_difference(
                [([S[(m, t, n, i)] for i in common[t]], [S[(b, t, n, i)] for i in common[t]]) for t in TASKS]
            )
            delta = [S[(m, t, n, i)] - S[(b, t, n, i)] for t in TASKS for i in common[t]]
            up, down = sum(x > 0 for x in delta), sum(x < 0 for x in delta)
            diffs.append({"length": n, "baseline": b, "method": m, "n": d.n, "significant": d.significant,
                          "better": up, "worse": down, "sign_test_p": sign_test(up, down),
                          "diff": [100 * d.mean, 100 * d.low, 100 * d.high]})
    json.dump({"source": db, "tasks": TASKS, "cells": cells, "averages": avgs, "differences": diffs},
              open(out / "pairs.json", "w"), indent=1)

    def fmt(v: list) -> str:
        return f"{v[0]:.1f} [{v[1]:.1f}, {v[2]:.1f}]"

    for n in lengths:
        print(f"\n### {n} tokens\n")
        print("| recipe | " + " | ".join(TASKS) + " | avg over tasks |")
        print("|---|" + "---:|" * (len(TASKS) + 1))
        for r in recipes:
            if f"{r}|{n}" in avgs:
                cs = [fmt(cells[f"{r}|{t}|{n}"]) + f" (n={cells[f'{r}|{t}|{n}'][3]})" for t in TASKS]
                avg = avgs[f"{r}|{n}"]
                print(f"| `{r}` | " + " | ".join(cs) + f" | {fmt(avg)} (n={avg[3]}) |")
        print("\n| baseline | method | method − baseline [paired 95% CI] | better / worse | sign test p |")
        print("|---|---|---:|---:|---:|")
        for d in diffs:
            if d["length"] == n:
                sig = "" if d["significant"] else " n.s."
                print(f"| `{d['baseline']}` | `{d['method']}` | {fmt(d['diff'])}{sig} (n={d['n']}) "
                      f"| {d['better']} / {d['worse']} | {d['sign_test_p']:.3g} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: pairs.py RESULTS.sqlite OUT_DIR")
    main(sys.argv[1], sys.argv[2])
