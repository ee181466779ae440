"""The in-context algebra mechanism sets (and unseen-group sets) per mixer, from a lab results store:
accuracy on the held-out query of each set, with the Wilson interval over test sequences, and the
gap ``commuted − absent`` (copying; the two sets are different sequences, so unpaired) with Newcombe's
interval from the two Wilson intervals.

    python bench/lab_mechanisms.py runs/lab15/results --lengths 64 256 \
        --out bench/results/lab_results/round3/algebra_mechanisms.json

A row's set is read from its task spec (``query=...``, ``groups=[...]``); the trained task (no query, the
training groups) is the ``all facts`` column.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict

from longlab.eval.stats import score_estimate
from longlab.lab.plot import lab_rows


def set_name(task: str) -> str:
    q = re.search(r"query=(\w+)", task)
    if q:
        return q.group(1)
    g = re.search(r"groups=\[([^\]]*)\]", task)
    groups = [x.strip().strip('"') for x in g.group(1).split(",")] if g else []
    return "all facts" if len(groups) != 1 else f"only {groups[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out")
    args = ap.parse_args()
    cells: dict = defaultdict(list)
    for r in lab_rows(args.dir):
        if not str(r["task"]).startswith("algebra") or r.get("score") is None:
            continue
        if int(r["length"]) in args.lengths:
            cells[(r["recipe"], set_name(str(r["task"])), int(r["length"]))].append(float(r["score"]))
    sets = ["all facts", "commuted", "absent", "identity", "elimination"]
    sets += sorted({s for _, s, _ in cells if s not in sets})
    recipes = sorted({r for r, _, _ in cells})
    out = {}
    for n in args.lengths:
        print(f"\n**length {n}** (accuracy [95% Wilson / bootstrap CI], n test sequences)\n")
        print("| mixer | " + " | ".join(sets) + " | commuted − absent |")
        print("|---|" + "---|" * (len(sets) + 1))
        for rec in recipes:
            row, est = [rec], {}
            for s in sets:
                vals = cells.get((rec, s, n))
                if not vals:
                    row.append("–")
                    continue
                e = score_estimate(vals)
                est[s] = e
                row.append(f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}] n={e.n}")
                out.setdefault(rec, {}).setdefault(str(n), {})[s] = {"mean": e.mean, "low": e.low,
                                                                      "high": e.high, "n": e.n}
            if "commuted" in est and "absent" in est:
                a, b = est["commuted"], est["absent"]
                d = a.mean - b.mean  # Newcombe's hybrid score interval for a difference of proportions
                lo = d - math.sqrt((a.mean - a.low) ** 2 + (b.high - b.mean) ** 2)
                hi = d + math.sqrt((a.high - a.mean) ** 2 + (b.mean - b.low) ** 2)
                row.append(f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]")
                out[rec][str(n)]["commuted-absent"] = {"diff": d, "low": lo, "high": hi}
            else:
                row.append("–")
            print("| " + " | ".join(row) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
