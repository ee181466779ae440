"""KV reuse for RAG prompts (issue #11): accuracy vs recompute ratio, TTFT vs full prefill, bytes per doc.

    # accuracy (resumable; rows in bench/results/rag_reuse/<task>/results.sqlite), 1 torch thread:
    OMP_NUM_THREADS=1 python bench/rag_reuse.py accuracy --task multidoc_qa_1 --samples 40
    # TTFT, every method side by side, interleaved rounds, medians (documents read from a disk store):
    python bench/rag_reuse.py ttft --num-docs 4,8 --doc-tokens 400 --rounds 5
    # the page's tables, verdicts and PNGs (longlab report --docs --page results/rag-reuse):
    python bench/rag_reuse.py report

Accuracy: ``multidoc_qa_1``/``multidoc_qa_2`` samples (``--num-docs`` documents of ``--doc-tokens`` tokens),
every method at every ratio on the same samples, scored "forced" (greedy decoding would emit exactly the
answer; see ``longlab.eval.reuse_grid``). ``ρ = 1`` is not re-run: every method at ratio 1 is the full
prefill token for token (``tests/test_reuse.py``), and ``ρ = 0`` is ``no-recompute``.
TTFT: ``fetch`` (read + digest check of the stored documents) + ``assemble`` (RoPE fix) + ``compute``;
the full prefill reads nothing. Each figure is the median over rounds; methods run in a rotated order per
round so drift in machine load hits all of them alike. ``uptime`` is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import ROOT, hardware, interleaved, write_json

from longlab import load_model
from longlab.tasks import generate_samples as make_samples

OUT = Path(os.environ.get("RAG_REUSE_OUT", ROOT / "bench" / "results" / "rag_reuse"))
METHODS = ("epic", "cacheblend", "prophetkv")
FIXED = ("full-prefill", "no-recompute", "ape")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _specs(ratios: list[float], extra: list[str]) -> list[str]:
    specs = list(FIXED)
    for m in METHODS:
        for r in ratios:
            specs.append(f"{m}:recompute={r:g}")
    return specs + extra


def cmd_accuracy(args: argparse.Namespace) -> int:
    from longlab.eval.config import EvalConfig
    from longlab.eval.identity import config_hash, make_run_key
    from longlab.eval.runner import METRICS_KEY, SampleRunner
    from longlab.eval.store import ResultStore

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    length = args.num_docs * args.doc_tokens + 200
    samples = make_samples(
        args.task,
        tokenizer,
        length,
        args.samples,
        args.seed,
        num_docs=args.num_docs,
        doc_tokens=args.doc_tokens,
        digits=args.digits,
    )
    shard, shards = (int(x) for x in args.shard.split("/"))
    samples = samples[shard::shards]
    ratios = [float(r) for r in args.ratios.split(",")]
    specs = _specs(ratios, [s for s in args.extra.split(";") if s])
    out = OUT / args.task
    print(f"{len(samples)} samples x {len(specs)} methods -> {out}; {_uptime()}", flush=True)
    deadline = time.time() + args.max_minutes * 60
    # the harness's own pieces (longlab.eval.driver does the same for `longlab eval --reuse`): one config
    # hash, one run key per (sample, cell), rows already stored skipped, one transaction per row
    config = EvalConfig(
        out=str(out), model=args.model, tasks=[args.task], recipes=["full"], reuse=specs, seed=args.seed
    )
    config.validate()
    runner = SampleRunner(model, tokenizer, config, config_hash(config.identity()))
    cells = config.cells()
    store = ResultStore(out)
    done = store.done_keys()
    for s in samples:
        if time.time() > deadline:
            print("time budget reached; re-run to continue (stored rows are skipped)")
            break
        missing = [c for c in cells if make_run_key(**runner.identity(s, c)) not in done]
        t0 = time.perf_counter()
        for row in runner.run(s, missing):
            store.add(row, metrics=row.pop(METRICS_KEY, None))
        if missing:
            print(f"  {s.sample_id}: {len(missing)} rows in {time.perf_counter() - t0:.1f}s", flush=True)
    print(_uptime())
    return 0


def cmd_ttft(args: argparse.Namespace) -> int:
    from longlab.reuse import DocStore, reuse_prefill

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    store = DocStore(OUT / "store")
    specs = [s for s in args.methods.split(";") if s]
    result = {"hardware": hardware(), "uptime_before": _uptime(), "threads": args.threads, "runs": []}
    for m in (int(x) for x in args.num_docs.split(",")):
        (sample,) = make_samples(
            "multidoc_qa_1",
            tokenizer,
            m * args.doc_tokens + 200,
            1,
            100 + m,
            num_docs=m,
            doc_tokens=args.doc_tokens,
        )
        docs, q, prefix = sample.metadata["documents"], sample.question, sample.answer_prefix
        times: dict[str, list[dict]] = {s: [] for s in specs}

        def run(spec: str, docs=docs, q=q, prefix=prefix, times=times) -> None:
            pre = reuse_prefill(model, tokenizer, docs, q, spec, store=store, answer_prefix=prefix)
            times[spec].append(
                {
                    "ttft": pre.ttft_s,
                    "fetch": pre.fetch_s,
                    "assemble": pre.assemble_s,
                    "compute": pre.compute_s,
                    "recompute_fraction": pre.recompute_fraction,
                    "tokens": pre.prompt_tokens,
                }
            )

        # one untimed warm-up round (it also puts every document, and APE's prefixed entries, in the
        # store), then the rounds, the method order rotated each round (common.interleaved)
        timing = interleaved({s: (lambda s=s: run(s)) for s in specs}, repeats=args.rounds, warmup=1)
        for spec in specs:
            times[spec] = times[spec][1:]  # drop the warm-up call's record
            for rec, wall in zip(times[spec], timing["variants"][spec]["wall_s"]):
                rec["wall"] = wall
        print(f"m={m}: load {timing['load_before']} before, {timing['load_after']} after", flush=True)
        _print_ratios(m, specs, times)
        for spec in specs:
            med = {
                k: statistics.median(t[k] for t in times[spec])
                for k in ("wall", "ttft", "fetch", "assemble", "compute")
            }
            result["runs"].append(
                {
                    "num_docs": m,
                    "method": spec,
                    "prompt_tokens": times[spec][0]["tokens"],
                    "recompute_fraction": times[spec][0]["recompute_fraction"],
                    "median": med,
                    "all": times[spec],
                }
            )
    result["uptime_after"] = _uptime()
    result["store_entries"] = [
        {"n_tokens": e.n_tokens, "nbytes": e.nbytes, "dtype": e.dtype, "start": e.start}
        for e in store.entries()
    ]
    path = write_json(OUT / "ttft.json", result)
    shutil.rmtree(OUT / "store", ignore_errors=True)  # hundreds of MB of KV: not a result to keep
    print(f"wrote {path}; {result['uptime_after']}")
    return 0


def _print_ratios(m: int, specs: list[str], times: dict[str, list[dict]]) -> None:
    """TTFT medians and full / method ratios of one run, side by side: the median ratio and its range over
    rounds (each round's full prefill divided by the same round's method)."""
    full = "full-prefill" if "full-prefill" in times else specs[0]
    print(f"m={m} documents: TTFT medians over {len(times[full])} interleaved rounds; {_uptime()}")
    for spec in specs:
        per_round = [f["ttft"] / t["ttft"] for f, t in zip(times[full], times[spec])]
        med = statistics.median(t["ttft"] for t in times[spec])
        print(
            f"  {spec:<24} TTFT {med:7.3f}s  {full}/method {statistics.median(per_round):5.2f}x "
            f"(rounds {min(per_round):.2f}-{max(per_round):.2f}x)",
            flush=True,
        )


def cmd_report(args: argparse.Namespace) -> int:
    """The page's tables, verdicts and PNGs from the committed rows: ``longlab report --docs --page
    results/rag-reuse`` (:mod:`longlab.eval.pages.rag_reuse`)."""
    from longlab.eval.docs_tables import generate_docs

    changed = generate_docs(ROOT, page="results/rag-reuse", plots=True)
    what = "rewrote " + ", ".join(changed[0].blocks) if changed else "unchanged"
    print(f"docs/results/rag-reuse.md: {what}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--task", default="multidoc_qa_1")
    a.add_argument("--samples", type=int, default=40)
    a.add_argument("--num-docs", type=int, default=4)
    a.add_argument("--doc-tokens", type=int, default=220)
    a.add_argument("--digits", type=int, default=5, help="answer length in digits")
    a.add_argument("--ratios", default="0.05,0.1,0.2,0.4")
    a.add_argument(
        "--extra",
        default="prophetkv:recompute=0.2,dual_stage=true;cacheblend:recompute=0.2,gradual=true",
        help="more specs, ';'-separated",
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--shard", default="0/1", help="i/n: this process takes samples i, i+n, ...")
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--max-minutes", type=float, default=14.0)
    a.set_defaults(func=cmd_accuracy)
    t = sub.add_parser("ttft")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--num-docs", default="4,8")
    t.add_argument("--doc-tokens", type=int, default=400)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument(
        "--methods",
        default="full-prefill;no-recompute;epic:k=16;epic:k=32;cacheblend:recompute=0.15;prophetkv;ape",
    )
    t.set_defaults(func=cmd_ttft)
    r = sub.add_parser("report")
    r.set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
