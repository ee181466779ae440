"""HiCo token dropping inside the prefill forward vs a plain prefill (issue #13), on real samples.

    bench/heavy.sh .venv/bin/python bench/hico_forward.py --samples 16 --ratios 0.5,0.75 \
        --out bench/results/compression/hico_forward.json

For each sample of ``--task`` at ``--length`` tokens, the whole prompt (context + question, HiCo's
query-aware setting: the question's last token scores, the question is never dropped) is prefilled as
one forward, plainly and with :class:`longlab.compress.hico_forward.HiCoForward` at each ratio, in an
order rotated per sample (interleaved); each prefill is timed (one thread) and followed by greedy
decoding of the answer, scored as ``longlab eval`` scores it. Prints the median per-sample time ratio
(HiCo / plain, 95% bootstrap CI), accuracy (Wilson 95%) and the paired difference against the plain
prefill; writes every measurement to ``--out``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, write_json  # noqa: E402


def _median_ci(xs: list[float], reps: int = 2000) -> tuple[float, float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="redundant_niah")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--stages", default="0.3333333333,0.6666666667", help="layer fractions of the drops")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", default="bench/results/compression/hico_forward.json")
    args = ap.parse_args()

    from longlab import load_model
    from longlab.cache import LonglabCache
    from longlab.compress.hico_forward import HiCoForward
    from longlab.engine.stream import Stream, eos_token_ids
    from longlab.eval.stats import paired_difference, score_estimate
    from longlab.prompt import encode_prompts
    from longlab.tasks import generate_samples
    from longlab.tasks.registry import score_sample

    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    eos = eos_token_ids(model, tok)
    ratios = [float(r) for r in args.ratios.split(",")]
    stages = tuple(float(f) for f in args.stages.split(","))
    names = ["plain"] + [f"hico-forward@{r:g}" for r in ratios]
    samples = generate_samples(args.task, tok, args.length, num_samples=args.samples, seed=0)
    rows: list[dict] = []
    with torch.inference_mode():  # warm-up, untimed
        warm = Stream(model, LonglabCache("full"), 1)
        warm.feed([list(tok(samples[0].context)["input_ids"])[:256]], chunk_size=256, compress="end")
    loads = [hardware()["load_avg_1m"]]
    for i, s in enumerate(samples):
        (ctx,), (q,) = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix])
        ids = ctx + q
        order = names[i % len(names):] + names[: i % len(names)]  # rotated: interleaved repeats
        for name in order:
            stream = Stream(model, LonglabCache("full"), 1)
            stream.pad_id = tok.pad_token_id or 0
            ratio = float(name.split("@")[1]) if name != "plain" else 0.0
            method = None if name == "plain" else HiCoForward(ratio, stages, protect=len(q))
            t0 = time.perf_counter()
            with torch.inference_mode():
                if method is None:
                    logits = stream.feed([ids], chunk_size=len(ids), compress="end")
                else:
                    logits = method.prefill(stream, [ids])
            prefill_s = time.perf_counter() - t0
            kv = stream.cache.nbytes()
            tokens = stream.decode(logits, min(args.max_new_tokens, s.max_new_tokens), eos)[0]
            text = tok.decode(tokens, skip_special_tokens=True).strip()
            rows.append({"sample_id": s.sample_id, "method": name, "prefill_s": prefill_s, "kv_bytes": kv,
                         "tokens": len(ids), "score": score_sample(s, text), "prediction": text,
                         "tokens_per_stage": method.info["tokens_per_stage"] if method else [len(ids)]})
        loads.append(hardware()["load_avg_1m"])
        write_json(args.out, {"hardware": hardware(), "load_avg_1m_per_sample": loads, "args": vars(args),
                              "partial": True, "rows": rows})  # a killed run keeps what it measured
        print(f"sample {i}: " + ", ".join(f"{r['method']} {r['prefill_s']:.2f}s {r['score']:.0f}"
                                          for r in rows[-len(names):]), flush=True)

    by = {n: {r["sample_id"]: r for r in rows if r["method"] == n} for n in names}
    ids_ = sorted(by["plain"])
    summary = {}
    for n in names:
        sc = [by[n][i]["score"] for i in ids_]
        e = score_estimate(sc)
        entry = {"accuracy": [e.mean, e.low, e.high],
                 "kv_fraction": statistics.fmean(by[n][i]["kv_bytes"] / by["plain"][i]["kv_bytes"]
                                                 for i in ids_)}
        if n != "plain":
            ratio = [by[n][i]["prefill_s"] / by["plain"][i]["prefill_s"] for i in ids_]
            entry["time_ratio_median_ci"] = list(_median_ci(ratio))
            d = paired_difference(sc, [by["plain"][i]["score"] for i in ids_])
            entry["minus_plain"] = [d.mean, d.low, d.high]
        entry["prefill_s_median"] = statistics.median(by[n][i]["prefill_s"] for i in ids_)
        summary[n] = entry
        print(n, entry)
    write_json(args.out, {"hardware": hardware(), "load_avg_1m_per_sample": loads, "args": vars(args),
                          "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
