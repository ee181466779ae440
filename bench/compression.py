"""Context compression (issue #13): citation scores from a store, InftyThink's speed, HiCo inside the forward.
(COMI's soft variant: ``longlab train comi``, then ``longlab eval --config
bench/configs/compression-comi-soft.toml``.)

Subcommands (``python bench/compression.py SUB --help`` for each one's options):

- ``cite``: Citation precision / recall / F1 and answer correctness per recipe on ``cite_qa``, from a
  results store.
- ``inftythink-speed``: InftyThink's prompt prefilled once vs every iteration (timing); its accuracy sweep
  is ``longlab eval --config bench/configs/compression-inftythink.toml``.
- ``hico-forward``: HiCo token dropping inside the prefill forward vs a plain prefill (issue #13), on real
  samples.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

import torch
from common import hardware, interleaved, run_subcommand, timed, write_json

# ---- cite (was bench/compression.py cite) ----------------------------------------

DOC_CITE = """
Citation precision / recall / F1 and answer correctness per recipe on ``cite_qa``, from a results store.

Reads the rows ``longlab eval`` wrote (``DIR/results.sqlite``) and prints the page's tables
(:func:`longlab.eval.pages.compression.cite_table`: per recipe the means with 95% intervals, the paired
difference to ``--base``), then ``--examples`` predictions per recipe and Guidance's own counters
(forced sentences, lookaheads).

    .venv/bin/python bench/compression.py cite bench/results/compression/cite_qa_qwen
""".lstrip("\n")

def cite_main(argv: list[str] | None = None) -> None:
    from longlab.eval.pages.compression import cite_table
    from longlab.eval.store import ResultStore

    p = argparse.ArgumentParser(description=DOC_CITE.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--base", default="full")
    p.add_argument("--examples", type=int, default=0, help="print this many predictions per recipe")
    args = p.parse_args(argv)
    if not any(os.path.exists(os.path.join(args.dir, f)) for f in ("results.sqlite", "results.sqlite.gz")):
        raise SystemExit(f"no results.sqlite in {args.dir}")
    print(cite_table(args.dir, base=args.base))  # the page's tables (longlab report --docs)
    rows: dict[str, dict[str, dict]] = {}
    with ResultStore(args.dir, readonly=True) as store:
        for row in store.iter_rows():
            rows.setdefault(row["recipe"], {})[row["sample_id"]] = row
    ids = sorted(set.intersection(*(set(r) for r in rows.values())))
    for rc in rows:
        for i in ids[: args.examples]:
            print(f"{rc} {i}: {rows[rc][i]['prediction']!r} (answers {rows[rc][i]['answers']})")
    for rc in rows:
        ctx = [rows[rc][i]["extra"].get("context", {}) for i in ids]
        keys = sorted({k for c in ctx for k, v in c.items() if isinstance(v, (int, float))})
        if keys and rc != args.base:
            print(f"{rc} counters (sum over samples):",
                  {k: round(sum(c.get(k, 0) for c in ctx), 2) for k in keys if k not in ("context_s",)})


def _run_cite() -> object:
    cite_main(sys.argv[1:])


# ---- inftythink-speed (was bench/compression.py inftythink --speed) ----------------------------------

DOC_INFTYTHINK = """
InftyThink's prompt prefilled once against re-prefilled every iteration: timing on the worked chain task.

The accuracy sweep (InftyThink vs one long context: accuracy, peak KV, reasoning length) is a
``longlab eval`` run, ``bench/configs/compression-inftythink.toml`` (task ``lookup_chain_reason``); its
tables and plot are generated from the store into ``docs/results/compression.md``
(``longlab report --docs --page results/compression``). This subcommand only times: on the ``--rows``
``LEN:INDEX`` samples of ``lookup_chain_reason``, the current InftyThink (prompt prefilled once) against
the code before it (the prompt re-prefilled every iteration, ``_refill_class``), interleaved by
``bench/common.py``'s runner, greedy, checking that both give the same tokens (``--out``: the timings).

    bench/heavy.sh timeout 700 .venv/bin/python bench/compression.py inftythink-speed --model qwen2.5-0.5b \\
        --rows 128:0,192:0 --repeats 2 --warmup 0 --out bench/results/compression/inftythink_speed.json
""".lstrip("\n")

def speed(args: argparse.Namespace) -> None:
    """The prompt prefilled once (the current code) vs re-prefilled every iteration (the code before,
    :class:`_Refill`), side by side on the same rows, interleaved (A B B A per repeat), greedy; checks
    that both give the same tokens. Rows to ``--out`` (JSON), medians printed."""
    import statistics

    import torch

    import longlab
    from longlab.tasks import generate_samples as make_samples

    torch.set_num_threads(1)
    model, tokenizer = longlab.load_model(args.model)
    spec = args.recipe
    rows, out = [], Path(args.out)
    print(f"load: {os.getloadavg()}", flush=True)
    if args.warmup:  # one untimed row first: the first generate of a process pays one-off costs
        longlab.generate(model, tokenizer, "Let v0 = 7. Let v1 = v0 + 2.", "What is v1?", "full",
                         max_new_tokens=8)
    for item in args.rows.split(","):
        length, index = (int(x) for x in item.split(":"))
        sample = make_samples("lookup_chain", tokenizer, length, index + 1, args.seed, reason=True)[index]
        tokens: dict[str, list[int]] = {}

        def run(path: str, sample=sample, tokens=tokens):  # noqa: ANN202
            recipe = _recipe(spec)
            if path == "refill":
                recipe.context = _Refill(**{f: getattr(recipe.context, f) for f in _FIELDS})
            res = longlab.generate(model, tokenizer, sample.context, sample.question, recipe,
                                   max_new_tokens=sample.max_new_tokens,
                                   answer_prefix=sample.answer_prefix, compress="end")
            tokens.setdefault(path, res.token_ids[0])
            assert res.token_ids[0] == tokens[path], "greedy decoding is not deterministic"
            rec = res.context[0]
            print(f"{sample.sample_id} {path:6s} it={rec['iterations']} reason={rec['reasoning_tokens']} "
                  f"summ={rec['summary_tokens_used']} load={os.getloadavg()[0]:.2f}", flush=True)
            return res

        # A B, B A, ... per repeat (common.interleaved rotates the order each round)
        timing = interleaved({"once": lambda: run("once"), "refill": lambda: run("refill")},
                             repeats=args.repeats, warmup=0)
        times = {path: timing["variants"][path]["wall_s"] for path in ("once", "refill")}
        res = timing["results"]["refill" if args.repeats % 2 else "once"]  # the last call, as before
        rec = res.context[0]
        once, refill = statistics.median(times["once"]), statistics.median(times["refill"])
        row = {"model": args.model, "recipe": spec, "sample_id": sample.sample_id, "length": length,
               "iterations": rec["iterations"], "prompt_tokens": res.context_tokens[0]
               + _question_tokens(tokenizer, sample), "same_tokens": tokens["once"] == tokens["refill"],
               "once_s": times["once"], "refill_s": times["refill"], "median_once_s": once,
               "median_refill_s": refill, "speedup": refill / once, "load": os.getloadavg()[0]}
        rows.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))
        print(f"{sample.sample_id}: median once {once:.1f}s, refill {refill:.1f}s, {refill / once:.2f}x, "
              f"same tokens {row['same_tokens']}", flush=True)
    print(f"load: {os.getloadavg()}", flush=True)


def _refill_class():
    """InftyThink as it was before the prompt was prefilled once (commit 90e8360): every iteration
    ``j > 0`` prefills ``prompt + history`` in a fresh cache. Kept here only to time the change."""
    from longlab.compress.inftythink import InftyThink

    class Refill(InftyThink):
        def compress(self, prompt, scorer=None):
            out = super().compress(prompt, scorer)
            out.state = {"question_ids": list(prompt.question_ids)}
            return out

        def _iteration_start(self, prompt, history, logits, compressed):
            if not history:  # the first iteration decodes in the prefilled stream itself
                return prompt, logits
            cache = type(prompt.cache)(prompt.cache.recipe)  # a fresh stream, the prompt fed again
            fresh = type(prompt)(prompt.model, cache, prompt.batch_size)
            fresh.pad_id = prompt.pad_id
            ids = compressed.ids + compressed.state["question_ids"] + list(history)
            return fresh, fresh.feed([ids], 1024, compress="chunk")

    return Refill


def _Refill(**fields):  # noqa: N802  (builds the class lazily: longlab is imported inside the commands)
    return _refill_class()(**fields)


_FIELDS = ("compression_ratio", "segment", "iterations", "summarise", "instruction", "ask", "summary_tokens",
           "history")


def _recipe(spec: str):
    """``RECIPE`` or ``RECIPE|HISTORY`` (an InftyThink history template, ``\\n`` for a newline)."""
    from longlab.recipe import parse_recipe

    name, bar, history = spec.partition("|")
    recipe = parse_recipe(name)
    if bar:
        recipe.context.history = history.replace("\\n", "\n")
        recipe.context.validate()
    return recipe


def _question_tokens(tokenizer, sample) -> int:
    from longlab.prompt import encode_prompts

    (_,), (q,) = encode_prompts(tokenizer, [sample.context], [sample.question], [sample.answer_prefix])
    return len(q)


def inftythink_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=DOC_INFTYTHINK.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="inftythink:summarise=ask,segment=48,iterations=4,summary_tokens=32",
                   help="the InftyThink recipe timed (RECIPE or RECIPE|HISTORY, a history template)")
    p.add_argument("--rows", metavar="LEN:INDEX,...", required=True,
                   help="the lookup_chain_reason samples timed (length:index)")
    p.add_argument("--out", required=True, help="the timings (JSON)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per path")
    p.add_argument("--warmup", type=int, default=1, help="1 = one untimed generate first "
                   "(0 = none, as in the first timing run)")
    args = p.parse_args(argv)
    if not args.recipe.startswith("inftythink"):
        p.error(f"--recipe must be an InftyThink recipe, got {args.recipe!r}")
    speed(args)


def _run_inftythink() -> object:
    inftythink_main(sys.argv[1:])


# ---- hico-forward (was bench/compression.py hico-forward) ----------------------------------------

DOC_HICO_FORWARD = """
HiCo token dropping inside the prefill forward vs a plain prefill (issue #13), on real samples.

    bench/heavy.sh .venv/bin/python bench/compression.py hico-forward --samples 16 --ratios 0.5,0.75 \
        --out bench/results/compression/hico_forward.json

For each sample of ``--task`` at ``--length`` tokens, the whole prompt (context + question, HiCo's
query-aware setting: the question's last token scores, the question is never dropped) is prefilled as
one forward, plainly and with :class:`longlab.compress.hico_forward.HiCoForward` at each ratio, in an
order rotated per sample (interleaved); each prefill is timed (one thread) and followed by greedy
decoding of the answer, scored as ``longlab eval`` scores it. Prints the median per-sample time ratio
(HiCo / plain, 95% bootstrap CI), accuracy (Wilson 95%) and the paired difference against the plain
prefill; writes every measurement to ``--out``.
""".lstrip("\n")

def _median_ci(xs: list[float], reps: int = 2000) -> tuple[float, float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def hico_forward_main() -> None:
    ap = argparse.ArgumentParser(description=DOC_HICO_FORWARD.splitlines()[0])
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
            def prefill(stream=stream, method=method, ids=ids):  # noqa: ANN202
                with torch.inference_mode():
                    if method is None:
                        return stream.feed([ids], chunk_size=len(ids), compress="end")
                    return method.prefill(stream, [ids])

            prefill_s, _cpu, logits = timed(prefill)
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


def _run_hico_forward() -> object:
    hico_forward_main()


SUBCOMMANDS = {
    "cite": _run_cite,
    "inftythink-speed": _run_inftythink,
    "hico-forward": _run_hico_forward,
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: ``python bench/compression.py SUB [ARGS...]`` (its own ``--help``)."""
    return run_subcommand(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
