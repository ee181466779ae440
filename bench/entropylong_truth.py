"""EntropyLong against the truth: are the chunks that verification keeps the true source cards?

A ground-truth corpus (``longlab.data.groundtruth``: entity cards with invented attributes, documents that
use them later without restating them) is run through ``longlab.data.entropylong``; for each document the
chunks it keeps are compared with the cards it truly depends on, for three selections:

- ``verification``: the retrieved chunks with dH >= delta (EntropyLong);
- ``retrieval-only``: every retrieved chunk (top-k per uncertain group, no verification);
- ``random``: as many chunks as retrieval-only, drawn uniformly from the pool (seeded per document).

Precision = sum_d |S_d & T_d| / sum_d |S_d|, recall = sum_d |S_d & T_d| / sum_d |T_d| (pooled over
documents), each with a 95% percentile-bootstrap interval over documents; verification vs retrieval-only
is a paired bootstrap (the same resampled documents for both). Also stored: how many dependent values the
entropy threshold flags at all (the position before the value's first token in a group).

    bench/heavy.sh .venv/bin/python bench/entropylong_truth.py --docs 40 --cards 400   # run + page
    .venv/bin/python bench/entropylong_truth.py --report                               # page from JSON

Item 4 of the issue, "does the data help?" (``--finetune``): one ground-truth corpus, its three data
variants (``longlab data entropylong --selection verification|retrieval|random``, scorer = the trained
model), a LoRA fine-tune on each (``longlab train lora``, 300 steps at 2k tokens by default), and
``longlab eval`` of the base model and each adapter on vt and niah_single_1 at 2k and 4k (24 samples per
task and length, the same samples for every model), paired per sample against the base model
(``longlab.eval.stats.paired_difference``: mean difference, 95% paired-bootstrap interval). Every step is
a ``longlab`` command (``--dry-run`` prints them) and resumes: a finished dataset or adapter is kept, the
eval store skips finished rows. The work folder (``--ft-dir``) is tracked by git: the run outlasts a
session's disk only through commits (bench/state/README.md). ``--time-lora-steps N`` times N LoRA steps
at ``--ft-seq-len`` on one thread (random token ids: the cost of a step does not depend on them) and
stores the estimate for 300.

    bench/heavy.sh .venv/bin/python bench/entropylong_truth.py --time-lora-steps 2     # ~1 minute
    bench/heavy.sh .venv/bin/python bench/entropylong_truth.py --finetune              # hours: see the page
    .venv/bin/python bench/entropylong_truth.py --finetune --dry-run                   # the commands
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import ROOT, hardware, timed, write_json  # noqa: E402

from longlab.eval.pages.entropylong import analyse  # noqa: E402  (the page's analysis, one copy)

RESULT = ROOT / "bench" / "results" / "entropylong_truth.json"
FINETUNE_RESULT = ROOT / "bench" / "results" / "entropylong_finetune.json"
TIMING_RESULT = ROOT / "bench" / "results" / "entropylong_lora_timing.json"
VARIANTS = ("verification", "retrieval", "random")
METHODS = ("verification", "retrieval-only", "random")
SWEEP = (0.5, 1.0, 2.0)  # other deltas, from the stored dH of the same candidates (no rerun)


def _selections(rec: dict[str, Any], pool_ids: list[str], seed: int) -> dict[str, set[str]]:
    retrieved = {c["source"] for g in rec["groups"] for c in g["candidates"]}
    kept = {c["source"] for g in rec["groups"] for c in g["candidates"] if c["kept"]}
    rng = random.Random(f"entropylong_truth/random/{seed}/{rec['doc_id']}")
    others = [p for p in pool_ids if p != rec["doc_id"]]
    rand = set(rng.sample(others, min(len(retrieved), len(others))))
    out = {"verification": kept, "retrieval-only": retrieved, "random": rand}
    for delta in SWEEP:
        out[f"delta={delta:g}"] = {c["source"] for g in rec["groups"] for c in g["candidates"]
                                   if c["delta_h"] >= delta}
    return out


def _detected(rec: dict[str, Any], text: str, deps: list[dict[str, Any]],
              offsets: list[tuple[int, int]]) -> tuple[int, int]:
    """(dependencies whose value position is flagged, dependencies with any flagged position in their
    sentence). Flagged position t predicts token t + 1."""
    flagged = {t for g in rec["groups"] for t in g["positions"]}

    def token_at(char: int) -> int:
        return next((i for i, (a, b) in enumerate(offsets) if b > char), len(offsets))

    value = sentence = 0
    for d in deps:
        first = token_at(d["start"])
        begin = token_at(text.rfind(". ", 0, d["start"]) + 2)
        value += first - 1 in flagged
        sentence += any(begin - 1 <= t <= first - 1 for t in flagged)
    return value, sentence


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from longlab.data.entropylong import EntropyLongConfig, build_dataset
    from longlab.data.groundtruth import generate_corpus
    from longlab.models import load_model

    torch.set_num_threads(1)
    corpus = generate_corpus(args.docs, args.cards, seed=args.seed)
    model, tokenizer = load_model(args.model)
    cfg = EntropyLongConfig(retriever=args.retriever, target_tokens=2048, max_doc_tokens=1024,
                            seed=args.seed, batch_tokens=args.batch_tokens)
    name = f"{args.retriever}-d{args.docs}-c{args.cards}-s{args.seed}.jsonl"
    raw = ROOT / "runs" / "entropylong_truth" / name
    raw.parent.mkdir(parents=True, exist_ok=True)
    seconds, _cpu, summary = timed(
        lambda: build_dataset(corpus, model, tokenizer, raw, cfg, scorer=args.model, progress=True)
    )
    lines = raw.read_text().splitlines()
    records = {r["doc_id"]: r for r in map(json.loads, lines[1:])}
    pool_ids = [c.id for c in corpus.pool]
    rows = []
    for doc in corpus.documents:
        rec = records[doc.id]
        deps = [vars(d) for d in corpus.truth[doc.id]]
        truth = {d["card"] for d in deps}
        sel = _selections(rec, pool_ids, args.seed)
        offsets = tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        value_flagged, sentence_flagged = _detected(rec, doc.text, deps, offsets)
        rows.append({
            "value_flagged": value_flagged, "sentence_flagged": sentence_flagged,
            "doc_id": doc.id, "truth": len(truth), "dependencies": len(deps),
            "groups": len(rec["groups"]),
            **{f"{m}_selected": len(s) for m, s in sel.items()},
            **{f"{m}_hits": len(s & truth) for m, s in sel.items()},
        })
    return {
        "what": "EntropyLong kept chunks vs the true source cards (longlab.data.groundtruth)",
        "command": " ".join(["bench/heavy.sh", ".venv/bin/python", "bench/entropylong_truth.py",
                             *sys.argv[1:]]),
        "size": {"docs": args.docs, "cards": args.cards, "seed": args.seed,
                 "issue_size": {"docs": 500, "cards": 5000}},
        "scorer": args.model, "config": asdict(cfg),
        "seconds": round(seconds, 1), "seconds_per_doc": round(seconds / max(1, summary["written"]), 2),
        "resumed_docs": summary.get("skipped", 0), "hardware": hardware(), "rows": rows,
    }


def _fmt(t: tuple[float, ...]) -> str:
    return f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"


def finetune_commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """``(what, argv)`` of every ``longlab`` command of the fine-tune comparison, in order."""
    work = Path(args.ft_dir)
    common = ["--threads", "1", "--no-progress"]
    cmds: list[tuple[str, list[str]]] = [
        ("corpus", ["data", "groundtruth", "--docs", str(args.ft_docs), "--cards", str(args.ft_cards),
                    "--seed", str(args.seed), "--out", str(work / "corpus")]),
    ]
    for v in VARIANTS:
        cmds.append((f"data:{v}", ["data", "entropylong", "--corpus", str(work / "corpus"), "--model",
                                   args.model, "--retriever", args.retriever, "--selection", v,
                                   "--target-tokens", str(args.ft_seq_len), "--max-doc-tokens",
                                   str(args.ft_seq_len // 2), "--seed", str(args.seed),
                                   "--out", str(work / f"{v}.jsonl"), *common]))
    for v in VARIANTS:
        cmds.append((f"train:{v}", [
            "train", "lora", "--model", args.model, "--data", str(work / f"{v}.jsonl"), "--steps",
            str(args.ft_steps), "--seq-len", str(args.ft_seq_len), "--seed", str(args.seed), "--threads", "1",
            "--out", str(work / f"lora-{v}")]))
    ev = ["--recipes", "full", "--tasks", args.ft_tasks, "--lengths", args.ft_lengths, "--samples",
          str(args.ft_samples), "--seed", str(args.seed), "--out", str(work / "eval"), "--no-report", *common]
    cmds.append(("eval:base", ["eval", "--model", args.model, *ev]))
    for v in VARIANTS:
        cmds.append((f"eval:{v}", ["eval", "--model", str(work / f"lora-{v}"), *ev]))
    return cmds


def _trained(adapter: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """The manifest of an adapter with all its steps done, else None."""
    from longlab.errors import LonglabError
    from longlab.safeio import read_json

    path = adapter / "adapter.json"
    if not path.is_file():
        return None
    try:
        manifest = read_json(path, "--ft-dir", max_bytes=1 << 24)
        done = manifest["training"]["steps_done"] == args.ft_steps
    except (LonglabError, KeyError, TypeError):
        return None
    return manifest if done else None


def _finished(what: str, argv: list[str], args: argparse.Namespace) -> bool:
    """Steps not run again: a training step whose adapter is there with all its steps done, and a data step
    whose variant's adapter is done and was trained on exactly this file (the sha256 in its manifest; a
    rebuild could only replace the data the adapter saw, e.g. after the module's source changed, which
    the data command's own resume check treats as a new run). The other data and the eval commands resume
    by themselves."""
    work = Path(args.ft_dir)
    if what == "corpus":
        return (work / "corpus").is_dir()
    if what.startswith("data:"):
        variant = what.split(":", 1)[1]
        manifest = _trained(work / f"lora-{variant}", args)
        data = Path(argv[argv.index("--out") + 1])
        if manifest is None or not data.is_file():
            return False
        from longlab.safeio import file_sha256  # the digest `longlab train lora` records

        recorded = manifest.get("data")
        return isinstance(recorded, dict) and recorded.get("sha256") == file_sha256(data)
    if what.startswith("train:"):
        return _trained(Path(argv[argv.index("--out") + 1]), args) is not None
    return False


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run (or print, ``--dry-run``) the commands, then pair each adapter's scores with the base model's."""
    import subprocess

    cmds = finetune_commands(args)
    shown = [" ".join(["longlab", *argv]) for _, argv in cmds]
    if args.dry_run:
        print("\n".join(shown))
        return {}
    start = time.perf_counter()
    for (what, argv), line in zip(cmds, shown):
        if _finished(what, argv, args):
            print(f"[{what}] done already", flush=True)
            continue
        print(f"[{what}] {line}", flush=True)
        subprocess.run([sys.executable, "-m", "longlab.cli", *argv], check=True, cwd=ROOT)
    result = finetune_analysis(args)
    result.update({"commands": shown, "seconds": round(time.perf_counter() - start, 1),
                   "hardware": hardware(), "command": " ".join(["bench/heavy.sh", ".venv/bin/python",
                                                               "bench/entropylong_truth.py", *sys.argv[1:]])})
    return result


def finetune_analysis(args: argparse.Namespace) -> dict[str, Any]:
    """Per data variant, task and length: the adapter's mean score minus the base model's on the same samples
    (paired bootstrap 95% interval); the verification adapter minus each other adapter, paired the same way;
    and each adapter's training record."""
    from longlab.eval.stats import paired_difference
    from longlab.eval.store import ResultStore
    from longlab.safeio import read_json

    work = Path(args.ft_dir)
    store = ResultStore(str(work / "eval"))
    try:
        rows = [r for r in store.rows() if r.get("score") is not None and r.get("recipe") == "full"]
    finally:
        store.close()
    by_model: dict[str, dict[tuple[Any, ...], float]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[(r["task"], r["length"], str(r["sample_id"]))] = float(r["score"])

    def paired(mine: dict[tuple[Any, ...], float], theirs: dict[tuple[Any, ...], float]
               ) -> list[tuple[str, int, list[float], list[float], Any]]:
        """Per (task, length) of ``mine``: both models' scores on the samples they share, and
        ``paired_difference`` of mine minus theirs."""
        out = []
        for task, length in sorted({k[:2] for k in mine}):
            keys = sorted(k for k in mine if k[:2] == (task, length) and k in theirs)
            if keys:
                a, b = [mine[k] for k in keys], [theirs[k] for k in keys]
                out.append((task, length, a, b, paired_difference(a, b)))
        return out

    base = by_model.get(args.model, {})
    cells: list[dict[str, Any]] = []
    for v in VARIANTS:
        for task, length, a, b, d in paired(by_model.get(str(work / f"lora-{v}"), {}), base):
            cells.append({"variant": v, "task": task, "length": length, "n": d.n,
                          "adapter": sum(a) / len(a), "base": sum(b) / len(b),
                          "diff": d.mean, "low": d.low, "high": d.high})
    pairs: list[dict[str, Any]] = []  # does verified data help more than the other variants' data?
    verified = by_model.get(str(work / "lora-verification"), {})
    for other in VARIANTS[1:]:
        for task, length, _, _, d in paired(verified, by_model.get(str(work / f"lora-{other}"), {})):
            pairs.append({"variant": "verification", "other": other, "task": task, "length": length,
                          "n": d.n, "diff": d.mean, "low": d.low, "high": d.high})
    training = {}
    for v in VARIANTS:
        manifest = work / f"lora-{v}" / "adapter.json"
        if manifest.is_file():
            t = read_json(manifest, "--finetune", max_bytes=1 << 24)["training"]
            keep = ("steps_done", "seq_len", "lr", "seconds", "seconds_per_step", "loss_first_10pct",
                    "loss_last_10pct", "heldout_sequences", "heldout_loss_before", "heldout_loss_after")
            training[v] = {k: t.get(k) for k in keep}
    return {"what": "LoRA fine-tunes on EntropyLong data variants vs the base model (issue 34 item 4)",
            "model": args.model,
            "size": {"docs": args.ft_docs, "cards": args.ft_cards, "steps": args.ft_steps,
                     "seq_len": args.ft_seq_len, "samples": args.ft_samples},
            "cells": cells, "pairs": pairs, "training": training}


def _merge_check(model: Any, tensors: dict[str, Any], stats: dict[str, Any], args: argparse.Namespace,
                 ids: list[int]) -> dict[str, Any]:
    """The timed adapter saved and loaded back the way ``longlab eval --model DIR`` loads it: how many
    projections merged, and how far the logits of the first tokens moved from the base model's."""
    import tempfile

    import torch

    from longlab.adapter_train import save_adapter
    from longlab.models import load_model

    with tempfile.TemporaryDirectory(prefix="elft-") as tmp:
        path = save_adapter(Path(tmp) / "adapter", tensors, model, base_model=args.model, rank=8, alpha=16.0,
                            targets="attn", data={"path": "random token ids"}, training=stats)
        merged, _ = load_model(path)
        x = torch.tensor([ids])
        with torch.no_grad():
            change = (merged(x).logits - load_model(args.model)[0](x).logits).abs().max().item()
    return {"modules": merged.longlab_adapter["modules"], "max_logit_change": round(change, 5)}


def time_lora_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per LoRA step of ``--model`` at ``--ft-seq-len`` tokens on one thread (random token ids: a
    step's cost does not depend on them): N steps, the first one's allocations included; the estimate for
    ``--ft-steps`` steps uses the median of the later steps (all of them when N = 1)."""
    import random as _random
    import resource
    import statistics

    import torch

    from longlab.adapter_train import train_lora
    from longlab.models import load_model

    torch.set_num_threads(1)
    model, _ = load_model(args.model, attn_implementation="sdpa")
    vocab = model.get_input_embeddings().weight.shape[0]
    rng = _random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(args.ft_seq_len)] for _ in range(2)]
    tensors, stats = train_lora(model, seqs, steps=args.time_lora_steps, heldout=0, progress=False,
                                grad_checkpointing=args.grad_checkpointing)
    steps = stats["step_seconds"]
    merge = _merge_check(model, tensors, stats, args, seqs[0][:256])
    per_step = statistics.median(steps[1:] or steps)
    return {"what": "seconds per LoRA step (rank 8, q/k/v/o, batch 1, sdpa, fp32, one thread)",
            "model": args.model, "seq_len": args.ft_seq_len, "step_seconds": steps,
            "grad_checkpointing": args.grad_checkpointing, "merge_check": merge,
            "seconds_per_step": round(per_step, 2), "steps_estimated": args.ft_steps,
            "estimate_hours": round(per_step * args.ft_steps / 3600, 2),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "hardware": hardware(),
            "command": " ".join(["bench/heavy.sh", ".venv/bin/python", "bench/entropylong_truth.py",
                                 *sys.argv[1:]])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--cards", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--retriever", default="bm25", choices=("bm25", "embedding"))
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--report", action="store_true", help="only rewrite the page from the stored JSON")
    p.add_argument("--result", default=str(RESULT))
    f = p.add_argument_group("item 4: the fine-tune comparison")
    f.add_argument("--finetune", action="store_true", help="data variants -> LoRA -> eval vs the base model")
    f.add_argument("--dry-run", action="store_true", help="with --finetune: print the commands only")
    f.add_argument("--time-lora-steps", type=int, default=0, metavar="N",
                   help="time N LoRA steps at --ft-seq-len (one thread) and store the estimate")
    f.add_argument("--grad-checkpointing", action="store_true", help="with --time-lora-steps")
    f.add_argument("--ft-dir", default="bench/state/entropylong_ft",
                   help="work folder (relative: to the repo root; the default is tracked, "
                        "bench/state/README.md)")
    f.add_argument("--ft-result", default=str(FINETUNE_RESULT))
    f.add_argument("--ft-docs", type=int, default=200)
    f.add_argument("--ft-cards", type=int, default=2000)
    f.add_argument("--ft-steps", type=int, default=300)
    f.add_argument("--ft-seq-len", type=int, default=2048)
    f.add_argument("--ft-samples", type=int, default=24)
    f.add_argument("--ft-tasks", default="vt,niah_single_1")
    f.add_argument("--ft-lengths", default="2048,4096")
    args = p.parse_args()
    if args.time_lora_steps:
        timing = time_lora_steps(args)
        write_json(TIMING_RESULT, timing)
        print(f"{timing['seconds_per_step']} s per step at {timing['seq_len']} tokens: "
              f"{timing['steps_estimated']} steps ~ {timing['estimate_hours']} h (peak RSS "
              f"{timing['peak_rss_gib']} GiB); wrote {TIMING_RESULT}")
        return
    if args.finetune:
        result = finetune(args)
        if result:
            write_json(args.ft_result, result)
            for c in result["cells"]:
                print(f"{c['variant']:12s} {c['task']:14s} {c['length']:5d} n={c['n']:3d} adapter "
                      f"{c['adapter']:.3f} base {c['base']:.3f} diff {c['diff']:+.3f} "
                      f"[{c['low']:+.3f}, {c['high']:+.3f}]")
        return
    if not args.report:
        write_json(args.result, run(args))
    result = json.loads(Path(args.result).read_text())
    if Path(args.result).resolve() == RESULT.resolve():  # the page's block, from the stored results
        from longlab.eval.docs_tables import generate_docs

        generate_docs(ROOT, page="entropylong", plots=False)
    a = analyse(result)
    for m in METHODS:
        print(f"{m:15s} precision {_fmt(a[m]['precision'])}  recall {_fmt(a[m]['recall'])}")
    for m in (f"delta={d:g}" for d in SWEEP):
        print(f"{m:15s} precision {_fmt(a[m]['precision'])}  recall {_fmt(a[m]['recall'])}")
    print(f"flagged: value {_fmt(a['value_flagged'])}, sentence {_fmt(a['sentence_flagged'])}; "
          f"page: docs/results/entropylong.md")


if __name__ == "__main__":
    main()
