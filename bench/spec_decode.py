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
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import ROOT, hardware, write_json

from longlab import load_model
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream, eos_token_ids
from longlab.eval.spec_tables import mean_ci_cell, median_cell, paired_cell, score_ci_cell, spec_markdown
from longlab.eval.stats import paired_difference
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
    t0 = time.perf_counter()
    logits = stream.feed(ctx_ids, 1024)
    logits = stream.feed(q_ids, 1024, compress="none")
    return stream, logits, ctx_ids[0] + q_ids[0], time.perf_counter() - t0


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
            order = configs[k % len(configs) :] + configs[: k % len(configs)]
            k += 1
            plain_tokens, results = None, {}
            for name, draft, verify, gamma in order:
                stream = base.fork()
                load = os.getloadavg()[0]
                c0, t0 = time.process_time(), time.perf_counter()
                if draft is None:
                    tokens = stream.decode(logits, max_new, eos)
                    stats = None
                else:
                    v = verify.format(B=budget, H=heads)
                    tokens, stats = speculative_decode(
                        model,
                        tokenizer,
                        stream,
                        logits,
                        [prompt],
                        max_new,
                        eos,
                        parse_draft(draft),
                        parse_verifier(v),
                        gamma,
                    )
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
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
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["acceptance_rate"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["config"] for r in rows):
        lengths = sorted({r["length"] for r in rows if r["config"] == name})
        acc = [
            statistics.mean(r["acceptance_rate"] for r in rows if r["config"] == name and r["length"] == n)
            for n in lengths
        ]
        byt = [
            statistics.median(r["bytes_ratio"] for r in rows if r["config"] == name and r["length"] == n)
            for n in lengths
        ]
        axes[0].plot(lengths, acc, marker="o", label=name)
        axes[1].plot(lengths, byt, marker="o", label=name)
    for ax, title in zip(axes, ("acceptance rate", "K/V bytes read per token / plain")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, greedy, full cache (longlab.spec)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _fmt(x: float | None, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    return "—" if x is None else f"{x * scale:{spec}}{suffix}"


def table(path: Path, path_losa: Path) -> None:
    if path.exists():
        data = json.loads(path.read_text())
        rows = data["rows"]
        print(
            "| context | config | n | acceptance [95% CI] | tokens / target forward [95% CI] | tok/s / plain "
            "(median, quartiles; CPU-time median) | KV bytes read per token / plain (median) | "
            "weights + KV bytes per token / plain (median) | accuracy, passkey + vt [95% CI] | "
            "accuracy - plain [paired 95% CI] | tokens = plain | load (1 min) |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        plain = {(r["length"], r["sample"]): r for r in rows if r["config"] == "plain"}
        for r in rows:  # process-CPU-time speed ratio: steadier than wall time on a shared machine
            p = plain.get((r["length"], r["sample"]))
            r["cpu_ratio"] = (
                (r["n_tokens"] / r["decode_cpu_s"]) / (p["n_tokens"] / p["decode_cpu_s"]) if p else None
            )
        names = [c[0] for c in CONFIGS]
        keys = sorted(
            dict.fromkeys((r["length"], r["config"]) for r in rows), key=lambda x: (x[0], names.index(x[1]))
        )
        for length, name in keys:
            sel = [r for r in rows if r["length"] == length and r["config"] == name]
            scored = [r for r in sel if r["score"] is not None]  # the summary prompt has no reference
            pairs = [(r, plain[(r["length"], r["sample"])]) for r in scored]
            is_plain = name == "plain"
            diff = "—" if is_plain else paired_cell(
                [r["score"] for r, _ in pairs],
                [p["score"] for _, p in pairs],
                sum(bool(r["same_as_plain"]) for r, _ in pairs),
            )
            acc = [r["acceptance_rate"] for r in sel if r["acceptance_rate"] is not None]
            loads = [r["load_1m"] for r in sel]
            print(
                f"| {length} | {name} | {len(sel)} | {mean_ci_cell(acc)} | "
                f"{'1.00' if is_plain else mean_ci_cell([r['tokens_per_forward'] for r in sel])} | "
                f"{median_cell([r['speed_ratio'] for r in sel])}; "
                f"{_fmt(statistics.median(r['cpu_ratio'] for r in sel))} | "
                f"{_fmt(statistics.median(r['bytes_ratio'] for r in sel))} | "
                f"{_fmt(statistics.median(r['total_bytes_ratio'] for r in sel))} | "
                f"{score_ci_cell([r['score'] for r in scored])} | {diff} | "
                f"{sum(bool(r['same_as_plain']) for r in sel)}/{len(sel)} | "
                f"{min(loads):.1f}-{max(loads):.1f} |"
            )
        loads = [r["load_1m"] for r in rows]
        print(
            f"\nload average (1 min) while decoding: {min(loads):.1f}–{max(loads):.1f}; "
            f"threads {data['hardware']['threads']}; {data['hardware']['cpu']}; end: {data['uptime_end']}\n"
        )
    if path_losa.exists():
        data = json.loads(path_losa.read_text())
        rows = data["rows"]
        print(
            "| context | task | attention | n | prefix pages loaded / layer-step [95% CI] | active fraction "
            "| logit L∞ vs dense (mean / max) | greedy tokens = dense (per step) [95% CI] | tokens / forward "
            "| accuracy [95% CI] |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
        keys = dict.fromkeys((r["length"], r["task"], r["attention"]) for r in rows)
        for length, task, att in keys:
            sel = [r for r in rows if (r["length"], r["task"], r["attention"]) == (length, task, att)]
            pages = mean_ci_cell([r["pages_per_layer_step"] for r in sel], 1)
            worst = max(r["logit_linf_max"] for r in sel)
            linf = f"{_fmt(_mean([r['logit_linf'] for r in sel]))} / {_fmt(worst)}"
            print(
                f"| {length} | {task} | {att} | {len(sel)} | {pages} | "
                f"{_fmt(_mean([r['active_fraction'] for r in sel]))} | {linf} | "
                f"{mean_ci_cell([r['token_agreement'] for r in sel], 3)} | "
                f"{_fmt(_mean([r['tokens_per_forward'] for r in sel]))} | "
                f"{score_ci_cell([r['score'] for r in sel])} |"
            )
        # LoSA vs per-query Quest on the same samples (paired bootstrap over samples, all tasks)
        by = {(r["sample"], r["attention"]): r for r in rows}
        pairs = [(by[(s_, "losa")], by[(s_, "quest")]) for s_, a in by if a == "losa" and (s_, "quest") in by]
        if pairs:
            print(f"\nLoSA - per-query Quest, paired over {len(pairs)} samples (95% CI):")
            for key, what in (
                ("pages_per_layer_step", "prefix pages loaded / layer-step"),
                ("token_agreement", "greedy-token agreement with dense"),
                ("score", "accuracy"),
            ):
                d = paired_difference([x[key] for x, _ in pairs], [y[key] for _, y in pairs])
                ns = "" if d.significant else ", n.s."
                print(f"- {what}: {d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{ns}")
        loads = [r["load_1m"] for r in rows]
        print(f"\nload average (1 min): {min(loads):.1f}–{max(loads):.1f}; end: {data['uptime_end']}")


def eval_grid(out: str) -> None:
    """Tables (longlab.eval.spec_tables.spec_markdown, 95% CIs) and the acceptance-vs-length plot of a
    ``longlab eval --speculative`` results directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from longlab.eval.stats import bootstrap_ci
    from longlab.eval.store import ResultStore

    store = ResultStore(out, readonly=True)
    try:
        rows = [r for r in store.rows() if "spec" in (r.get("extra") or {})]
    finally:
        store.close()
    print(spec_markdown(rows))
    spec = [r for r in rows if r["extra"]["spec"] != "plain"]
    tasks = sorted({r["task"] for r in spec})
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.8), squeeze=False)
    for col, (title, sel_task) in enumerate([(t, t) for t in tasks] + [("K/V bytes read / plain", None)]):
        ax = axes[0][col]
        for k, label in enumerate(sorted({r["recipe"] for r in spec})):
            mine = [r for r in spec if r["recipe"] == label and (sel_task is None or r["task"] == sel_task)]
            lengths = sorted({r["length"] for r in mine})
            mean, low, high = [], [], []
            for n in lengths:
                key = "bytes_vs_plain" if sel_task is None else "acceptance_rate"
                vals = [r["extra"][key] for r in mine if r["length"] == n]
                m, lo, hi = bootstrap_ci([vals])
                mean.append(m)
                low.append(m - lo)
                high.append(hi - m)
            short = label.split("~", 1)[-1].replace(";gamma=", " g")
            shift = [n * 1.04**k for n in lengths]  # configs side by side at each length
            style = "--" if ";dustin" in label else "-"
            ax.errorbar(shift, mean, yerr=[low, high], marker="o", ls=style, capsize=3, label=short)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(f"acceptance: {title}" if sel_task else title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].axhline(1.0, color="gray", lw=0.8)
    axes[0][-1].set_title("K/V bytes read per token / plain (mean)", fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        "SmolLM2-135M, greedy, full cache: longlab eval --speculative "
        "(means, 95% bootstrap CIs over samples)",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(out) / "acceptance_vs_length.png"
    fig.savefig(path, dpi=120)
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
                t0 = time.perf_counter()
                tokens, stats = jacobi_decode(
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
                pred = tokenizer.decode(tokens[0], skip_special_tokens=True).strip()
                row = {
                    "attention": attention,
                    "task": sample.task,
                    "length": length,
                    "sample": sample.sample_id,
                    "wall_s": time.perf_counter() - t0,
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
