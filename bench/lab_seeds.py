"""Mixer-vs-mixer differences over training seeds, from a lab results store: for each pair and length,
the difference of the seed-mean scores with a Welch t-interval over the per-seed means (each seed's mean
over the same test sequences), and the paired test-sequence bootstrap of the seed-averaged scores; a
difference is called significant only when both 95% intervals exclude 0.

    python bench/lab_seeds.py runs/lab/results --task passkey \\
        --pairs asentmax:softmax softmax+nape:softmax asentmax:softmax+nape l2a:softmax ssmax:softmax
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

from scipy import stats

from longlab.eval.stats import paired_difference
from longlab.lab.plot import lab_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--task", required=True)
    ap.add_argument("--pairs", nargs="+", required=True, help="A:B (A minus B)")
    args = ap.parse_args()
    cell: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in lab_rows(args.dir):
        if r["task"] == args.task:
            cell[r["recipe"]][int(r["length"])][int(r["seed"])][str(r["sample_id"])] = float(r["score"])
    print("| A − B | length | seeds A/B | Δ mean | 95% CI (seeds, Welch) | 95% CI (test sequences, paired) | "
          "verdict |")
    print("|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        a, b = pair.split(":")
        for n in sorted(set(cell[a]) & set(cell[b])):
            ma = [sum(v.values()) / len(v) for v in cell[a][n].values()]
            mb = [sum(v.values()) / len(v) for v in cell[b][n].values()]
            d = sum(ma) / len(ma) - sum(mb) / len(mb)
            va = statistics.variance(ma) / len(ma) if len(ma) > 1 else 0.0
            vb = statistics.variance(mb) / len(mb) if len(mb) > 1 else 0.0
            se = math.sqrt(va + vb)
            if se > 0:
                parts = [v * v / (len(m) - 1) for v, m in ((va, ma), (vb, mb)) if len(m) > 1 and v > 0]
                dfs = (va + vb) ** 2 / sum(parts)  # Welch–Satterthwaite
                half = float(stats.t.ppf(0.975, dfs)) * se
                seed_ci = (d - half, d + half)
            else:
                seed_ci = None
            runs = list(cell[a][n].values()) + list(cell[b][n].values())
            ids = sorted(set.intersection(*[set(v) for v in runs]))
            sa = [sum(v[i] for v in cell[a][n].values()) / len(ma) for i in ids]
            sb = [sum(v[i] for v in cell[b][n].values()) / len(mb) for i in ids]
            pdiff = paired_difference(sa, sb)
            sig = (pdiff.low > 0 or pdiff.high < 0) and (seed_ci is None or seed_ci[0] > 0 or seed_ci[1] < 0)
            enough = len(ma) > 1 and len(mb) > 1
            verdict = ("significant" if sig else "not significant") if enough else (
                "one seed on a side: test sequences only" + (", significant" if sig else ", not significant"))
            sci = f"[{seed_ci[0]:+.2f}, {seed_ci[1]:+.2f}]" if seed_ci else "–"
            print(f"| {a} − {b} | {n} | {len(ma)}/{len(mb)} | {d:+.2f} | {sci} | "
                  f"[{pdiff.low:+.2f}, {pdiff.high:+.2f}] | {verdict} |")


if __name__ == "__main__":
    main()
