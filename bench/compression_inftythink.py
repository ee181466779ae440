"""InftyThink vs one long context on the worked chain task: accuracy, peak KV and reasoning length.

Each sample of ``lookup_chain`` with ``reason=True`` (a chain of ``Let v_{i+1} = v_i +- d`` lines, worked out
step by step, scored by the number the answer ends on) is answered by every recipe with
:func:`longlab.generate`, greedy:

- ``full``: one long context (prompt + all the reasoning in one cache, up to the sample's 1,024 new tokens);
- ``inftythink:summarise=ask,...``: bounded segments, the model asked to summarise each cut segment
  (:mod:`longlab.compress.inftythink`, the training-free adaptation).

Per row: score, generated tokens (reasoning, plus asked summaries), peak KV bytes (``full``: the cache
after the last token; InftyThink: the largest cache of any iteration, its own counter), the prompt's KV
bytes, iterations and why it stopped. Rows go to ``--out`` (JSON), written after each row; a rerun skips
finished rows (resumable under ``bench/heavy.sh`` time limits). ``--table`` prints the tables (Wilson 95%
intervals, paired bootstrap differences vs ``full`` on the same samples) from the store.

    bench/heavy.sh .venv/bin/python bench/compression_inftythink.py --lengths 96,160,256 --samples 8 \\
        --recipes 'full;inftythink:summarise=ask,segment=64,iterations=12' --out DIR/inftythink.json
    .venv/bin/python bench/compression_inftythink.py --out DIR/inftythink.json --table

``--speed LEN:INDEX,...`` times the current InftyThink (prompt prefilled once) against the code before it
(the prompt re-prefilled every iteration, ``_refill_class``) on those rows, interleaved, and checks that
both give the same tokens (``--out``: the timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def split_recipes(text: str) -> list[str]:
    """Recipes separated by ';' (InftyThink's parameters use commas)."""
    return [r.strip() for r in text.split(";") if r.strip()]


def run(args: argparse.Namespace) -> None:
    import torch

    import longlab
    from longlab.tasks import generate_samples as make_samples
    from longlab.tasks import score_sample

    torch.set_num_threads(1)
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["sample_id"], r["recipe"]) for r in rows}
    model, tokenizer = longlab.load_model(args.model)
    t_start = time.time()
    print(f"load: {os.getloadavg()}", flush=True)
    per_length = [make_samples("lookup_chain", tokenizer, n, args.samples, args.seed, reason=True)
                  for n in args.lengths]
    for index in range(args.samples):  # sample-major: a time limit leaves every length with about the same n
        for length, samples in zip(args.lengths, per_length):
            sample = samples[index]
            for recipe in args.recipes:
                if (sample.sample_id, recipe) in done:
                    continue
                if args.seconds and time.time() - t_start > args.seconds:
                    print("time budget reached; rerun to resume", flush=True)
                    return
                t0 = time.perf_counter()
                res = longlab.generate(model, tokenizer, sample.context, sample.question, _recipe(recipe),
                                       max_new_tokens=sample.max_new_tokens,
                                       answer_prefix=sample.answer_prefix, compress="end")
                seconds = time.perf_counter() - t0
                rec = (res.context or [{}])[0]
                prompt_tokens = res.context_tokens[0] + _question_tokens(tokenizer, sample)
                if "iterations" in rec:  # InftyThink's own counters
                    peak = int(rec["peak_kv_bytes"])
                    reasoning = int(rec["reasoning_tokens"])
                    summary = int(rec.get("summary_tokens_used", 0))
                else:
                    peak = int(res.cache.nbytes())  # the dense cache after the last step: its largest
                    reasoning, summary = len(res.token_ids[0]), 0
                row = {
                    "model": args.model, "recipe": recipe, "length": length, "sample_id": sample.sample_id,
                    "steps": sample.metadata["steps"], "answer": sample.answers[0], "prediction": res.text,
                    "score": score_sample(sample, res.text), "reasoning_tokens": reasoning,
                    "summary_tokens": summary, "final_tokens": len(res.token_ids[0]),
                    "prompt_tokens": prompt_tokens, "peak_kv_bytes": peak,
                    "iterations": rec.get("iterations", 1), "stop": rec.get("stop", ""),
                    "summaries": rec.get("summaries", []), "seconds": seconds, "load": os.getloadavg()[0],
                }
                rows.append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(rows, indent=1))
                print(f"{sample.sample_id} {recipe[:40]:40s} score={row['score']:.0f} it={row['iterations']} "
                      f"reason={reasoning} summ={summary} peak={peak / 2**20:.2f}MiB {seconds:.1f}s "
                      f"stop={row['stop']}", flush=True)
                if args.probe:
                    print("  PRED:", res.text[-300:].replace("\n", " | "))
                    for s in row["summaries"]:
                        print("  SUMM:", s.replace("\n", " | "))
    print(f"load: {os.getloadavg()}", flush=True)


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
    (spec,) = [r for r in args.recipes if r.startswith("inftythink")][:1]
    rows, out = [], Path(args.out)
    print(f"load: {os.getloadavg()}", flush=True)
    if args.warmup:  # one untimed row first: the first generate of a process pays one-off costs
        longlab.generate(model, tokenizer, "Let v0 = 7. Let v1 = v0 + 2.", "What is v1?", "full",
                         max_new_tokens=8)
    for item in args.speed.split(","):
        length, index = (int(x) for x in item.split(":"))
        sample = make_samples("lookup_chain", tokenizer, length, index + 1, args.seed, reason=True)[index]
        times: dict[str, list[float]] = {"once": [], "refill": []}
        tokens: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            for path in ("once", "refill") if rep % 2 == 0 else ("refill", "once"):
                recipe = _recipe(spec)
                if path == "refill":
                    recipe.context = _Refill(**{f: getattr(recipe.context, f) for f in _FIELDS})
                t0 = time.perf_counter()
                res = longlab.generate(model, tokenizer, sample.context, sample.question, recipe,
                                       max_new_tokens=sample.max_new_tokens,
                                       answer_prefix=sample.answer_prefix, compress="end")
                times[path].append(time.perf_counter() - t0)
                tokens.setdefault(path, res.token_ids[0])
                assert res.token_ids[0] == tokens[path], "greedy decoding is not deterministic"
                rec = res.context[0]
                print(f"{sample.sample_id} {path:6s} {times[path][-1]:.1f}s it={rec['iterations']} "
                      f"reason={rec['reasoning_tokens']} summ={rec['summary_tokens_used']} "
                      f"load={os.getloadavg()[0]:.2f}", flush=True)
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


def table(args: argparse.Namespace) -> None:
    from longlab.eval.stats import paired_difference, score_estimate

    rows = json.loads(Path(args.out).read_text())
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    by = {(r["recipe"], r["sample_id"]): r for r in rows}
    base = "full"
    print("| chain (steps) | recipe | n | accuracy [95% CI] | - full (paired) [95% CI] | tokens generated "
          "(median, max) | peak KV MiB (median, max) | peak KV tokens beyond the prompt (median, max) "
          "| iterations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        ids = sorted({r["sample_id"] for r in rows if r["length"] == length})
        ids = [i for i in ids if all((rc, i) in by for rc in recipes)]  # the same samples in every cell
        if not ids:
            continue
        steps = sorted({by[(recipes[0], i)]["steps"] for i in ids})
        for recipe in recipes:
            cell = [by[(recipe, i)] for i in ids]
            est = score_estimate([c["score"] for c in cell])
            if recipe != base and all((base, i) in by for i in ids):
                d = paired_difference([c["score"] for c in cell], [by[(base, i)]["score"] for i in ids],
                                      resamples=2000)
                diff = f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{' *' if d.significant else ''}"
            else:
                diff = "—"
            reason = sorted(c["reasoning_tokens"] + c["summary_tokens"] for c in cell)
            peak = sorted(c["peak_kv_bytes"] / 2**20 for c in cell)
            # bytes per cached token from the same sample's full row (its cache: prompt + answer - 1 tokens)
            per = {i: by[(base, i)]["peak_kv_bytes"] / (by[(base, i)]["prompt_tokens"]
                                                         + by[(base, i)]["final_tokens"] - 1) for i in ids}
            extra = sorted(c["peak_kv_bytes"] / per[i] - c["prompt_tokens"] for c, i in zip(cell, ids))
            its = sorted(c["iterations"] for c in cell)
            med = lambda v: v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2  # noqa: E731
            short = "full (one long context)" if recipe == base else f"`{recipe}`"
            span = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
            print(f"| {length} tokens ({span}) "
                  f"| {short} | {len(cell)} | {est.mean:.2f} [{est.low:.2f}, {est.high:.2f}] | {diff} | "
                  f"{med(reason):.0f}, {reason[-1]} | {med(peak):.2f}, {peak[-1]:.2f} | "
                  f"{med(extra):.0f}, {extra[-1]:.0f} | {med(its):.0f} ({its[0]}-{its[-1]}) |")
    pairs = [(r["score"], by[(base, r["sample_id"])]["score"]) for r in rows
             if r["recipe"] != base and (base, r["sample_id"]) in by]
    if pairs:
        d = paired_difference([a for a, _ in pairs], [b for _, b in pairs], resamples=2000)
        mine, theirs = sum(a for a, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs)
        print(f"\nall lengths pooled: n = {len(pairs)} pairs, accuracy {mine:.2f} vs full {theirs:.2f}; "
              f"difference {d.mean:+.2f} [{d.low:+.2f}, "
              f"{d.high:+.2f}]{' (significant)' if d.significant else ' (not significant)'}")
    stops: dict[str, dict[str, int]] = {}
    for r in rows:
        stops.setdefault(r["recipe"], {}).setdefault(r["stop"] or "plain", 0)
        stops[r["recipe"]][r["stop"] or "plain"] += 1
    print("\nstops:", json.dumps(stops))
    loads = [r["load"] for r in rows]
    print(f"load during the rows: {min(loads):.1f}-{max(loads):.1f}")


def plot(args: argparse.Namespace) -> None:
    """Peak KV (MiB) against the tokens generated (reasoning + asked summaries), one point per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(args.out).read_text())
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    markers = {n: m for n, m in zip(sorted({r["length"] for r in rows}), "os^Dv")}
    for colour, recipe in zip(colours, dict.fromkeys(r["recipe"] for r in rows)):
        label = "full (one long context)" if recipe == "full" else recipe.split(":")[0] + " (ask, segment 48)"
        for length, marker in markers.items():
            cell = [r for r in rows if r["recipe"] == recipe and r["length"] == length]
            if cell:
                ax.scatter([r["reasoning_tokens"] + r["summary_tokens"] for r in cell],
                           [r["peak_kv_bytes"] / 2**20 for r in cell], color=colour, marker=marker,
                           label=f"{label}, {length}-token chain")
    ax.set_xlabel("tokens generated (reasoning + asked summaries)")
    ax.set_ylabel("peak KV cache (MiB)")
    ax.set_title(f"InftyThink vs one long context, {rows[0]['model']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(args.plot, bbox_inches="tight", dpi=110)
    print(f"wrote {args.plot}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[96, 160, 256])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", type=split_recipes,
                   default=["full", "inftythink:summarise=ask,segment=64,iterations=12"],
                   help="recipes separated by ';'")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=0, help="stop starting rows after this many seconds")
    p.add_argument("--probe", action="store_true", help="print each prediction and summary")
    p.add_argument("--table", action="store_true", help="print the tables from --out and exit")
    p.add_argument("--plot", metavar="PNG", help="with --table: also plot peak KV vs tokens generated")
    p.add_argument("--speed", metavar="LEN:INDEX,...",
                   help="time the prompt prefilled once vs every iteration on these rows (--out: timings)")
    p.add_argument("--repeats", type=int, default=2, help="with --speed: interleaved repeats per path")
    p.add_argument("--warmup", type=int, default=1, help="with --speed: 1 = one untimed generate first "
                   "(0 = none, as in the first timing run)")
    args = p.parse_args(argv)
    if args.speed:
        speed(args)
    elif args.table:
        table(args)
        if args.plot:
            plot(args)
    else:
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
