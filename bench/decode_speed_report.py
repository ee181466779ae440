"""The fused-kernel accuracy check of ``docs/results/decode-speed.md``: from a ``longlab eval`` results
directory, per recipe pair ``R`` / ``R:fused=false``, the samples whose predictions are identical, written
to ``bench/results/decode_speed_accuracy.json``. The page's tables come from
:mod:`longlab.eval.pages.decode_speed`.

    python bench/decode_speed_report.py --accuracy runs/kernels-acc    # results.sqlite -> compact JSON
    longlab report --docs --page results/decode-speed                   # JSON files -> the page's tables
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
from pathlib import Path

from common import ROOT, write_json

RESULTS = ROOT / "bench/results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def accuracy(run_dir: str) -> Path:
    """Pairs ``R`` / ``R,fused=false`` (or ``R:fused=false``) of a results directory: identical
    predictions."""
    db = Path(run_dir) / "results.sqlite"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT recipe, task, length, sample_id, prediction, score FROM results").fetchall()
    con.close()
    by = {}
    for recipe, task, length, sample, pred, score in rows:
        by.setdefault(recipe, {})[(task, length, sample)] = (pred, score)
    def key(recipe: str) -> tuple[str, frozenset]:  # the recipe without its fused=false parameter
        name, _, params = recipe.partition(":")
        return name, frozenset(p for p in params.split(",") if p and p != "fused=false")

    pairs = []
    for recipe in sorted(by):
        if "fused=false" in recipe:
            continue
        off = next((r for r in by if "fused=false" in r and key(r) == key(recipe)), None)
        if off is None:
            continue
        keys = sorted(set(by[recipe]) & set(by[off]))
        same = sum(by[recipe][k][0] == by[off][k][0] for k in keys)
        s_on = [by[recipe][k][1] for k in keys]
        s_off = [by[off][k][1] for k in keys]
        pairs.append({"recipe": recipe, "unfused": off, "n": len(keys), "identical": same,
                      "tasks": sorted({k[0] for k in keys}), "lengths": sorted({k[1] for k in keys}),
                      "score_fused": round(statistics.mean(s_on), 4),
                      "score_unfused": round(statistics.mean(s_off), 4),
                      "differing": [list(k) for k in keys if by[recipe][k][0] != by[off][k][0]]})
    return write_json(RESULTS / "decode_speed_accuracy.json", {"run_dir": str(run_dir), "pairs": pairs})

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accuracy", required=True,
                   help="a longlab eval results directory: write decode_speed_accuracy.json")
    args = p.parse_args(argv)
    print(f"wrote {accuracy(args.accuracy)}")
    print("the page's tables: longlab report --docs --page results/decode-speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
