"""How much of a PCFG task's next token a parse-free predictor gets: the unigram and the bigram predictors
fitted on the exact oracle at the training length, scored like ``longlab lab eval`` on the same test strings.

    python bench/lab_pcfg_baselines.py --task pcfg:max_length=64,nonterminals=8,terminals=32,alpha=0.02 \\
        --train-len 16 --lengths 16 32 64 --samples 24 --fit 256 \\
        --out bench/results/lab_results/round4/pcfg_baselines.json

``unigram``: ``q(a) = mean over fitting strings and positions of p(x_{t+1} = a | x_{≤t})`` (the best
context-free predictor under the KL score); ``bigram``: ``q(a | x_t = b)`` = the same mean over the
positions whose current token is b (the best predictor that sees only the current token), with add-ε
smoothing towards the unigram. Fitting strings: ``--fit`` fresh strings of the training length (task seed 0,
generator seed 1), i.e. what a context-free model trained there could at best learn. Test strings: the
evaluation's (``longlab.lab.evaluate.eval_generator``, eval seed 0, indices 0..samples−1), so the scores are
paired with the mixers' rows. Score per string ``exp(−mean_t KL(p_t ‖ q_t))`` (the task's score); interval:
bootstrap over the test strings (:func:`longlab.eval.stats.score_estimate`). No training; the oracle is
O(L⁴·N³) per string (about 1 s per string at 64 tokens with N = 8 on a loaded core).

``--compare DIR --from JSON``: no oracle; read the per-string reference scores from a written JSON and print,
per mixer and length, the mixer − bigram difference over the same test strings (training seed 0, whose task
seed drew this grammar) with the paired bootstrap interval (:func:`longlab.eval.stats.paired_difference`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from longlab.eval.stats import paired_difference, score_estimate
from longlab.lab.evaluate import eval_generator
from longlab.lab.plot import lab_rows
from longlab.lab.tasks import task_config


def fit(task, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ``(unigram [T], bigram [T, T])`` (row b: the next-token distribution after token b)."""
    b = task.sample(n, length, torch.Generator().manual_seed(1))
    p = b.probs[:, :-1].double().reshape(-1, task.terminals)  # [n·(L−1), T]
    x = b.tokens[:, :-1].reshape(-1)
    uni = p.mean(0)
    big = torch.zeros(task.terminals, task.terminals, dtype=torch.float64)
    cnt = torch.zeros(task.terminals, dtype=torch.float64)
    big.index_add_(0, x, p)
    cnt.index_add_(0, x, torch.ones_like(x, dtype=torch.float64))
    eps = 1e-3
    return uni, (big + eps * uni) / (cnt[:, None] + eps)


def compare(results: str, src: str, task: str) -> None:
    ref = json.load(open(src))
    rows = [r for r in lab_rows(results) if r["task"] == task and int(r["seed"]) == 0]
    by: dict = {}
    for r in rows:
        cell = by.setdefault(r["recipe"], {}).setdefault(int(r["length"]), {})
        cell[int(r["sample_id"])] = float(r["score"])
    print("| mixer (seed 0) | " + " | ".join(f"{n}: mixer − bigram" for n in ref["lengths"]) + " |")
    print("|---|" + "---|" * len(ref["lengths"]))
    for recipe in sorted(by):
        cells = []
        for n, res in ref["lengths"].items():
            mine = by[recipe].get(int(n), {})
            ids = [i for i in range(len(res["bigram"]["scores"])) if i in mine]
            if not ids:
                cells.append("–")
                continue
            d = paired_difference([mine[i] for i in ids], [res["bigram"]["scores"][i] for i in ids])
            cells.append(f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]")
        print(f"| {recipe} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True)
    ap.add_argument("--train-len", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--fit", type=int, default=256)
    ap.add_argument("--out")
    ap.add_argument("--compare", help="results directory: print mixer − bigram (seed 0) from --from")
    ap.add_argument("--from", dest="src", help="a JSON written by --out (with --compare)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.src, args.task)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    task = task_config(args.task, 0)
    t0 = time.perf_counter()
    uni, big = fit(task, args.train_len, args.fit)
    out: dict = {"task": args.task, "train_len": args.train_len, "fit_strings": args.fit, "lengths": {},
                 "load_start": os.getloadavg()[0]}
    print(f"# fit {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    for length in args.lengths:
        parts = [task.sample(1, length, eval_generator(0, length, i)) for i in range(args.samples)]
        res: dict = {}
        ent = []
        for name in ("unigram", "bigram"):
            scores = []
            for part in parts:
                q = uni.expand(length, -1) if name == "unigram" else big[part.tokens[0]]  # [L, T]
                logits = torch.log(q.clamp_min(1e-30)).float()[None]
                scores.append(float(task.score(logits, part)[0]))
            e = score_estimate(scores)
            res[name] = {"score": e.mean, "low": e.low, "high": e.high, "n": e.n, "scores": scores,
                         "kl": float(-torch.log(torch.tensor(scores)).mean())}
        for part in parts:
            p = part.probs[0, :-1].double()
            ent.append(float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean()))
        res["oracle_entropy"] = sum(ent) / len(ent)
        out["lengths"][str(length)] = res
        u, b = res["unigram"], res["bigram"]
        print(f"length {length:>4}: unigram {u['score']:.3f} [{u['low']:.3f}, {u['high']:.3f}]  bigram "
              f"{b['score']:.3f} [{b['low']:.3f}, {b['high']:.3f}]  H "
              f"{res['oracle_entropy']:.3f} nats ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["load_end"] = os.getloadavg()[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
