"""Speculative decoding and Jacobi/LoSA on SmolLM2 at long contexts (longlab.spec).

Speculation (default mode): for every sample (passkey, vt, and a summarisation-like free-text prompt) the
context + question is prefilled once into a full cache; the stream is forked per configuration and each
configuration decodes greedily, the configurations' order rotating from sample to sample (interleaved).
Per configuration: acceptance rate, tokens per target forward, decode tokens/s and its ratio to plain
decoding *of the same sample in the same run*, K/V bytes read per generated token (the target's attention
while verifying + the draft's attention; plain decoding reads every held slot of every layer per token),
accuracy, and whether the tokens equal plain greedy decoding's.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/spec_decode.py --lengths 1024 4096 --samples 2
    .venv/bin/python bench/spec_decode.py --table            # markdown tables from the JSON

Jacobi/LoSA (``--losa``): 16-token Jacobi blocks, <= 8 steps, over a cached prefix: dense, per-query Quest
(k pages) and LoSA (rho, same k); union of prefix pages loaded per layer-step, logit L-inf and greedy-token
agreement with dense on the same block, tokens per forward, accuracy.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/spec_decode.py --losa --lengths 4096 --samples 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import ROOT, hardware, load_average, rotated, timed, write_json

from longlab import load_model
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream, eos_token_ids
from longlab.eval.spec_tables import spec_markdown
from longlab.prompt import encode_prompts
from longlab.spec import parse_draft, parse_verifier, speculative_decode
from longlab.spec.dustin import save_heads, select_heads
from longlab.spec.jacobi import jacobi_decode
from longlab.spec.slot_attention import kv_slot_bytes
from longlab.tasks import Sample, essay_sentences, score
from longlab.tasks import generate_samples as make_samples

OUT = ROOT / "bench" / "results" / "spec_decode.json"
OUT_LOSA = ROOT / "bench" / "results" / "spec_losa.json"
HEADS = ROOT / "bench" / "results" / "dustin_heads_smollm2.json"

# (name, draft, verifier with {B} = Dustin's budget, gamma)
CONFIGS = [
    ("plain", None, None, None),
    ("lookup", "lookup", "full", 10),
    ("lookup+dustin", "lookup", "dustin:budget={B},heads={H}", 10),
    ("self-streaming", "self:streaming:budget=256", "full", 4),
    ("self-streaming+dustin", "self:streaming:budget=256", "dustin:budget={B},heads={H}", 4),
    ("self-quest", "self:quest:budget=256", "full", 4),
]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def summary_samples(tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
    """A free-text prompt: an essay excerpt of about ``length`` tokens and 'summarise it'."""
    _, sentences = essay_sentences()
    out = []
    for i in range(n):
        start = (seed * 7919 + i * 1543) % max(1, len(sentences) - 1)
        text, count = [], 0
        j = start
        while count < length - 48:
            s = sentences[j % len(sentences)]
            count += len(tokenizer(s + " ", add_special_tokens=False)["input_ids"])
            text.append(s)
            j += 1
        out.append(
            Sample(
                " ".join(text),
                "Summarize the text above in a few sentences.",
                "",
                [],
                max_new_tokens=48,
                task="summary",
                length=length,
                sample_id=f"summary-{length}-s{seed}-{i}",
            )
        )
    return out


def samples_for(tokenizer: Any, tasks: list[str], length: int, n: int, seed: int) -> list[Sample]:
    out = []
    for task in tasks:
        if task == "summary":
            out += summary_samples(tokenizer, length, n, seed)
        else:
            out += make_samples(task, tokenizer, length, n, seed)
    return out


def prefill(model: Any, tokenizer: Any, sample: Sample) -> tuple[Stream, torch.Tensor, list[int], float]:
    ctx_ids, q_ids = encode_prompts(tokenizer, [sample.context], [sample.question], [sample.answer_prefix])
    stream = Stream(model, LonglabCache("full"), 1)
    stream.pad_id = tokenizer.pad_token_id or 0
    def feed() -> torch.Tensor:
        stream.feed(ctx_ids, 1024)
        return stream.feed(q_ids, 1024, compress="none")

    wall, _cpu, logits = timed(feed)
    return stream, logits, ctx_ids[0] + q_ids[0], wall


def plain_bytes(cache: Any, n_tokens: int) -> float:
    """K/V bytes plain decoding reads for ``n_tokens`` tokens: every held slot of every layer per step
    (the first token comes from the prefill's logits; each later one costs one forward)."""
    total = 0.0
    for layer in cache.layers:
        T0, slot = layer.index.shape[-1], kv_slot_bytes(layer)
        total += sum((T0 + i + 1) * slot for i in range(n_tokens - 1))
    return total


def run_spec(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    eos = eos_token_ids(model, tokenizer)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = Path(args.heads)
    if not heads.exists():
        _, sentences = essay_sentences()
        calib = select_heads(
            model,
            tokenizer,
            " ".join(sentences[:400]),
            n_heads=4,
            per_layer=1,
            page_size=32,
            budget=256,
            max_tokens=2048,
        )
        save_heads(heads, calib)
        print("dustin heads:", calib["heads"], flush=True)
    configs = [c for c in CONFIGS if args.configs is None or c[0] in args.configs]
    rows, k = [], 0
    if args.append and Path(args.out).exists():  # add samples (another seed, another length) to a run
        rows = json.loads(Path(args.out).read_text())["rows"]
    for length in args.lengths:
        budget = max(256, length // 8)
        for sample in samples_for(tokenizer, args.tasks, length, args.samples, args.seed):
            base, logits, prompt, prefill_s = prefill(model, tokenizer, sample)
            max_new = min(sample.max_new_tokens, args.max_new_tokens)
            order = rotated(configs, k)  # the shared runner's rotation, one round per sample
            k += 1
            plain_tokens, results = None, {}
            for name, draft, verify, gamma in order:
                stream = base.fork()
                load = load_average()
                if draft is None:
                    wall, cpu, tokens = timed(partial(stream.decode, logits, max_new, eos))
                    stats = None
                else:
                    v = verify.format(B=budget, H=heads)
                    draft_, verifier = parse_draft(draft), parse_verifier(v)
                    wall, cpu, (tokens, stats) = timed(
                        partial(
                            speculative_decode,
                            model,
                            tokenizer,
                            stream,
                            logits,
                            [prompt],
                            max_new,
                            eos,
                            draft_,
                            verifier,
                            gamma,
                        )
                    )
                toks = tokens[0]
                pred = tokenizer.decode(toks, skip_special_tokens=True).strip()
                row = {
                    "config": name,
                    "draft": draft,
                    "verify": verify and verify.format(B=budget, H=heads.name),
                    "gamma": gamma,
                    "task": sample.task,
                    "length": length,
                    "context_tokens": len(prompt),
                    "sample": sample.sample_id,
                    "tokens": toks,
                    "n_tokens": len(toks),
                    "decode_s": wall,
                    "decode_cpu_s": cpu,
                    "tokens_per_s": len(toks) / wall,
                    "load_1m": load,
                    "prefill_s": prefill_s,
                    "prediction": pred,
                    "score": score(sample.task, pred, sample.answers) if sample.answers else None,
                }
                if stats is None:
                    row.update(
                        kv_bytes_read=plain_bytes(base.cache, len(toks)),
                        acceptance_rate=None,
                        tokens_per_forward=1.0,
                        target_forwards=len(toks) - 1,
                    )
                else:
                    s = stats.as_dict()
                    row.update(
                        kv_bytes_read=s["target_kv_bytes"] + s["draft_kv_bytes"],
                        target_kv_bytes=s["target_kv_bytes"],
                        draft_kv_bytes=s["draft_kv_bytes"],
                        acceptance_rate=s["acceptance_rate"],
                        tokens_per_forward=s["tokens_per_forward"],
                        target_forwards=s["steps"],
                        draft_forwards=s["draft_forwards"],
                        refreshes=s["refreshes"],
                    )
                # a memory-bound device reads the weights once per forward (target or draft) plus the K/V
                forwards = row["target_forwards"] + row.get("draft_forwards", 0)
                row["total_bytes_read"] = forwards * weight_bytes + row["kv_bytes_read"]
                results[name] = row
                if name == "plain":
                    plain_tokens = toks
            for row in results.values():
                row["same_as_plain"] = row["tokens"] == plain_tokens if plain_tokens is not None else None
                if "plain" in results:
                    p = results["plain"]
                    row["total_bytes_ratio"] = (row["total_bytes_read"] / row["n_tokens"]) / (
                        p["total_bytes_read"] / p["n_tokens"]
                    )
                    row["speed_ratio"] = row["tokens_per_s"] / p["tokens_per_s"]
                    row["bytes_ratio"] = (row["kv_bytes_read"] / row["n_tokens"]) / (
                        p["kv_bytes_read"] / p["n_tokens"]
                    )
                rows.append(row)
                print(
                    f"{length:5d} {sample.task:8s} {row['config']:22s} acc={row['acceptance_rate'] or 0:.2f} "
                    f"tpf={row['tokens_per_forward']:.2f} tok/s={row['tokens_per_s']:.1f} "
                    f"speed×{row.get('speed_ratio', 1):.2f} kv×{row.get('bytes_ratio', 1):.2f} "
                    f"all×{row.get('total_bytes_ratio', 1):.2f} "
                    f"same={row['same_as_plain']} score={row['score']}",
                    flush=True,
                )
            write_json(
                args.out,
                {
                    "hardware": hardware(),
                    "uptime_end": uptime(),
                    "args": vars(args) | {"heads": str(heads), "weight_bytes": weight_bytes},
                    "rows": rows,
                },
            )
    result = {
        "hardware": hardware(),
        "uptime_end": uptime(),
        "args": vars(args) | {"heads": str(heads), "weight_bytes": weight_bytes},
        "rows": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}; tables: --table; the page: longlab report --docs --page results/spec-decode")


def table(path: Path, path_losa: Path) -> None:
    """The bench and LoSA tables of ``path`` / ``path_losa`` (:mod:`longlab.eval.pages.spec_decode`)."""
    from longlab.eval.pages.spec_decode import bench_table, losa_table

    if path.exists():
        print(bench_table(json.loads(path.read_text())) + "\n")
    if path_losa.exists():
        print(losa_table(json.loads(path_losa.read_text())))


def eval_grid(out: str) -> None:
    """Tables (longlab.eval.spec_tables.spec_markdown, 95% CIs) and the acceptance-vs-length plot of a
    ``longlab eval --speculative`` results directory (the page's own: ``longlab report --docs``)."""
    from longlab.eval.pages.spec_decode import eval_grid_plot
    from longlab.eval.rows import load_rows

    rows = [r for r in load_rows(out) if "spec" in (r.get("extra") or {})]
    print(spec_markdown(rows) or f"{out}: no `longlab eval --speculative` rows")
    if rows:
        path = Path(out) / "acceptance_vs_length.png"
        eval_grid_plot(rows, path)
        print(f"\nplot: {path}")


def run_losa(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    out = Path(args.out_losa)
    rows = json.loads(out.read_text())["rows"] if args.append and out.exists() else []
    done = {r["sample"] for r in rows}
    for length in args.lengths:
        for sample in samples_for(
            tokenizer, [t for t in args.tasks if t != "summary"], length, args.samples, args.seed
        ):
            if sample.sample_id in done:  # --append: resumable, samples already measured are kept
                continue
            base, logits, prompt, _ = prefill(model, tokenizer, sample)
            max_new = min(sample.max_new_tokens, args.max_new_tokens)
            for attention in ("dense", "quest", "losa"):
                stream = base.fork()
                wall, _cpu, (tokens, stats) = timed(
                    partial(
                        jacobi_decode,
                        model,
                        stream,
                        logits,
                        max_new,
                        block=16,
                        max_steps=8,
                        attention=attention,
                        budget=32 * 16,
                        page_size=16,
                        rho=0.25,
                        compare_dense=attention != "dense",
                    )
                )
                pred = tokenizer.decode(tokens[0], skip_special_tokens=True).strip()
                row = {
                    "attention": attention,
                    "task": sample.task,
                    "length": length,
                    "sample": sample.sample_id,
                    "wall_s": wall,
                    "load_1m": os.getloadavg()[0],
                    "prediction": pred,
                    "score": score(sample.task, pred, sample.answers),
                    "tokens": tokens[0],
                    **stats.as_dict(),
                }
                if attention == "dense":  # dense reads every prefix page and is its own reference
                    row.update(
                        pages_per_layer_step=len(prompt) / 16, token_agreement=1.0, active_fraction=1.0
                    )
                rows.append(row)
                print(
                    f"{length} {sample.task} {attention:6s} pages={row['pages_per_layer_step']:.1f} "
                    f"active={row['active_fraction']:.2f} linf={row['logit_linf']:.3f} "
                    f"agree={row['token_agreement']:.3f} tpf={row['tokens_per_forward']:.2f} "
                    f"score={row['score']}",
                    flush=True,
                )
            write_json(args.out_losa, {"hardware": hardware(), "uptime_end": uptime(), "rows": rows})
    write_json(args.out_losa, {"hardware": hardware(), "uptime_end": uptime(), "rows": rows})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tasks", nargs="+", default=["passkey", "vt", "summary"])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", nargs="+", help=f"subset of {[c[0] for c in CONFIGS]}")
    p.add_argument(
        "--heads", default=str(HEADS), help="Dustin head file (created by select_heads if missing)"
    )
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--out-losa", default=str(OUT_LOSA))
    p.add_argument("--losa", action="store_true", help="Jacobi decoding: dense vs per-query Quest vs LoSA")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out (--out-losa)")
    p.add_argument(
        "--eval-grid", metavar="DIR", help="tables + acceptance plot of a `longlab eval --speculative` dir"
    )
    args = p.parse_args(argv)
    if args.eval_grid:
        eval_grid(args.eval_grid)
    elif args.table:
        table(Path(args.out), Path(args.out_losa))
    elif args.losa:
        run_losa(args)
    else:
        run_spec(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
