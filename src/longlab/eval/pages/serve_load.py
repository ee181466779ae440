"""The generated blocks of ``docs/results/serve-load.md``: ``longlab serve`` under load.

Reads what ``bench/serve_load.py`` stored: ``serve_load.json`` (batched vs one request at a time, side by
side; ``serve_load_before.json``: the same before an admission with no other row running stopped being
sliced), ``serve_profile.json`` (``--profile``: prefill per admission, decode step time by rows),
``serve_decode_sweep.json`` (``--decode-sweep``: the decode step time by batch rows),
``serve_budget.json`` (``--budget-only``; or the ``budget`` rows of ``serve_load.json``),
``serve_replicas.json`` (``--replicas``), ``serve_router_*.json`` (``--router``), and
``structured_output.json`` (``bench/structured_output.py``: xgrammar vs llguidance). A file that is absent
renders as one line saying so.

The compute bound of the batched/serial ratio: every request's prefill ``P`` (seconds, one at a time) is
paid in both modes, and batching can only shrink the decode part, ``T`` tokens at ``d_1`` seconds each alone
(one row) against ``d_B / B`` per row in a step of ``B`` rows. So ``ratio <= (P + T d_1) / (P + T d_B / B)
< 1 + T d_1 / P``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = [
    "sweep_table",
    "render",
    "load_table",
    "budget_table",
    "profile_table",
    "replicas_table",
    "router_table",
    "structured_table",
    "compute_bound",
]

MIB = 2**20
LOAD_ARGS = ("model", "tokens", "max_tokens", "requests", "repeats", "modes", "slice_s")


def _read(root: Path, name: str) -> dict[str, Any] | None:
    path = root / "bench" / "results" / name
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _missing(name: str, command: str) -> str:
    return f"Not measured: `bench/results/{name}` is absent (`{command}`)."


def _header(data: dict[str, Any]) -> str:
    hw = data.get("hardware", {})
    return (
        f"{hw.get('cpu', '?')}, {hw.get('cores', '?')} cores, torch threads {hw.get('threads', '?')}, "
        f"load {hw.get('load_avg_1m') or 0:.1f} at the end, commit {hw.get('git_commit', '?')}, "
        f"{hw.get('date', '?')}"
    )


def _args(data: dict[str, Any], keys: tuple[str, ...]) -> str:
    args = data.get("args", {})
    return ", ".join(f"{k} {args[k]}" for k in keys if k in args)


def _row_cells(r: dict[str, Any]) -> str:
    sched = r.get("scheduler")
    split = f"{sched['prefill_s']:.0f} / {sched['decode_s']:.0f} / {sched['other_s']:.1f}" if sched else "-"
    gap = f"{r['max_gap_p50_s']:.1f} / {r['max_gap_p95_s']:.1f}" if "max_gap_p50_s" in r else "-"
    load = f"{r['load_before'][0]:.1f}" if r.get("load_before") else "-"
    seen = sched is not None or r["peak_running"]  # replicas: no in-process scheduler to read
    kv, rows = (f"{r['peak_kv_bytes'] / MIB:.0f}", str(r["peak_running"])) if seen else ("-", "-")
    return (
        f"{r['generated_tokens']} | {r['tokens_per_s']:.2f} | "
        f"{r['ttft_p50_s']:.1f} / {r['ttft_p95_s']:.1f} | "
        f"{r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} | {kv} | "
        f"{rows} | {gap} | {split} | {load} |"
    )


def load_table(data: dict[str, Any]) -> str:
    """One row per repeat, concurrency and mode, then the batched/serial ratios (median over repeats)."""
    lines = [
        f"Run: {_args(data, LOAD_ARGS)}; {_header(data)}.",
        "",
        "| repeat | clients | mode | tokens | tokens/s | TTFT p50 / p95 (s) | latency p50 / p95 (s) "
        "| peak KV (MiB) | peak rows | longest stall p50 / p95 (s) | prefill / decode / other (s) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        lines.append(f"| {r.get('repeat', 0)} | {r['clients']} | {r['mode']} | {_row_cells(r)}")
    keys = ("same_answers_as_serial", "same_answers_as_other_mode")  # the second: runs before --modes
    key = next((k for k in keys if any(k in r for r in data["runs"])), None)
    same = [
        (r["mode"], r["clients"], r[key], r["requests"])
        for r in data["runs"]
        if key and r["mode"] != "serial" and key in r
    ]
    lines.append("")
    ratios = data.get("throughput_ratios") or {"batched": data.get("throughput_ratio", {})}
    for mode, by_clients in ratios.items():
        for n, x in by_clients.items():
            lines.append(f"- {mode} / serial throughput at {n} clients: **{x:.2f}x**")
    if same:
        lines.append(
            "- answers equal to the serial server's (greedy): "
            + ", ".join(f"{mode} {s}/{t} at {n} clients" for mode, n, s, t in same)
        )
    return "\n".join(lines)


def budget_table(rows: list[dict[str, Any]]) -> str:
    """The budget phase: the same requests all-full, then all-snapkv@0.5, under one kv_budget."""
    lines = [
        "| recipe | budget (MiB) | requests | peak rows | rows when the budget refused one "
        "| peak KV held (MiB) | held per row (MiB) | cache after prefill, median (MiB) | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        after = r.get("kv_bytes_after_median", {}).get(r["recipe"])
        after_cell = f"{after / MIB:.1f}" if after else "-"
        refused = r.get("scheduler", {}).get("rows_when_budget_full")
        refused_cell = "-" if refused is None else (str(refused) if refused else "never refused")
        lines.append(
            f"| {r['recipe']} | {r['budget_bytes'] / MIB:.0f} | {r['requests']} | {r['peak_running']} "
            f"| {refused_cell} | "
            f"{r['peak_kv_bytes'] / MIB:.1f} | {r['peak_kv_bytes'] / max(r['peak_running'], 1) / MIB:.1f} "
            f"| {after_cell} | {r['tokens_per_s']:.2f} |"
        )
    by = {r["recipe"]: r for r in rows}
    full, snap = by.get("full"), by.get("snapkv@0.5")
    if full and snap:
        fa = full.get("kv_bytes_after_median", {}).get("full")
        sa = snap.get("kv_bytes_after_median", {}).get("snapkv@0.5")
        per_full = full["peak_kv_bytes"] / max(full["peak_running"], 1)
        per_snap = snap["peak_kv_bytes"] / max(snap["peak_running"], 1)
        lines += [
            "",
            *([f"- snapkv@0.5 / full, cache after prefill: **{sa / fa:.2f}**"] if fa and sa else []),
            f"- snapkv@0.5 / full, KV held per running row at the peak: **{per_snap / per_full:.2f}**",
            f"- rows admitted at once under the same budget: **{snap['peak_running']} vs "
            f"{full['peak_running']}** ({snap['peak_running'] / max(full['peak_running'], 1):.2f}x)",
        ]
    return "\n".join(lines)


def compute_bound(profile: dict[str, Any], rows: int | None = None) -> dict[str, float]:
    """``P`` (prefill s per request, one at a time), ``T`` (tokens per request), ``d_1`` (decode s per
    token alone), ``d_B / B`` at ``B`` rows (the most rows the admit-all sweep reached, or ``rows``) and
    the two bounds of the module docstring."""
    one = profile["one_at_a_time"]
    n = one["requests"]
    p, t = one["prefill_s"] / n, one["generated_tokens"] / n
    d1 = one["decode_s"] / max(one["generated_tokens"] - n, 1)  # the first token comes with the prefill
    by = profile.get("admit_all_then_decode", profile["batched"])["decode_by_rows"]
    b = rows if rows is not None else max(int(k) for k in by)
    per_row = by[str(b)]["per_row_s"]
    return {
        "P": p,
        "T": t,
        "d1": d1,
        "B": b,
        "dB_per_row": per_row,
        "bound_at_B": (p + t * d1) / (p + t * per_row),
        "bound_free_decode": 1 + t * d1 / p,
    }


def profile_table(profile: dict[str, Any]) -> str:
    one, batched = profile["one_at_a_time"], profile["batched"]
    sweep = profile.get("admit_all_then_decode")
    lines = [
        f"Run: {_args(profile, ('model', 'tokens', 'max_tokens', 'clients'))}; {_header(profile)}.",
        "",
        f"One at a time, {one['requests']} requests: prefill {one['prefill_s']:.1f} s, decode "
        f"{one['decode_s']:.1f} s, {one['generated_tokens']} tokens. The scheduler's order (one admission, "
        f"one decode step), {batched['requests']} requests: admissions "
        f"{sum(batched['admissions_s']):.1f} s (median {statistics.median(batched['admissions_s']):.2f} s "
        f"each), decode {batched['decode_s']:.1f} s over {batched['decode_steps']} steps.",
        "",
        "| rows | steps (scheduler order) | step median (ms) | per row (ms) | steps (admit all) "
        "| step median (ms) | per row (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    sw = sweep["decode_by_rows"] if sweep else {}
    for r in sorted({*batched["decode_by_rows"], *sw}, key=int):
        a, b = batched["decode_by_rows"].get(r), sw.get(r)
        left = (
            f"{a['steps']} | {a['step_median_s'] * 1000:.0f} | {a['per_row_s'] * 1000:.0f}"
            if a
            else "- | - | -"
        )
        right = (
            f"{b['steps']} | {b['step_median_s'] * 1000:.0f} | {b['per_row_s'] * 1000:.0f}"
            if b
            else "- | - | -"
        )
        lines.append(f"| {r} | {left} | {right} |")
    c = compute_bound(profile)
    lines += [
        "",
        f"Compute bound: P = {c['P']:.2f} s prefill per request, T = {c['T']:.1f} tokens, d_1 = "
        f"{c['d1'] * 1000:.0f} ms per token alone, d_B / B = {c['dB_per_row'] * 1000:.0f} ms per row at "
        f"B = {c['B']} rows: batched / serial <= (P + T d_1) / (P + T d_B / B) = **{c['bound_at_B']:.2f}x**; "
        f"even free decoding gives at most 1 + T d_1 / P = **{c['bound_free_decode']:.2f}x**. "
        f"Decode alone batches {c['d1'] / c['dB_per_row']:.1f}x at {c['B']} rows.",
    ]
    return "\n".join(lines)


def sweep_table(data: dict[str, Any]) -> str:
    """The decode step time by batch rows (``--decode-sweep``) and the decode throughput gain over a lone
    stream, ``R d_lone / d_R``."""
    lone = data["lone_step_s"]
    cache = data["cache_bytes"]
    lines = [
        f"Run: {_args(data, ('model', 'tokens'))}, prompt {data['prompt_tokens']} tokens, cache "
        f"{cache['full'] / MIB:.1f} MiB full / {cache['snapkv@0.5'] / MIB:.1f} MiB snapkv@0.5; "
        f"{_header(data)}. "
        f"A lone stream (one request decoding alone): **{lone * 1000:.0f} ms** per step.",
        "",
        "| rows | step, all full (ms) | per row (ms) | gain "
        "| step, full + snapkv@0.5 (ms) | per row (ms) | gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, step in sorted(data["step_s_by_rows"].items(), key=lambda kv: int(kv[0])):
        n = int(r)
        cells = " | ".join(
            f"{step[k] * 1000:.0f} | {step[k] / n * 1000:.1f} | {n * lone / step[k]:.1f}x"
            for k in ("full", "mixed")
        )
        lines.append(f"| {r} | {cells} |")
    return "\n".join(lines)


def replicas_table(data: dict[str, Any]) -> str:
    lines = [
        f"Run: {_args(data, ('model', 'tokens', 'max_tokens', 'requests', 'repeats', 'replicas'))}; "
        f"{_header(data)}.",
        "",
        "| repeat | clients | mode | tokens | tokens/s | TTFT p50 / p95 (s) | latency p50 / p95 (s) "
        "| peak KV (MiB) | peak rows | longest stall p50 / p95 (s) | prefill / decode / other (s) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        lines.append(f"| {r.get('repeat', 0)} | {r['clients']} | {r['mode']} | {_row_cells(r)}")
    lines.append("")
    for n, x in data.get("replica_ratio", {}).items():
        lines.append(f"- {data['args']['replicas']} replicas / 1 throughput at {n} clients: **{x:.2f}x**")
    return "\n".join(lines)


def router_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| router policy | workers | requests | repeats on their first worker | workers the first requests "
        "went to | recipe reached the worker | answers equal a direct request |",
        "|---|---|---|---|---|---|---|",
    ]
    for data in results:
        s = data["summary"]
        lines.append(
            f"| {s['policy']} | {s['workers']} | {s['requests']} | {s['repeats_on_first_worker']:.0%} | "
            f"{', '.join(map(str, s['workers_used_by_first_requests']))} | "
            f"{s['recipe_reached_worker']}/{s['requests']} | {s['answers_equal_direct']}/{s['requests']} |"
        )
    return "\n".join(lines)


def structured_table(data: dict[str, Any]) -> str:
    lines = [
        f"{_header(data)}; random walks: {data.get('seeds', '?')} seeds per schema.",
        "",
        "| tokenizer | library | ids / logits | prepare (s) | compile flat / nested / json_object (ms) "
        "| mask per token, median / p95 (ms) | valid JSON, random walk flat | nested (95% CI) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        walks = [r[f"walk_{g}"] for g in ("flat", "nested", "json_object") if f"walk_{g}" in r]
        med = statistics.median(w["mask_ms_median"] for w in walks)
        p95 = max(w["mask_ms_p95"] for w in walks)
        comp = " / ".join(
            f"{r.get(f'compile_ms_{g}', float('nan')):.2f}" for g in ("flat", "nested", "json_object")
        )
        rf, rn = r.get("random_flat", {}), r.get("random_nested", {})

        def rate(x: dict[str, Any]) -> str:
            if not x:
                return "-"
            lo, hi = x["valid_ci95"]
            return f"{x['valid']}/{x['finished']} [{lo:.2f}, {hi:.2f}]"

        lines.append(
            f"| {r['tokenizer']} | {r['library']} {r.get('version', '')} | {r['tokenizer_ids']} / "
            f"{r['model_vocab']} | {r['prepare_s']:.2f} | {comp} | {med:.3f} / {p95:.3f} | {rate(rf)} "
            f"| {rate(rn)} |"
        )
    bad = [
        (r["tokenizer"], r["library"], r["random_nested"]["first_invalid"])
        for r in data["rows"]
        if r.get("random_nested", {}).get("first_invalid")
    ]
    checks = sum(
        w.get("rejected_valid_tokens", 0)
        + w.get("eos_allowed_before_end", 0)
        + w.get("padded_ids_allowed", 0)
        for r in data["rows"]
        for w in (r.get(f"walk_{g}", {}) for g in ("flat", "nested", "json_object"))
    )
    lines += [
        "",
        f"- Walking valid documents token by token: {checks} rejected valid tokens, EOS allowed early or "
        "padded ids allowed, over every tokenizer, library and schema.",
    ]
    for tok, lib, first in bad:
        lines.append(
            f"- First invalid random-walk document, {lib} on {tok} (seed {first['seed']}): `{first['error']}`"
        )
    return "\n".join(lines)


def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's blocks: ``serve-load``, ``serve-load-before``, ``serve-profile``, ``serve-decode-sweep``,
    ``serve-load-decode`` (long answers: ``serve_load_decode_{1k,256}.json``),
    ``serve-budget``, ``serve-replicas``, ``serve-routers``, ``structured-output``."""
    load = _read(root, "serve_load.json")
    before = _read(root, "serve_load_before.json")
    profile = _read(root, "serve_profile.json")
    budget = _read(root, "serve_budget.json")
    replicas = _read(root, "serve_replicas.json")
    sweep = _read(root, "serve_decode_sweep.json")
    structured = _read(root, "structured_output.json")
    decode = [(n, _read(root, f"serve_load_decode_{n}.json")) for n in ("1k", "256")]
    routers = sorted((root / "bench" / "results").glob("serve_router_*.json"))
    budget_rows = (budget or {}).get("budget") or (load or {}).get("budget")
    return {
        "serve-load": load_table(load) if load else _missing("serve_load.json", "bench/serve_load.py"),
        "serve-load-before": load_table(before)
        if before
        else _missing("serve_load_before.json", "bench/serve_load.py before fcddba5"),
        "serve-profile": profile_table(profile)
        if profile
        else _missing("serve_profile.json", "bench/serve_load.py --profile"),
        "serve-decode-sweep": sweep_table(sweep)
        if sweep
        else _missing("serve_decode_sweep.json", "bench/serve_load.py --decode-sweep"),
        "serve-load-decode": "\n\n".join(
            load_table(d) if d else _missing(f"serve_load_decode_{n}.json", "bench/serve_load.py --question")
            for n, d in decode
        ),
        "serve-budget": budget_table(budget_rows)
        if budget_rows
        else _missing("serve_budget.json", "bench/serve_load.py --budget-only"),
        "serve-replicas": replicas_table(replicas)
        if replicas
        else _missing("serve_replicas.json", "bench/serve_load.py --replicas 2"),
        "serve-routers": router_table([json.loads(p.read_text(encoding="utf-8")) for p in routers])
        if routers
        else _missing("serve_router_*.json", "bench/serve_load.py --router POLICY"),
        "structured-output": structured_table(structured)
        if structured
        else _missing("structured_output.json", "bench/structured_output.py"),
    }
