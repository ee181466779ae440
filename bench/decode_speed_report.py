"""The fused-kernel accuracy check of ``docs/results/decode-speed.md``: from ``longlab eval`` results
directories, per recipe pair ``R`` / ``R:fused=false``, the samples whose predictions are identical, and per
``R,selection=group`` / ``R`` (Quest's page selection per KV head against per query head) the paired score
difference with its 95% paired-bootstrap interval, written to ``bench/results/decode_speed_accuracy.json``.
A recipe found in several directories is taken from the last one. The page's tables come from
:mod:`longlab.eval.pages.decode_speed`.

    python bench/decode_speed_report.py --accuracy runs/kernels-acc runs/kernels-acc3   # stores -> JSON
    python bench/decode_speed_report.py --accuracy runs/kernels-acc4 --keep   # replace those recipes only
    longlab report --docs --page results/decode-speed                                     # JSON -> tables
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import ROOT, read_store, write_json

RESULTS = ROOT / "bench/results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def accuracy(run_dirs: list[str], keep: bool = False) -> Path:
    """Pairs ``R`` / ``R,fused=false`` (or ``R:fused=false``): identical predictions; pairs
    ``R,selection=group`` / ``R``: the paired score difference. ``keep``: the committed JSON's entries for
    recipes these directories do not hold stay (a re-run of some recipes replaces only theirs)."""
    from longlab.eval.stats import paired_difference

    by: dict[str, dict] = {}
    for run_dir in run_dirs:
        mine: dict[str, dict] = {}
        for r in read_store(run_dir)[0]:
            mine.setdefault(r["recipe"], {})[(r["task"], r["length"], r["sample_id"])] = (r["prediction"],
                                                                                          r["score"])
        by.update(mine)  # a later directory's recipe replaces an earlier one's
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
    selections = []
    for recipe in sorted(by):
        if "selection=group" not in recipe or "fused=false" in recipe:
            continue
        name, _, params = recipe.partition(":")
        head = f"{name}:" + ",".join(p for p in params.split(",") if p != "selection=group")
        if head not in by:
            continue
        keys = sorted(set(by[recipe]) & set(by[head]))
        d = paired_difference([by[recipe][k][1] for k in keys], [by[head][k][1] for k in keys])
        selections.append({"recipe": recipe, "baseline": head, "n": len(keys),
                           "identical": sum(by[recipe][k][0] == by[head][k][0] for k in keys),
                           "score": round(statistics.mean(by[recipe][k][1] for k in keys), 4),
                           "score_baseline": round(statistics.mean(by[head][k][1] for k in keys), 4),
                           "diff": [round(d.mean, 4), round(d.low, 4), round(d.high, 4)],
                           "significant": d.significant})
    dirs = [str(d) for d in run_dirs]
    old = _load("decode_speed_accuracy.json") if keep else None
    if old is not None:
        fresh = {e["recipe"] for e in pairs + selections}
        def merged(kept: list[dict], new: list[dict]) -> list[dict]:
            return sorted([e for e in kept if e["recipe"] not in fresh] + new, key=lambda e: e["recipe"])

        pairs, selections = merged(old["pairs"], pairs), merged(old["selections"], selections)
        dirs = [d for d in old["run_dirs"] if d not in dirs] + dirs
    return write_json(RESULTS / "decode_speed_accuracy.json",
                      {"run_dirs": dirs, "pairs": pairs, "selections": selections})

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accuracy", required=True, nargs="+", metavar="DIR",
                   help="longlab eval results directories (a recipe in several: the last one's): write "
                        "decode_speed_accuracy.json")
    p.add_argument("--keep", action="store_true",
                   help="keep the committed JSON's entries for recipes the given directories do not hold")
    args = p.parse_args(argv)
    print(f"wrote {accuracy(args.accuracy, keep=args.keep)}")
    print("the page's tables: longlab report --docs --page results/decode-speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
