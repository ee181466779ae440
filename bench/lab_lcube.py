"""L-CUBE reference curves: the utilisation ceiling ``U_w(L)`` of the best predictor that sees only the last
``w`` tokens (exact Gaussian conditioning on the window, :meth:`Conditional.window_info`), and for every
trained lab model in a results store its utilisation ``U(L)`` and *effective context*: the smallest window
``w`` whose ceiling reaches the model's U (the spec's "utilised length", read off the ceiling curves).

    python bench/lab_lcube.py runs/lab/results --lengths 64 128 256 512 1024 \\
        --windows 1 2 4 8 16 32 64 128 256 512 1024 --out bench/results/lab_results/lcube_ceiling.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from longlab.lab.plot import lab_rows
from longlab.lab.tasks import task_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--task", default="lcube")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--out", default="bench/results/lab_results/lcube_ceiling.json")
    args = ap.parse_args()
    task = task_config(args.task)
    ceiling: dict[int, dict[int, float]] = {}
    for n in args.lengths:
        cond = task.conditional(n)
        full = cond.info()[1:].sum()  # predictions of x_1 .. x_{n-1}
        ceiling[n] = {w: float(cond.window_info(w)[1:].sum() / full) for w in args.windows if w <= n}
        ceiling[n][n] = 1.0
        print(f"L={n:>5}: I* per token {float(full) / (n - 1):.4f} nats; ceiling U_w: "
              + " ".join(f"w{w}={u:.3f}" for w, u in sorted(ceiling[n].items())), flush=True)
    scores: dict = defaultdict(lambda: defaultdict(list))
    for r in lab_rows(args.dir):
        if str(r["task"]).split(":")[0] == args.task:
            scores[r["recipe"]][int(r["length"])].append(float(r["score"]))
    models = {}
    for recipe, by_len in sorted(scores.items()):
        models[recipe] = {}
        for n in sorted(by_len):
            u = sum(by_len[n]) / len(by_len[n])
            reach = [w for w, c in sorted(ceiling.get(n, {}).items()) if c >= u]
            models[recipe][n] = {"U": u, "effective_context": reach[0] if reach else None}
            eff = reach[0] if reach else "-"
            print(f"{recipe:>10} L={n:>5}: U {u:.3f}, effective context ≈ {eff} tokens", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ceiling": ceiling, "models": models}, indent=1) + "\n")
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
