"""Sparse-prefill wall time on a real model by executor backend, side by side (issue 16, item 5).

    bench/heavy.sh .venv/bin/python bench/sparse_prefill_backends.py --lengths 4096,8192 --repeats 3

For each length, one RULER ``niah_single_1`` sample on SmolLM2-135M: the dense prefill (``full``) and a
sparse-prefill recipe (``--selector``, default ``xattention``) run with each executor ``--backends``
(``grouped``: fused-SDPA calls merged by log-sum-exp; ``flash``: longlab's C++ block-sparse kernel),
interleaved (one of each per repeat, the order rotating), ``prefill_s`` of ``longlab.generate`` with
chunks of ``--chunk-size``. Prints medians and the ratios to ``full`` and between backends, checks that the
backends give the same answer tokens, and writes JSON with the machine header and every timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import hardware, write_json

from longlab import generate, load_model
from longlab.tasks import generate_samples as make_samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--selector", default="xattention")
    p.add_argument("--backends", default="grouped,flash")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default="bench/results/sparse_prefill_backends.json")
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model)
    recipes = ["full"] + [f"{args.selector}:backend={b}" for b in args.backends.split(",")]
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        (sample,) = make_samples("niah_single_1", tokenizer, T, 1, 0)
        times: dict[str, list[float]] = {r: [] for r in recipes}
        answers: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            order = recipes[rep % len(recipes):] + recipes[:rep % len(recipes)]
            for r in order:
                res = generate(model, tokenizer, sample.context, sample.question, r,
                               max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size,
                               answer_prefix=sample.answer_prefix)
                times[r].append(res.prefill_s)
                answers.setdefault(r, list(res.token_ids[0]))
                print(f"T={T} rep {rep} {r}: prefill {res.prefill_s:.2f} s", flush=True)
        med = {r: statistics.median(t) for r, t in times.items()}
        sparse = recipes[1:]
        same = all(answers[r] == answers[sparse[0]] for r in sparse)
        row = {"length": T, "context_tokens": res.context_tokens[0], "prefill_s": times, "median_s": med,
               "speedup_vs_full": {r: med["full"] / med[r] for r in sparse},
               "answers_equal_across_backends": same, "answers": {r: str(a) for r, a in answers.items()}}
        if len(sparse) == 2:
            row["ratio"] = med[sparse[0]] / med[sparse[1]]
        rows.append(row)
        print(f"T={T} ({row['context_tokens']} tokens): " + ", ".join(
            f"{r} {med[r]:.2f} s ({med['full'] / med[r]:.2f}x full)" for r in recipes)
            + (f"; {sparse[0]} / {sparse[1]} = {row['ratio']:.2f}" if "ratio" in row else "")
            + f"; same answer tokens across backends: {same}; {torch.get_num_threads()} threads", flush=True)
    print(f"wrote {write_json(args.out, {'hardware': hardware(), 'args': vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
