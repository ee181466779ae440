"""PCFG to 16x the training length with the string oracle (``oracle=string``): evaluate the trained PCFG
models at long lengths, then tabulate ``exp(−excess NLL per token)``.

    python bench/lab_pcfg_long.py run --root runs/lab15 --tag n8a002 --seeds 0 1 2 --lengths 16 32 64 128 256
    python bench/lab_pcfg_long.py reference --out bench/results/lab_results/round4/pcfg_long_reference.json
    python bench/lab_pcfg_long.py report runs/lab15/results \\
        --reference bench/results/lab_results/round4/pcfg_long_reference.json \\
        --md bench/results/lab_results/round4/pcfg_long.md

``run``: for each mixer and training seed, :func:`longlab.lab.evaluate.evaluate` (what ``longlab lab eval
CKPT --task SPEC --lengths ... --samples 24 --batch 8 --out ROOT/results`` runs) on the variant
``SPEC = pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string`` of the trained task, in
one process so that the string oracle (cached per grammar and string) is computed once for all mixers. The
test strings are the evaluation's, the same as the per-prefix rows' at 16/32/64 (sampling does not depend
on ``max_length``).

``reference``: the unigram and bigram predictors of ``bench/lab_pcfg_baselines.py`` (fitted on the per-prefix
oracle at 16 tokens, 256 strings, generator seed 1), per task seed, scored with the string oracle on the
evaluation's test strings (eval seed 0, indices 0..samples−1) at every length; per-string ``e`` to ``--out``.

``report``: per mixer and length, the excess NLL per scored token ``e`` (the rows' ``excess_nll``) is
aggregated like ``longlab lab plot --table`` aggregates scores (:func:`longlab.lab.plot.cell_estimate`: the
hull of the t-interval over the per-seed means and the test-string bootstrap) and shown as ``exp(−mean e)``
with the interval mapped through ``exp(−·)``. Since ``E[e] = E[mean_t KL]`` (chain rule), ``exp(−mean e)``
estimates ``exp(−mean KL)``, while the prefix rows average ``exp(−KL)`` per string (lower by Jensen; both
columns are printed at the lengths where the prefix rows exist: mean KL and mean e on the same strings).
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

from longlab.lab.evaluate import evaluate
from longlab.lab.plot import cell_estimate, lab_rows

MIXERS = ["softmax", "ssmax", "asentmax", "lssa", "lssar", "race", "l2a", "lact", "ultramem", "linear",
          "mamba"]
PREFIX = "pcfg:max_length=64,nonterminals=8,terminals=32,alpha=0.02"
SPEC = "pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string"


def cell(by_seed: dict) -> tuple[float, float, float, str]:
    """``(mean e, low, high, what)``: :func:`longlab.lab.plot.cell_estimate` (t over seed means, bootstrap
    over the seed-averaged per-string values; one seed: the bootstrap) on the excess scale, unclipped
    (``e`` lives on [−∞, ∞))."""
    return cell_estimate(by_seed, clip=False)


def run(args: argparse.Namespace) -> None:
    for seed in args.seeds:
        for m in args.mixers:
            t0 = time.time()
            ckpt = f"{args.root}/ckpt/pcfg/{args.tag}/{m}/seed{seed}"
            evaluate(ckpt, args.lengths, out=f"{args.root}/results", samples=args.samples, batch=8, task=SPEC)
            print(f"{m} seed {seed}: {time.time() - t0:.1f} s", flush=True)


def reference(args: argparse.Namespace) -> None:
    import json
    import os

    import torch
    from lab_pcfg_baselines import fit

    from longlab.lab.evaluate import eval_generator
    from longlab.lab.tasks import task_config

    out: dict = {"spec": SPEC, "fit": PREFIX, "fit_len": 16, "fit_strings": 256, "samples": args.samples,
                 "load_start": os.getloadavg()[0], "seeds": {}}
    t0 = time.time()
    for seed in args.seeds:
        uni, big = fit(task_config(PREFIX, seed), 16, 256)
        tk = task_config(SPEC, seed)
        per: dict = {}
        for n in args.lengths:
            parts = [tk.sample(1, n, eval_generator(0, n, i)) for i in range(args.samples)]
            per[str(n)] = {
                "unigram": [float(tk.excess_nll(torch.log(uni).expand(1, n, -1), p)[0]) for p in parts],
                "bigram": [float(tk.excess_nll(torch.log(big)[p.tokens], p)[0]) for p in parts],
            }
            print(f"seed {seed} length {n}: {time.time() - t0:.0f} s", flush=True)
        out["seeds"][str(seed)] = per
    out["load_end"] = os.getloadavg()[0]
    out["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def report(args: argparse.Namespace) -> None:
    rows = lab_rows(args.results)
    e: dict = defaultdict(lambda: defaultdict(dict))  # (recipe, length) -> seed -> sample -> value
    kl: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        x = r.get("extra") or {}
        key = (str(r["recipe"]), int(r["length"]))
        if r["task"] == SPEC and "excess_nll" in x:
            e[key][int(r["seed"])][str(r["sample_id"])] = float(x["excess_nll"])
        elif r["task"] == PREFIX and "kl" in x:
            kl[key][int(r["seed"])][str(r["sample_id"])] = float(x["kl"])
    if args.reference:
        import json

        ref = json.load(open(args.reference))
        for seed, per in ref["seeds"].items():
            for n, cols in per.items():
                for name, vals in cols.items():
                    e[f"({name})", int(n)][int(seed)] = {str(i): v for i, v in enumerate(vals)}
    lengths = sorted({n for _, n in e})
    order = [*MIXERS, "(unigram)", "(bigram)"]  # recipes by mixer name (mamba's carries its config)
    names = {m for m, _ in e if m.split(":")[0] in order}
    recipes = sorted(names, key=lambda m: order.index(m.split(":")[0]))
    out = ["| mixer | " + " | ".join(f"{n} ({n // 16}×)" for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for m in recipes:
        cells = []
        for n in lengths:
            if (m, n) not in e:
                cells.append("–")
                continue
            mean, lo, hi, what = cell(e[m, n])  # the score's interval: exp(−·), clipped at 1 (KL ≥ 0)
            cells.append(f"{math.exp(-mean):.3f} [{math.exp(-hi):.3f}, {min(1.0, math.exp(-lo)):.3f}] {what}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "Same strings, per-prefix vs string oracle (mean over seeds and strings, nats per token):",
            "", "| mixer | length | mean KL (prefix) | mean e (string) | e − KL ± 2 se | per seed |",
            "|---|---|---|---|---|---|"]
    for m in recipes:
        for n in lengths:
            if (m, n) not in kl or (m, n) not in e:
                continue
            diffs = []
            a_all: list[float] = []
            b_all: list[float] = []
            for s in sorted(set(kl[m, n]) & set(e[m, n])):
                ids = sorted(set(kl[m, n][s]) & set(e[m, n][s]))
                a = [kl[m, n][s][i] for i in ids]
                b = [e[m, n][s][i] for i in ids]
                a_all += a
                b_all += b
                diffs.append(sum(b) / len(b) - sum(a) / len(a))
            if diffs:
                ma, mb = sum(a_all) / len(a_all), sum(b_all) / len(b_all)
                d = [y - x for x, y in zip(a_all, b_all)]
                se = math.sqrt(sum((v - (mb - ma)) ** 2 for v in d) / (len(d) - 1) / len(d))
                per = " / ".join(f"{v:+.4f}" for v in diffs)
                out.append(f"| {m} | {n} | {ma:.4f} | {mb:.4f} | {mb - ma:+.4f} ± {2 * se:.4f} | {per} |")
    if ("(bigram)", lengths[0]) in e:
        from longlab.eval.stats import paired_difference

        out += ["", "Seed 0, mixer − bigram in exp(−e) per string (paired bootstrap over the test strings):",
                "", "| mixer (seed 0) | " + " | ".join(str(n) for n in lengths) + " |",
                "|---|" + "---|" * len(lengths)]
        for m in recipes:
            if m.startswith("("):
                continue
            cells = []
            for n in lengths:
                mine, ref0 = e.get((m, n), {}).get(0, {}), e["(bigram)", n].get(0, {})
                ids = sorted(set(mine) & set(ref0))
                if not ids:
                    cells.append("–")
                    continue
                d = paired_difference([math.exp(-mine[i]) for i in ids], [math.exp(-ref0[i]) for i in ids])
                cells.append(f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default="runs/lab15")
    r.add_argument("--tag", default="n8a002")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--mixers", nargs="+", default=MIXERS)
    r.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    r.add_argument("--samples", type=int, default=24)
    f = sub.add_parser("reference")
    f.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    f.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    f.add_argument("--samples", type=int, default=24)
    f.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("results")
    p.add_argument("--reference", default=None)
    p.add_argument("--md", default=None)
    args = ap.parse_args()
    {"run": run, "reference": reference, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
