"""The generated tables of ``docs/results/decode-speed.md`` (fused quantized and paged decode kernels).

Reads ``bench/results/decode_speed_fused*.json`` (end to end, ``bench/decode_speed.py``; one run per file,
each on its own host), ``decode_speed_micro*.json`` (kernel only), ``llamacpp_decode.json`` (llama.cpp on
the same GGUF), ``decode_speed_profile*.json`` (where a step's time goes, cProfile) and, when present,
``decode_speed_accuracy.json`` (fused kernel vs the PyTorch path on the same samples).
Ratios are medians over interleaved rounds with their range over rounds (moved from
``bench/decode_speed_report.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["render"]


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

def _fmt_ratio(rounds: list[float] | None, med: float | None) -> str:
    if med is None:
        return "-"
    if not rounds:
        return f"{med:.2f}"
    return f"{med:.2f} [{min(rounds):.2f}, {max(rounds):.2f}]"


def machine(hw: dict | None) -> str:
    """The CPU a figure came from: model, family/model numbers and the SIMD level ATen ran at (files written
    before ``bench/common.py`` recorded them say so: "AMD EPYC" alone names several generations)."""
    if not hw:
        return "machine not recorded"
    simd = hw.get("aten_capability")
    detail = (f"family/model {hw.get('cpu_family_model', '?')}, {simd}" if simd
              else "SIMD level not recorded")
    return f"{hw.get('cpu', '?')} ({detail}), commit {hw.get('git_commit', '?')}, {hw.get('date', '?')[:10]}"


def e2e_tables(data: dict) -> list[str]:
    """One table per run (file) and (length, batch): ratios are side by side within a run only."""
    out = []
    for run in data["runs"]:
        rows = run["rows"]
        for (T, B) in sorted({(r["length"], r["batch"]) for r in rows}):
            mine = [r for r in rows if r["length"] == T and r["batch"] == B]
            up = mine[0].get("uptime", ["", ""])
            out += [f"**{T:,} tokens, batch {B}** (`{run['file']}`; load: "
                    f"{up[0].split('load average:')[-1].strip()} before, "
                    f"{up[1].split('load average:')[-1].strip()} after; {machine(run.get('hardware'))})", "",
                    "| variant | ms / token | / full [range over rounds] | CPU ms / token | CPU / full "
                    "| / sdpa | KV MiB |",
                    "|---|---:|---:|---:|---:|---:|---:|"]
            for r in mine:
                sd = f"{r['ratio_to_sdpa']:.2f}" if r.get("ratio_to_sdpa") else "-"
                cf = f"{r['cpu_ratio_to_full']:.2f}" if r.get("cpu_ratio_to_full") else "-"
                out.append(f"| `{r['variant']}` | {r['ms_per_token']:.1f} | "
                           f"{_fmt_ratio(r.get('ratios_to_full_by_round'), r.get('ratio_to_full'))} | "
                           f"{r['cpu_ms_per_token']:.1f} | {cf} | {sd} | {r['kv_bytes'] / 2**20:.1f} |")
            out.append("")
    return out


def targets(data: dict) -> list[str]:
    """The issue's end-to-end targets, each with its measured ratio, for every run that measured it (a
    ratio is side by side within one run; runs differ in host, commit and load)."""
    out = ["| target | run | wall time: median [range over rounds] | met | CPU time | met (CPU) "
           "| host (SIMD, commit) |",
           "|---|---|---:|:---:|---:|:---:|---|"]

    def line(label: str, file: str, hw: dict | None, r: dict, ref: dict | None, limit: float) -> str:
        if ref is None:  # ratio to full
            wall, rounds, cpu = r["ratio_to_full"], r.get("ratios_to_full_by_round"), r["cpu_ratio_to_full"]
        else:
            wall, rounds = r["ms_per_token"] / ref["ms_per_token"], None
            cpu = r["cpu_ms_per_token"] / ref["cpu_ms_per_token"]
        hw = hw or {}
        host = f"{hw.get('aten_capability', 'not recorded')}, {hw.get('git_commit', '?')}"
        return (f"| {label} | `{file}` | {_fmt_ratio(rounds, wall)} | {'yes' if wall <= limit else 'no'} | "
                f"{cpu:.2f} | {'yes' if cpu <= limit else 'no'} | {host} |")

    found: dict[str, list[str]] = {}
    for run in data["runs"]:
        rows, file, hw = run["rows"], run["file"], run.get("hardware")

        def get(T, B, v, rows=rows):
            return next((r for r in rows if r["length"] == T and r["batch"] == B and r["variant"] == v), None)

        def add(label: str, r: dict, ref: dict | None, limit: float, file=file, hw=hw) -> None:
            found.setdefault(label, []).append(line(label, file, hw, r, ref, limit))

        for B in (1, 4):
            k, f, qn = get(32768, B, "kivi4"), get(32768, B, "full"), get(32768, B, "hf-quanto4")
            if k and f:
                add(f"32k, batch {B}: kivi4 <= 0.6 x full", k, None, 0.6)
            if k and qn:
                add(f"32k, batch {B}: kivi4 <= 0.5 x QuantizedCache (quanto, 4 bits)", k, qn, 0.5)
        for B in (1, 4):
            k = get(8192, B, "kivi4")
            if k:
                add(f"8k, batch {B}: kivi4 no slower than full", k, None, 1.0)
        for q in (r for r in rows if r["length"] == 32768 and r["batch"] == 1
                  and r["variant"].startswith("quest") and "fused=false" not in r["variant"]):
            rule = ("selection=group" if "selection=group" in q["variant"]
                    else "per query head, the paper's rule")
            add(f"32k: Quest with 1/8 of the pages ({rule}) <= 0.5 x full", q, None, 0.5)
    for group in found.values():  # each target's runs together, in file order
        out += group
    return out + [""]


def micro_table(data: dict) -> list[str]:
    out = [f"Copy bandwidth (STREAM-like, 256 MiB, median of {len(data['copy_rounds_gb_per_s'])} rounds): "
           f"**{data['copy_gb_per_s']:.2f} GB/s** (rounds {data['copy_rounds_gb_per_s']}); load "
           f"{[round(x, 2) for x in data['load_avg_1m']]}; {data['threads']} thread(s); per layer, "
           f"{data['n_layers']} layers in turn; {machine(data.get('hardware'))}.", "",
           "| T | kernel | ms / layer | time / sdpa-fp32 | MiB read | GB/s | bytes bound ms "
           "| efficiency (bound / time) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(data["rows"], key=lambda r: (r["length"], r["kernel"])):
        dense = next(x for x in data["rows"] if x["length"] == r["length"] and x["kernel"] == "sdpa-fp32")
        out.append(f"| {r['length']:,} | `{r['kernel']}` | {r['ms_per_layer']:.3f} | "
                   f"{r['ms_per_layer'] / dense['ms_per_layer']:.2f} | "
                   f"{r['bytes'] / 2**20:.2f} | {r['gb_per_s']:.2f} | {r['bound_ms']:.3f} | "
                   f"{r['efficiency']:.2f} |")
    return out + [""]


def llama_table(data: dict, e2e: dict | None) -> list[str]:
    out = [f"llama-cpp-python {data['llama_cpp_python']}, `{data['gguf']}`, {data['threads']} thread(s); "
           f"{machine(data.get('hardware'))}. The longlab columns are the end-to-end rows above from the "
           "first run on the same CPU (family/model), named in the last column.", "",
           "| T | llama.cpp KV | prefill tok/s | decode ms / token | longlab `full` ms / token "
           "| longlab `kivi4` ms / token | longlab run |", "|---:|---|---:|---:|---:|---:|---|"]
    cpu = (data.get("hardware") or {}).get("cpu_family_model")
    for r in data["rows"]:
        T = r["length"]
        run = next((run for run in (e2e or {}).get("runs", [])
                    if (run.get("hardware") or {}).get("cpu_family_model") == cpu
                    and any(x["length"] == T and x["batch"] == 1 for x in run["rows"])), None)

        def ours(v: str, run: dict | None = run, T: int = T) -> str:
            hit = run and next((x for x in run["rows"] if x["length"] == T and x["batch"] == 1
                                and x["variant"] == v), None)
            return f"{hit['ms_per_token']:.1f}" if hit else "-"
        out.append(f"| {T:,} | {r['kv_type']} | {r['prefill_tokens_per_s']:.0f} | "
                   f"{r['decode_ms_per_token']:.1f} | {ours('full')} | {ours('kivi4')} | "
                   f"{'`' + run['file'] + '`' if run else '-'} |")
    return out + [""]


def accuracy_table(data: dict) -> list[str]:
    out = ["| recipe | samples | identical predictions | score fused | score PyTorch path |",
           "|---|---:|---:|---:|---:|"]
    for p in data["pairs"]:
        out.append(f"| `{p['recipe']}` | {p['n']} | {p['identical']} / {p['n']} | {p['score_fused']:.3f} | "
                   f"{p['score_unfused']:.3f} |")
    out.append("")
    if data.get("selections"):
        out += ["Page selection per KV head (`selection=group`) against per query head, same samples "
                "(paired bootstrap 95% interval of the score difference):", "",
                "| recipe | against | samples | identical predictions | score | score (against) "
                "| difference [95% CI] |", "|---|---|---:|---:|---:|---:|---:|"]
        for p in data["selections"]:
            m, lo, hi = p["diff"]
            out.append(f"| `{p['recipe']}` | `{p['baseline']}` | {p['n']} | {p['identical']} / {p['n']} | "
                       f"{p['score']:.3f} | {p['score_baseline']:.3f} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                       f"{'' if p['significant'] else ' n.s.'} |")
        out.append("")
    return out


def profile_table(data: dict) -> list[str]:
    """``decode_speed_profile*.json`` (``bench/decode_speed.py speed --profile``): per variant, the
    cumulative time of the named functions per decode step, under cProfile."""
    args = data.get("args") or {}
    out = [f"{machine(data.get('hardware'))}; {args.get('threads', '?')} thread(s), batch 1, "
           f"{args.get('steps', '?')} steps x {args.get('rounds', '?')} rounds per variant, variants in "
           "turn. The plain step time is measured in the same rounds; the profiled one includes "
           "cProfile's own cost, so shares are of the profiled step.", "",
           "| T | variant | ms / token (plain) | ms / token (profiled) | function | calls / step "
           "| ms / step (cumulative) | share of the profiled step |",
           "|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in data["profiles"]:
        for i, (label, v) in enumerate(sorted(r["named"].items(), key=lambda kv: -kv[1]["cum_ms_per_step"])):
            head = (f"| {r['length']:,} | `{r['variant']}` | {r['ms_per_token']:.1f} | "
                    f"{r['profiled_ms_per_token']:.1f} |" if i == 0 else "| | | | |")
            out.append(f"{head} {label} | {v['calls_per_step']:g} | {v['cum_ms_per_step']:.2f} | "
                       f"{v['cum_ms_per_step'] / r['profiled_ms_per_token']:.0%} |")
    return out + [""]


def _load_e2e(results: Path) -> dict | None:
    """``decode_speed_fused*.json``: one run per file, in file-name order, each with its host."""
    files = sorted(results.glob("decode_speed_fused*.json"))
    runs = []
    for path in files:
        part = json.loads(path.read_text(encoding="utf-8"))
        runs.append({"file": path.name, "hardware": part.get("hardware"), "rows": part["rows"]})
    if not runs:
        return None
    return {"runs": runs}


def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's ``decode-fused`` block."""
    results = root / "bench" / "results"
    llama, acc = (_load(results, n) for n in ("llamacpp_decode.json", "decode_speed_accuracy.json"))
    micros = [(p.name, json.loads(p.read_text(encoding="utf-8")))
              for p in sorted(results.glob("decode_speed_micro*.json"))]
    e2e = _load_e2e(results)
    lines: list[str] = []
    if e2e:
        lines += ["### Targets (end to end)", ""] + targets(e2e)
        lines += ["### End to end: ms per generated token, SmolLM2-135M, one thread", ""] + e2e_tables(e2e)
    if micros:
        lines += ["### Kernel only: achieved bytes/s against the copy bandwidth", ""]
        for name, micro in micros:
            lines += [f"`{name}`:", ""] + micro_table(micro)
    for path in sorted(results.glob("decode_speed_profile*.json")):
        lines += [f"### Where a decode step's time goes (`{path.name}`)", ""]
        lines += profile_table(json.loads(path.read_text(encoding="utf-8")))
    if acc:
        lines += ["### Accuracy: fused kernel vs the PyTorch path, same samples", ""] + accuracy_table(acc)
    if llama:
        lines += ["### llama.cpp on the same GGUF (context)", ""] + llama_table(llama, e2e)
    return {"decode-fused": "\n".join(lines)}
