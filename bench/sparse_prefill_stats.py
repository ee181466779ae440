"""Per-sample prefill-time ratios and mask quality of sparse prefill recipes, from one results.sqlite.

The recipes of one sample run back to back in one ``longlab eval`` process, so the per-sample ratio
``prefill_s(recipe) / prefill_s(full)`` compares like with like under a changing load. For each recipe:

* the geometric mean of those ratios, ``exp(mean(log r_i))``, with a seeded percentile bootstrap 95% CI
  over samples (``longlab.eval.stats.bootstrap_ci`` on the logs), and the median ratio;
* how many of its predictions equal `full`'s on the same sample (identical decoded text);
* the whole-model block density, attention recall and relative output error (the ``metrics`` rows with
  ``layer = head = -1`` that ``--prefill-metrics`` writes), as a mean over samples with a bootstrap 95% CI.

Overall and per task. Usage::

    python bench/sparse_prefill_stats.py RESULTS.sqlite OUT.json [--length L]
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3

import numpy as np

from longlab.eval.stats import bootstrap_ci


def _ci(values: list[float], digits: int = 3) -> dict:
    m, lo, hi = bootstrap_ci([values])
    return {"n": len(values), "mean": round(m, digits), "ci95": [round(lo, digits), round(hi, digits)]}


def _ratio(logs: list[float]) -> dict:
    m, lo, hi = bootstrap_ci([logs])
    return {"n": len(logs), "geomean": round(math.exp(m), 3),
            "ci95": [round(math.exp(lo), 3), round(math.exp(hi), 3)],
            "median": round(float(np.exp(np.median(logs))), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db")
    ap.add_argument("out")
    ap.add_argument("--length", type=int, default=None, help="only rows of this prompt length")
    a = ap.parse_args()
    con = sqlite3.connect(f"file:{a.db}?mode=ro", uri=True)
    sql = "select run_key, recipe, task, sample_id, prefill_s, prediction from results"
    if a.length:
        rows = con.execute(sql + " where length = ?", (a.length,)).fetchall()
    else:
        rows = con.execute(sql).fetchall()
    metric = {(k, n): v for k, n, v in con.execute(
        "select run_key, name, value from metrics where layer = -1 and head = -1")}
    by = {(r, s): (key, task, p) for key, r, task, s, p, _ in rows}
    pred = {(r, s): text for _, r, _, s, _, text in rows}
    full = {s: p for (r, s), (_, _, p) in by.items() if r == "full"}
    med = round(float(np.median(list(full.values()))), 2)
    res: dict = {"full_prefill_s": {"n": len(full), "median": med},
                 "ratio_to_full": {}, "same_prediction_as_full": {}, "mask_quality": {}}
    for recipe in sorted({r for r, _ in by} - {"full"}):
        mine = [(s, key, task, p) for (r, s), (key, task, p) in by.items() if r == recipe]
        pairs = [(task, math.log(p / full[s])) for s, _, task, p in mine if s in full]
        same = [pred[recipe, s] == pred["full", s] for s, *_ in mine if s in full]
        res["same_prediction_as_full"][recipe] = {"same": sum(same), "n": len(same)}
        if pairs:
            entry = {"all": _ratio([x for _, x in pairs])}
            for task in sorted({t for t, _ in pairs}):
                entry[task] = _ratio([x for t, x in pairs if t == task])
            res["ratio_to_full"][recipe] = entry
        q = {}
        for name in ("density", "recall", "rel_error"):
            vals = [(task, metric[key, name]) for _, key, task, _ in mine if (key, name) in metric]
            if vals:
                q[name] = {"all": _ci([v for _, v in vals])}
                for task in sorted({t for t, _ in vals}):
                    q[name][task] = _ci([v for t, v in vals if t == task])
        if q:
            res["mask_quality"][recipe] = q
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("full prefill median", res["full_prefill_s"])
    for recipe, e in res["ratio_to_full"].items():
        print(recipe, "time/full", "  ".join(
            f"{k}: {v['geomean']}x [{v['ci95'][0]}, {v['ci95'][1]}] n={v['n']}" for k, v in e.items()))
    for recipe, e in res["same_prediction_as_full"].items():
        print(recipe, f"same prediction as full: {e['same']} of {e['n']}")
    for recipe, q in res["mask_quality"].items():
        for name, e in q.items():
            print(recipe, name, "  ".join(
                f"{k}: {v['mean']} [{v['ci95'][0]}, {v['ci95'][1]}] n={v['n']}" for k, v in e.items()))


if __name__ == "__main__":
    main()
