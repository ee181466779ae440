"""KV reuse for RAG prompts (issue #11): accuracy vs recompute ratio, TTFT vs full prefill, bytes per doc.

    # accuracy (resumable; rows in bench/results/rag_reuse/<task>/results.sqlite), 1 torch thread:
    OMP_NUM_THREADS=1 python bench/rag_reuse.py accuracy --task multidoc_qa_1 --samples 40
    # TTFT, every method side by side, interleaved rounds, medians (documents read from a disk store):
    python bench/rag_reuse.py ttft --num-docs 4,8 --doc-tokens 400 --rounds 5
    # tables, PNG curve and JSON summary from what was measured:
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
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import ROOT, hardware, write_json

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
        for spec in specs:  # warm-up, and puts every document (and APE's prefixed entries) in the store
            reuse_prefill(model, tokenizer, docs, q, spec, store=store, answer_prefix=prefix)
        times: dict[str, list[dict]] = {s: [] for s in specs}
        for rnd in range(args.rounds):
            order = specs[rnd % len(specs) :] + specs[: rnd % len(specs)]
            for spec in order:
                start = time.perf_counter()
                pre = reuse_prefill(model, tokenizer, docs, q, spec, store=store, answer_prefix=prefix)
                wall = time.perf_counter() - start
                times[spec].append(
                    {
                        "wall": wall,
                        "ttft": pre.ttft_s,
                        "fetch": pre.fetch_s,
                        "assemble": pre.assemble_s,
                        "compute": pre.compute_s,
                        "recompute_fraction": pre.recompute_fraction,
                        "tokens": pre.prompt_tokens,
                    }
                )
            print(
                f"m={m} round {rnd + 1}/{args.rounds}: "
                + " ".join(f"{s}={times[s][-1]['wall']:.2f}s" for s in specs),
                flush=True,
            )
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


def _display(label: str) -> str:
    """``prophetkv@0.2:dual_stage=true`` -> ``prophetkv:dual_stage=true`` (the ratio has its own column)."""
    name, _, rest = label.partition("@")
    params = rest.partition(":")[2]
    return name + (f":{params}" if params else "")


RUNS = (  # (model label, results subdirectory of OUT, PNG prefix)
    ("SmolLM2-135M", "", "rag-reuse"),
    ("Qwen2.5-0.5B", "qwen", "rag-reuse-qwen"),
)
PAIRS = (("prophetkv", "cacheblend"), ("prophetkv", "epic"), ("cacheblend", "epic"))


def _ci(d) -> str:
    """A paired difference in points with its CI and significance."""
    sig = "" if d.significant else " (n.s.)"
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{sig}"


def share_of_full(scores: list[float], full: list[float]) -> tuple[float | None, float, float]:
    """``acc / acc_full`` with a 95% CI by inverting the paired bootstrap test of ``mean(a_i - c f_i) = 0``
    (``longlab.eval.stats.paired_difference``): the CI is the set of ``c`` on a 0.01 grid in [0, 3] that
    the test does not reject. ``(None, 0, inf)`` when the full prefill answers nothing."""
    from longlab.eval.stats import paired_difference

    if not sum(full):
        return None, 0.0, float("inf")
    kept = []
    for i in range(301):
        c = i * 0.01
        d = paired_difference(scores, [c * f for f in full])
        if not d.significant:
            kept.append(c)
    point = sum(scores) / sum(full)
    return point, (min(kept) if kept else point), (max(kept) if kept else point)


def claim_test(scores: list[float], full: list[float], share: float):
    """Paired bootstrap of ``mean(a_i - share * f_i)``: above 0 (significantly) = the method keeps more than
    ``share`` of the full prefill's accuracy, below 0 = less."""
    from longlab.eval.stats import paired_difference

    return paired_difference(scores, [share * f for f in full])


def _acc_table(run_dir: Path, model_label: str) -> tuple[list[str], list[dict]]:
    from longlab.eval.report import load_rows
    from longlab.eval.stats import paired_difference, wilson_interval

    rows = load_rows(run_dir) if (run_dir / "results.sqlite").exists() else []
    if not rows:
        return [], []
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["recipe"], {})[r["sample_id"]] = r
    full = by.get("full", {})
    ids = sorted(set.intersection(*(set(v) for v in by.values())))  # samples every method has
    if not ids:
        return [], []
    out, summary = [], []
    out.append(
        f"{model_label}: n = {len(ids)} samples (every method on the same samples); accuracy with 95% Wilson "
        "interval; *% of full* with a 95% CI from the paired bootstrap test inverted (see the text); Δ vs "
        "full: paired bootstrap 95% CI; fidelity: bootstrap 95% CI.\n"
    )
    out.append(
        "| method | ρ | accuracy % | 95% CI | % of full [95% CI] | Δ vs full (pts) | fidelity % [95% CI] | "
        "recomputed % | cost % |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def key(label: str) -> tuple:
        name, _, ratio = label.partition("@")
        order = {"full": 0, "no-recompute": 1, "ape": 2}
        return (order.get(name, 3), name.split(":")[0], float(ratio.split(":")[0]) if ratio else -1, label)

    full_scores = [full[i]["score"] for i in ids]
    for label in sorted(by, key=key):
        scores = [by[label][i]["score"] for i in ids]
        k = int(sum(scores))
        lo, hi = wilson_interval(k, len(ids))
        diff = paired_difference(scores, full_scores)
        extra = [by[label][i]["extra"] for i in ids]
        fids = [e["fidelity"] for e in extra]
        fid = statistics.mean(fids)
        fid_ci = paired_difference(fids, [0.0] * len(fids))
        rec = statistics.mean(e["recompute_fraction"] for e in extra)
        cost = statistics.mean(e["cost_fraction"] for e in extra)
        ratio = label.partition("@")[2].split(":")[0]
        acc = k / len(ids)
        share, s_lo, s_hi = share_of_full(scores, full_scores)
        rel = f"{100 * share:.0f} [{100 * s_lo:.0f}, {100 * s_hi:.0f}]" if share is not None else "–"
        out.append(
            f"| {_display(label)} | {ratio or '–'} | {100 * acc:.1f} | {100 * lo:.0f}–{100 * hi:.0f} | "
            f"{rel} | {_ci(diff)} | {100 * fid:.1f} [{100 * fid_ci.low:.0f}, {100 * fid_ci.high:.0f}] | "
            f"{100 * rec:.1f} | {100 * cost:.1f} |"
        )
        summary.append(
            {
                "label": label,
                "ratio": float(ratio) if ratio else None,
                "acc": acc,
                "low": lo,
                "high": hi,
                "n": len(ids),
                "share_of_full": [share, s_lo, s_hi],
                "diff": [diff.mean, diff.low, diff.high],
                "significant": diff.significant,
                "fidelity": fid,
                "fidelity_ci": [fid_ci.low, fid_ci.high],
                "recomputed": rec,
                "cost": cost,
            }
        )
    ratios = sorted({lab.partition("@")[2] for lab in by if "@" in lab and ":" not in lab}, key=float)
    out += [
        "",
        "Paired differences between methods at the same ρ on the same samples, accuracy and fidelity "
        "(points, paired bootstrap 95% CI); *all ρ*: each sample's mean over the ratios above, then paired:",
        "",
        "| ρ | " + " | ".join(f"{a} − {b}" for a, b in PAIRS) + " |",
        "|---:|" + "---:|" * len(PAIRS),
    ]
    pairs = {}

    def cell(a_labels: list[str], b_labels: list[str], name: str) -> str:
        if not all(lab in by for lab in a_labels + b_labels):
            return "–"
        mean = lambda labs, i, f: statistics.mean(f(by[lab][i]) for lab in labs)  # noqa: E731
        acc = lambda r: r["score"]  # noqa: E731
        fid = lambda r: r["extra"]["fidelity"]  # noqa: E731
        d = paired_difference([mean(a_labels, i, acc) for i in ids], [mean(b_labels, i, acc) for i in ids])
        f = paired_difference([mean(a_labels, i, fid) for i in ids], [mean(b_labels, i, fid) for i in ids])
        pairs[name] = {"acc": [d.mean, d.low, d.high, d.significant], "fidelity": [f.mean, f.low, f.high,
                                                                                  f.significant]}
        return f"{_ci(d)}; fid {_ci(f)}"

    for r in ratios:
        cells = [cell([f"{a}@{r}"], [f"{b}@{r}"], f"{a}@{r} - {b}@{r}") for a, b in PAIRS]
        out.append(f"| {r} | " + " | ".join(cells) + " |")
    if len(ratios) > 1:
        cells = [
            cell([f"{a}@{r}" for r in ratios], [f"{b}@{r}" for r in ratios], f"{a} - {b} (all ratios)")
            for a, b in PAIRS
        ]
        out.append("| all ρ | " + " | ".join(cells) + " |")
    claims = {}
    for label in (lab for lab in by if lab.startswith("prophetkv@0.2")):
        scores = [by[label][i]["score"] for i in ids]
        t96 = claim_test(scores, full_scores, 0.96)
        claims[label] = {"vs_96pct": [t96.mean, t96.low, t96.high, t96.significant]}
        out.append("")
        side = "below 96% of full" if t96.high < 0 else "above 96% of full" if t96.low > 0 else "neither"
        out.append(
            f"Claim test, {_display(label)} at ρ = 0.2 vs 96% of full: mean(a − 0.96·full) = "
            f"{_ci(t96)} points ({side} at 95%)."
        )
    summary.append({"pairs": pairs, "claims": claims})
    return out, summary


def _plot(title: str, summary: list[dict], path: Path) -> None:
    import matplotlib

    summary = [s for s in summary if "label" in s]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    full = next((s for s in summary if s["label"] == "full"), None)
    base = next((s for s in summary if s["label"] == "no-recompute"), None)
    for name, color in (("epic", "tab:green"), ("cacheblend", "tab:orange"), ("prophetkv", "tab:blue")):
        pts = sorted(
            (s for s in summary if s["label"].split("@")[0] == name and ":" not in s["label"]),
            key=lambda s: s["ratio"],
        )
        ends = [p for p in (base, *pts, full) if p is not None]
        xs = [0.0 if p is base else 1.0 if p is full else p["ratio"] for p in ends]
        ax.plot(xs, [100 * p["acc"] for p in ends], "o-", color=color, label=name)
        ax.fill_between(
            xs, [100 * p["low"] for p in ends], [100 * p["high"] for p in ends], color=color, alpha=0.12
        )
        ax2.plot(xs, [100 * p["fidelity"] for p in ends], "o-", color=color, label=name)
        ax2.fill_between(
            xs,
            [100 * p.get("fidelity_ci", [p["fidelity"]] * 2)[0] for p in ends],
            [100 * p.get("fidelity_ci", [p["fidelity"]] * 2)[1] for p in ends],
            color=color,
            alpha=0.12,
        )
    ape = next((s for s in summary if s["label"] == "ape"), None)
    if ape:
        err = [[100 * (ape["acc"] - ape["low"])], [100 * (ape["high"] - ape["acc"])]]
        ax.errorbar(
            [0.0], [100 * ape["acc"]], yerr=err, fmt="s", color="tab:purple", label="ape (ρ=0)", capsize=3
        )
        ax2.plot([0.0], [100 * ape["fidelity"]], "s", color="tab:purple", label="ape (ρ=0)")
    n = summary[0]["n"] if summary else 0
    for a, ylabel, sub in (
        (ax, "accuracy % (95% Wilson band)", f"{title}, n={n}: exact answer"),
        (ax2, "fidelity % (95% bootstrap band)", "answer positions = full prefill's argmax"),
    ):
        a.set_xlabel("recompute ratio ρ (0 = no-recompute, 1 = full prefill)")
        a.set_ylabel(ylabel)
        a.set_title(sub, fontsize=10)
        a.set_xscale("symlog", linthresh=0.05)
        a.set_xticks([0, 0.05, 0.1, 0.2, 0.4, 1.0])
        a.set_xticklabels(["0", "0.05", "0.1", "0.2", "0.4", "1"])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(args: argparse.Namespace) -> int:
    lines, summaries = [], {}
    docs_dir = Path(os.environ.get("RAG_REUSE_DOCS", ROOT / "docs" / "results"))
    for model_label, sub, prefix in RUNS:
        for task in ("multidoc_qa_1", "multidoc_qa_2"):
            table, summary = _acc_table(OUT / sub / task if sub else OUT / task, model_label)
            if not table:
                continue
            summaries[f"{model_label}/{task}"] = summary
            png = docs_dir / f"{prefix}-{task}.png"
            _plot(f"{model_label}, {task}", summary, png)
            lines += [f"### {model_label}, {task}", "", *table, "", f"![{task}]({png.name})", ""]
    ttft_path = OUT / "ttft.json"
    if ttft_path.exists():
        data = json.loads(ttft_path.read_text())
        lines += [
            "### TTFT (median over rounds, seconds)",
            "",
            f"threads {data['threads']}; before: `{data['uptime_before']}`; after: `{data['uptime_after']}`",
            "",
            "| docs | tokens | method | recomputed % | fetch | assemble | compute | TTFT | full / method |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for m in sorted({r["num_docs"] for r in data["runs"]}):
            runs = [r for r in data["runs"] if r["num_docs"] == m]
            full = next(r for r in runs if r["method"] == "full-prefill")["median"]["ttft"]
            for r in runs:
                md = r["median"]
                lines.append(
                    f"| {m} | {r['prompt_tokens']} | {r['method']} | {100 * r['recompute_fraction']:.1f} | "
                    f"{md['fetch']:.3f} | {md['assemble']:.3f} | {md['compute']:.3f} | {md['ttft']:.3f} | "
                    f"{full / md['ttft']:.2f}× |"
                )
        entries = [e for e in data.get("store_entries", []) if e["start"] == 0]
        if entries:
            per_tok = statistics.mean(e["nbytes"] / e["n_tokens"] for e in entries)
            per_doc = statistics.mean(e["nbytes"] for e in entries)
            lines += [
                "",
                f"Bytes on disk ({entries[0]['dtype']}): {per_tok / 1024:.1f} KiB per token, "
                f"{per_doc / 2**20:.2f} MiB per document on average ({len(entries)} documents, "
                f"{statistics.mean(e['n_tokens'] for e in entries):.0f} tokens each).",
            ]
        summaries["ttft"] = data["runs"]
    write_json(OUT / "summary.json", summaries)
    (OUT / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
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
