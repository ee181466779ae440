"""COMI's soft variant: train a fusion layer on longlab's own samples, compare with COMI-hard (issue #13).

    bench/heavy.sh .venv/bin/python bench/comi_soft.py --ratio 0.875 --train 40 --steps 160 \
        --weights bench/results/compression/comi_fusion_r0.875.safetensors \
        --out bench/results/compression/comi_soft.json

Training data: ``--train`` samples of ``--task`` at ``--length`` tokens generated with seed 1 (the
evaluation uses seed 0, the samples of the equal-memory table). For each, the context is merged by
COMI's two MIG stages at ``--ratio`` (``COMI.merge``: merged embeddings and hidden states), then a
:class:`longlab.compress.comi.Fusion` layer is trained with the model frozen to minimise the answer's
cross-entropy (teacher-forced, answer = " " + gold). Evaluation on the first ``--test`` seed-0 samples:
answer NLL with the untrained (= hard) and the trained layer on the same merged memories, and the
soft variant's accuracy through ``longlab.generate`` (``comi@r:fusion=PATH``), paired with the hard
variant's rows of ``--store`` (the equal-memory table's run) on the same samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="redundant_niah")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=0.875)
    ap.add_argument("--train", type=int, default=40)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--test", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--weights", default="bench/results/compression/comi_fusion_r0.875.safetensors")
    ap.add_argument("--store", default="bench/results/compression/redundant_niah")
    ap.add_argument("--out", default="bench/results/compression/comi_soft.json")
    ap.add_argument("--eval-only", action="store_true",
                    help="load --weights (trained before) and only evaluate; --resume keeps --out's rows")
    ap.add_argument("--resume", action="store_true", help="skip test samples already in --out's rows")
    args = ap.parse_args()

    from longlab import generate, load_model
    from longlab.compress.api import template_head
    from longlab.compress.base import Prompt
    from longlab.compress.comi import COMI, Fusion, answer_loss, load_fusion, save_fusion, train_fusion
    from longlab.compress.scorer import Scorer
    from longlab.eval.stats import paired_difference, score_estimate
    from longlab.eval.store import ResultStore
    from longlab.prompt import encode_prompts
    from longlab.tasks import generate_samples as make_samples
    from longlab.tasks.registry import score_sample

    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    comi = COMI(args.ratio)
    scorer = Scorer(model)
    table = model.get_input_embeddings()

    def example(s):
        (ctx,), (q,) = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix])
        head = template_head(tok, ctx)
        memories, states, _, _ = comi.merge(Prompt(ctx[head:], s.question, q, tok), scorer)
        ans = list(tok(" " + s.answers[0], add_special_tokens=False)["input_ids"])
        with torch.inference_mode():
            lead = table(torch.tensor(ctx[:head], dtype=torch.long))
        return {"lead": lead.clone(), "memories": memories.clone(), "states": states.clone(),
                "tail": torch.tensor(q + ans, dtype=torch.long), "n_answer": torch.tensor(len(ans))}

    previous = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else {}
    if args.eval_only:
        fusion = load_fusion(args.weights, model.config.hidden_size)
        log, prep_s, train_s = previous.get("loss_log", []), previous.get("prep_s"), previous.get("train_s")
    else:
        t0 = time.perf_counter()
        samples = make_samples(args.task, tok, args.length, num_samples=args.train, seed=1)
        train = [example(s) for s in samples]
        prep_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fusion, log = train_fusion(model, train, args.steps, lr=args.lr, seed=0, log_every=10)
        train_s = time.perf_counter() - t0
        print(f"prepared {len(train)} examples in {prep_s:.0f}s, trained {args.steps} steps in "
              f"{train_s:.0f}s; loss every 10 steps: {[round(x, 3) for x in log]}", flush=True)
        Path(args.weights).parent.mkdir(parents=True, exist_ok=True)
        save_fusion(fusion, args.weights, model=args.model, task=args.task, length=args.length,
                    ratio=args.ratio, train_samples=args.train, steps=args.steps, lr=args.lr, seed=1)
    zero = Fusion(fusion.proj.in_features // 2)

    hard_rows = {}
    if (Path(args.store) / "results.sqlite").exists():
        with ResultStore(args.store, readonly=True) as store:
            for r in store.iter_rows():
                if r["recipe"] == f"comi@{args.ratio:g}" and not r["query_aware"]:
                    hard_rows[r["sample_id"]] = r
    rows = list(previous.get("rows", []))
    done = {r["sample_id"] for r in rows}
    for s in make_samples(args.task, tok, args.length, num_samples=args.test, seed=0):
        if s.sample_id in done:
            continue
        e = example(s)
        with torch.no_grad():
            nll_hard, nll_soft = float(answer_loss(model, zero, e)), float(answer_loss(model, fusion, e))
        res = generate(model, tok, s.context, s.question, f"comi@{args.ratio:g}:fusion={args.weights}",
                       answer_prefix=s.answer_prefix,
                       max_new_tokens=min(args.max_new_tokens, s.max_new_tokens))
        hard = hard_rows.get(s.sample_id)
        rows.append({"sample_id": s.sample_id, "nll_hard": nll_hard, "nll_soft": nll_soft,
                     "soft_prediction": res.texts[0], "soft_score": score_sample(s, res.texts[0]),
                     "hard_score": hard["score"] if hard else None,
                     "hard_prediction": hard["prediction"] if hard else None})
        print(rows[-1], flush=True)
        write_json(args.out, {"hardware": hardware(), "args": vars(args), "partial": True, "loss_log": log,
                              "prep_s": prep_s, "train_s": train_s, "rows": rows})
    both = [r for r in rows if r["hard_score"] is not None]
    both = both or [{**r, "hard_score": 0.0} for r in rows[:1]]  # (a smoke run without the store)
    soft, hard = [r["soft_score"] for r in both], [r["hard_score"] for r in both]
    es, eh = score_estimate(soft), score_estimate(hard)
    d = paired_difference(soft, hard)
    dn = paired_difference([r["nll_soft"] for r in rows], [r["nll_hard"] for r in rows])
    summary = {"n": len(both), "soft_accuracy": [es.mean, es.low, es.high],
               "hard_accuracy": [eh.mean, eh.low, eh.high], "soft_minus_hard": [d.mean, d.low, d.high],
               "nll_hard_median": statistics.median(r["nll_hard"] for r in rows),
               "nll_soft_median": statistics.median(r["nll_soft"] for r in rows),
               "nll_soft_minus_hard": [dn.mean, dn.low, dn.high], "prep_s": prep_s, "train_s": train_s,
               "loss_log": log, "params": sum(p.numel() for p in fusion.parameters())}
    print(summary)
    write_json(args.out, {"hardware": hardware(), "args": vars(args), "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
