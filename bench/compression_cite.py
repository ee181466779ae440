"""Citation precision / recall / F1 and answer correctness per recipe on ``cite_qa``, from a results store.

Reads the rows ``longlab eval`` wrote (``DIR/results.sqlite``), scores each prediction with
:func:`longlab.tasks.compression.citation_scores` against the sample's answer and true sentence ids, and
prints per recipe: the means with 95% intervals (Wilson for correctness, bootstrap for P/R/F1), the
paired difference to ``--base`` on the same samples (paired bootstrap), and Guidance's own counters
(forced sentences, lookaheads).

    .venv/bin/python bench/compression_cite.py bench/results/compression/cite_qa_qwen
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    from longlab.eval.stats import paired_difference, score_estimate
    from longlab.eval.store import ResultStore
    from longlab.tasks.compression import citation_scores

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--base", default="full")
    p.add_argument("--examples", type=int, default=0, help="print this many predictions per recipe")
    args = p.parse_args(argv)
    rows: dict[str, dict[str, dict]] = {}
    if not os.path.exists(os.path.join(args.dir, "results.sqlite")):
        raise SystemExit(f"no results.sqlite in {args.dir}")
    with ResultStore(args.dir, readonly=True) as store:
        for row in store.iter_rows():
            rows.setdefault(row["recipe"], {})[row["sample_id"]] = row
    ids = sorted(set.intersection(*(set(r) for r in rows.values())))  # samples every recipe answered
    parts = ("correct", "precision", "recall", "f1")
    scores = {rc: {i: citation_scores(rows[rc][i]["prediction"], rows[rc][i]["answers"]) for i in ids}
              for rc in rows}
    print(f"n = {len(ids)} samples answered by every recipe")
    print("| recipe | answer correct | citation precision | recall | F1 | cites anything | "
          "forced sentences / sample |")
    print("|---|---|---|---|---|---|---|")
    for rc in rows:
        cells = []
        for part in parts:
            e = score_estimate([scores[rc][i][part] for i in ids], resamples=2000)
            cells.append(f"{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}]")
        cites = sum("[" in rows[rc][i]["prediction"] for i in ids)
        forced = [rows[rc][i]["extra"].get("context", {}).get("forced_sentences") for i in ids]
        known = any(f is not None for f in forced)
        forced_txt = f"{sum(f or 0 for f in forced) / len(ids):.1f}" if known else "—"
        print(f"| `{rc}` | {' | '.join(cells)} | {cites}/{len(ids)} | {forced_txt} |")
    if args.base in rows:
        print(f"\nPaired difference (recipe - {args.base}, same samples; *: the 95% CI excludes 0):\n")
        print("| recipe | answer correct | precision | recall | F1 |")
        print("|---|---|---|---|---|")
        for rc in rows:
            if rc == args.base:
                continue
            cells = []
            for part in parts:
                d = paired_difference([scores[rc][i][part] for i in ids],
                                      [scores[args.base][i][part] for i in ids], resamples=2000)
                cells.append(f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{' *' if d.significant else ''}")
            print(f"| `{rc}` | {' | '.join(cells)} |")
    for rc in rows:
        for i in ids[: args.examples]:
            print(f"{rc} {i}: {rows[rc][i]['prediction']!r} (answers {rows[rc][i]['answers']})")
    for rc in rows:
        ctx = [rows[rc][i]["extra"].get("context", {}) for i in ids]
        keys = sorted({k for c in ctx for k, v in c.items() if isinstance(v, (int, float))})
        if keys and rc != args.base:
            print(f"{rc} counters (sum over samples):",
                  {k: round(sum(c.get(k, 0) for c in ctx), 2) for k in keys if k not in ("context_s",)})


if __name__ == "__main__":
    main(sys.argv[1:])
