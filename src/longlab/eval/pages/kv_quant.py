"""The generated blocks of ``docs/results/kv-quant.md``: KIVI and PM-KVQ against SnapKV at equal memory on
SmolLM2-135M (issue 10).

Reads the committed results under ``bench/results/``:

* ``kv_quant_2k/results.sqlite.gz``: the ``longlab eval`` store (24 ``niah_single_1`` samples at 2,048
  tokens per recipe); scores ×100 with Wilson intervals, differences paired on the same samples
  (:func:`longlab.eval.stats.paired_difference`) with the exact sign test;
* ``kv_quant_2k/kv_bytes_per_step.json`` (``bench/kv.py quant-steps``: total cache bytes of sample 0 after
  the context, after the question and after each decode step);
* ``kv_quant_2k/pmkvq-L2048-11.71MB.json`` (the calibrated per-layer allocation);
* ``kv_quant_speed.json`` (``bench/kv.py quant-speed``: one run, best of 3).

Verdicts follow :func:`longlab.eval.pages.paired.call`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..stats import paired_difference, score_estimate
from ..store import ResultStore
from .paired import call, fmt_ci, fmt_p, sign_test

__all__ = ["COMMANDS", "PAIRS", "render", "short_recipe"]

ORDER = (
    "full",
    "kivi4",
    "kivi2",
    "pmkvq:budget_mb=17.16",
    "pmkvq:budget_mb=11.71",
    "pmkvq:allocation",
    "snapkv@0.75",
    "snapkv@0.5+kivi4",
)
LABEL = {
    "pmkvq:budget_mb=11.71": "KIVI-2's bytes, uniform",
    "pmkvq:budget_mb=17.16": "KIVI-4's bytes, uniform",
    "pmkvq:allocation": "KIVI-2's bytes, calibrated per layer",
}
# (baseline, method, what the comparison asks)
PAIRS = (
    ("snapkv@0.75", "kivi4", "quantize (KIVI-4) rather than evict 75% (SnapKV)"),
    ("snapkv@0.5+kivi4", "kivi2", "KIVI-2 alone rather than SnapKV 50% + KIVI-4"),
    ("kivi2", "pmkvq:allocation", "PM-KVQ calibrated beats KIVI-2 at KIVI-2's bytes"),
    ("kivi2", "pmkvq:budget_mb=11.71", "PM-KVQ uniform budget against KIVI-2 at KIVI-2's bytes"),
    ("pmkvq:budget_mb=11.71", "pmkvq:allocation", "calibrated against uniform PM-KVQ, same budget"),
    ("kivi4", "pmkvq:budget_mb=17.16", "PM-KVQ uniform against KIVI-4 at KIVI-4's bytes"),
)
_Q = "runs/kv-quant24-2k"
COMMANDS = {
    "2k": (
        f"bench/heavy.sh longlab eval --model smollm2-135m --recipes full,kivi4,kivi2,snapkv@0.75,"
        f"snapkv@0.5+kivi4 --tasks niah_single_1 --lengths 2048 --samples 24 --max-new-tokens 24 --threads 1 "
        f"--out {_Q} --no-report; bench/heavy.sh longlab calibrate pmkvq --model smollm2-135m "
        "--budget-mb 11.71 "
        f"--max-tokens 2150 --samples 4 --sample-tokens 512 --out {_Q}/pmkvq-L2048-11.71MB.json; "
        f"bench/heavy.sh longlab eval --model smollm2-135m --tasks niah_single_1 --lengths 2048 --samples 24 "
        f'--max-new-tokens 24 --threads 1 --out {_Q} --no-report --recipes "pmkvq:budget_mb=11.71,'
        f'pmkvq:budget_mb=17.16,pmkvq:allocation={_Q}/pmkvq-L2048-11.71MB.json"'
    ),
    "steps": (
        "bench/heavy.sh .venv/bin/python bench/kv.py quant-steps --length 2048 --recipes kivi2,kivi4,"
        "pmkvq:budget_mb=11.71,pmkvq:budget_mb=17.16,"
        "pmkvq:allocation=bench/results/kv_quant_2k/pmkvq-L2048-11.71MB.json "
        "--out bench/results/kv_quant_2k/kv_bytes_per_step.json"
    ),
    "speed": (
        "python bench/kv.py quant-speed --lengths 1024,4096,16384 --e2e-lengths 1024,2048 --steps 8 "
        "--repeats 3 "
        "--threads 1 --out bench/results/kv_quant_speed.json"
    ),
}

_ROOT: list[Path] = [Path(".")]


def _res(rel: str) -> Path:
    return _ROOT[0] / "bench" / "results" / rel


def short_recipe(recipe: str) -> str:
    """``pmkvq:allocation=PATH`` -> ``pmkvq:allocation`` (the allocation file's folder differs between the
    eval store and the per-step bytes); other recipes unchanged."""
    return recipe.split("=", 1)[0] if recipe.startswith("pmkvq:allocation=") else recipe


def _code(s: str) -> str:
    return f"`{s}`"


def load_rows() -> dict[str, dict[str, dict[str, Any]]]:
    """recipe (short) -> sample_id -> row of the 2k store (the newest row per sample)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with ResultStore(_res("kv_quant_2k"), readonly=True, what="kv_quant_2k") as store:
        for row in store.iter_rows():
            out.setdefault(short_recipe(row["recipe"]), {})[row["sample_id"]] = row
    return out


def _steps() -> dict[str, list[float]]:
    d = json.loads(_res("kv_quant_2k/kv_bytes_per_step.json").read_text(encoding="utf-8"))
    return {short_recipe(k): v for k, v in d["mib"].items()}


def _ordered(rows: dict[str, Any]) -> list[str]:
    return [r for r in ORDER if r in rows] + sorted(set(rows) - set(ORDER))


def compare(rows: dict[str, dict[str, dict[str, Any]]], base: str, meth: str) -> dict[str, Any]:
    """Paired difference ``meth − base`` (×100) on their common samples, with the sign test."""
    ids = sorted(set(rows[base]) & set(rows[meth]))
    a = [rows[meth][i]["score"] for i in ids]
    b = [rows[base][i]["score"] for i in ids]
    d = paired_difference(a, b)
    up = sum(x > y for x, y in zip(a, b))
    down = sum(x < y for x, y in zip(a, b))
    return {
        "diff": [100 * d.mean, 100 * d.low, 100 * d.high],
        "n": d.n,
        "better": up,
        "worse": down,
        "sign_test_p": sign_test(up, down),
    }


def table_scores() -> str:
    rows = load_rows()
    steps = _steps()
    lines = [
        "| recipe | `niah_single_1` ×100 [95% CI] (n) | − `full` [paired 95% CI] | KV MiB after the context "
        "(mean) | KV MiB after the question, sample 0 | KV MiB while decoding, steps 1–6, sample 0 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in _ordered(rows):
        vals = [x["score"] for x in rows[r].values()]
        e = score_estimate(vals)
        mib = statistics.mean(x["kv_bytes_after"] for x in rows[r].values()) / 2**20
        d = "—" if r == "full" else fmt_ci(*compare(rows, "full", r)["diff"], sign=True)
        s = steps.get(r)
        q = f"{s[1]:.1f}" if s else "—"
        dec = f"{min(s[2:]):.1f}–{max(s[2:]):.1f}" if s else "—"
        label = f" ({LABEL[r]})" if r in LABEL else ""
        lines.append(
            f"| {_code(r)}{label} | {fmt_ci(100 * e.mean, 100 * e.low, 100 * e.high)} ({e.n}) | {d} | "
            f"{mib:.1f} | {q} | {dec} |"
        )
    return "\n".join(lines)


def table_pairs() -> str:
    rows = load_rows()
    lines = [
        "| question | method − baseline | [paired 95% CI] ×100 | n | better / worse | sign test p | "
        "verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for base, meth, what in PAIRS:
        if base not in rows or meth not in rows:
            continue
        c = compare(rows, base, meth)
        lines.append(
            f"| {what} | {_code(meth)} − {_code(base)} | {fmt_ci(*c['diff'], sign=True)} | {c['n']} | "
            f"{c['better']} / {c['worse']} | {fmt_p(c['sign_test_p'])} | "
            f"{call(c['diff'][1], c['diff'][2], c['sign_test_p'])} |"
        )
    return "\n".join(lines)


def allocation_line() -> str:
    d = json.loads(_res("kv_quant_2k/pmkvq-L2048-11.71MB.json").read_text(encoding="utf-8"))
    bits = [layer["bits"] for layer in d["layers"]]
    counts = {b: bits.count(b) for b in sorted(set(bits), reverse=True)}
    cal = d["calibration"]
    return (
        f"Calibrated allocation (`pmkvq-L2048-11.71MB.json`, budget {d['budget_mb']} MiB of code words, "
        f"{d['used_mb']:.2f} used, T_max = {d['max_tokens']}): widths per layer, layer 0 first, "
        f"`{''.join(str(b) for b in bits)}` ("
        + ", ".join(f"{n} layers at {b} bits" for b, n in counts.items())
        + f"); calibrated on {cal['samples']} × {cal['sample_tokens']} tokens of `{cal['text']}`, position "
        f"stride {cal['position_stride']}, key smoothing {'on' if cal['smooth'] else 'off'}, "
        f"{cal['seconds']:.0f} s."
    )


def verdicts() -> str:
    """Each claim from its paired rows; the memory claim from the per-step bytes of sample 0."""
    rows = load_rows()
    steps = _steps()

    def fig(base: str, meth: str) -> tuple[str, str]:
        c = compare(rows, base, meth)
        v = call(c["diff"][1], c["diff"][2], c["sign_test_p"])
        return (
            f"{_code(meth)} − {_code(base)} = {fmt_ci(*c['diff'], sign=True)} points (n = {c['n']} paired "
            f"samples, {c['better']} better / {c['worse']} worse, sign test p = {fmt_p(c['sign_test_p'])})"
        ), v

    def outcome(v: str, good: str = "better") -> str:
        return (
            "reproduces"
            if v == f"significantly {good}"
            else ("does not reproduce" if v.startswith("significantly") else f"not shown ({v})")
        )

    out = []

    def mib(r: str) -> str:
        return f"{statistics.mean(x['kv_bytes_after'] for x in rows[r].values()) / 2**20:.1f} MiB"

    f1, v1 = fig("snapkv@0.75", "kivi4")
    f2, v2 = fig("snapkv@0.5+kivi4", "kivi2")
    both = "yes" if v1 == v2 == "significantly better" else "not shown"
    out.append(
        f"- **At similar bytes, spend them on bits rather than on entries: {both}.** KIVI-4 ({mib('kivi4')} "
        f"after the context) against SnapKV keeping 25% ({mib('snapkv@0.75')}): {f1}: {v1}. KIVI-2 "
        f"({mib('kivi2')}) against SnapKV 50% + KIVI-4 ({mib('snapkv@0.5+kivi4')}): {f2}: {v2}."
    )
    f, v = fig("kivi2", "pmkvq:allocation")
    out.append(
        f"- **PM-KVQ (ICLR 2026) beats KIVI-2 at KIVI-2's bytes, with its calibrated allocation: "
        f"{outcome(v)}.** {f}: {v}."
    )
    f, v = fig("kivi2", "pmkvq:budget_mb=11.71")
    out.append(f"- **The same with PM-KVQ's uniform budget: {outcome(v)}.** {f}: {v}.")
    f, v = fig("pmkvq:budget_mb=11.71", "pmkvq:allocation")
    out.append(
        f"- **The calibrated allocation is what makes PM-KVQ work at this budget: {outcome(v)}.** {f}: {v}."
    )
    if "kivi2" in steps and "pmkvq:allocation" in steps:
        k, p = steps["kivi2"], steps["pmkvq:allocation"]
        holds = max(p[2:]) <= min(k[2:])
        out.append(
            "- **PM-KVQ holds no more memory than KIVI-2 while decoding: "
            f"{'yes' if holds else 'no'}** (sample 0, total bytes, deterministic): calibrated PM-KVQ "
            f"{min(p[2:]):.2f}–{max(p[2:]):.2f} MiB over decode steps 1–6 against KIVI-2's "
            f"{min(k[2:]):.2f}–{max(k[2:]):.2f}. **Not at the first token**: after "
            f"the context PM-KVQ holds {p[0]:.2f} MiB (one append at 8 bits) against {k[0]:.2f}, after the "
            f"question {p[1]:.2f} against {k[1]:.2f}."
        )
    out += ["", f"Reproduce: `{COMMANDS['2k']}`; bytes per step: `{COMMANDS['steps']}`."]
    return "\n".join(out)


def _speed() -> dict[str, Any]:
    return json.loads(_res("kv_quant_speed.json").read_text(encoding="utf-8"))


def table_speed() -> str:
    d = _speed()
    hw = d["hardware"]
    load = (hw["loadavg"][0], hw["loadavg_end"][0])
    recipes = ("full", "kivi2", "kivi4", "pmkvq")
    lines = [
        f"One run: {hw['cpu']}, {hw['threads']} thread, torch {hw['torch']}, commit {hw['git_commit']}, "
        f"{hw['date']} UTC, load average {min(load):.1f}–{max(load):.1f}; best of {d['args']['repeats']}; "
        "no interval (n = 1).",
        "",
        f"Decode attention, one layer with SmolLM2 shapes (H = {d['shapes']['H']}, "
        f"H_kv = {d['shapes']['H_kv']}, "
        f"D = {d['shapes']['D']}), one query; `pmkvq` at 2 bits. ms (bytes per cached token):",
        "",
        "| T | " + " | ".join(recipes) + " |",
        "|---:|" + "---:|" * len(recipes),
    ]
    for row in d["decode_attention"]:
        cells = [f"{row[f'{r}_ms']:.2f} ({row[f'{r}_bytes_per_token']:.0f})" for r in recipes]
        lines.append(f"| {row['T']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Quantization cost per layer: converting a full-precision layer (µs per token) and the per-step "
        "`apply` while decoding (ms per step):",
        "",
        "| recipe | T | convert µs / token | apply ms / step |",
        "|---|---:|---:|---:|",
    ]
    for q in d["quantize"]:
        lines.append(
            f"| {_code(q['recipe'])} | {q['T']} | {q['convert_us_per_token']:.0f} | "
            f"{q['decode_apply_us_per_step'] / 1000:.1f} |"
        )
    lines += [
        "",
        f"End to end (SmolLM2, {d['args']['steps']} decode steps after the context):",
        "",
        "| recipe | context | decode ms / token | × full | first step s | KV / fp32 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    full = {e["T"]: e["decode_ms_per_token"] for e in d["end_to_end"] if e["recipe"] == "full"}
    for e in d["end_to_end"]:
        lines.append(
            f"| {_code(e['recipe'])} | {e['T']} | {e['decode_ms_per_token']:.0f} | "
            f"{e['decode_ms_per_token'] / full[e['T']]:.2f} | {e['first_step_s']:.2f} | "
            f"{e['kv_fraction_of_fp32']:.3f} |"
        )
    slower = all(e["decode_ms_per_token"] > full[e["T"]] for e in d["end_to_end"] if e["recipe"] != "full")
    lines += [
        "",
        f"Every quantized cache is {'slower' if slower else 'not always slower'} than the full cache per "
        "decoded "
        "token in this one run (no interval): on this CPU they save memory, not time. Reproduce: "
        f"`{COMMANDS['speed']}`.",
    ]
    return "\n".join(lines)


BLOCKS = {
    "quant-2k-scores": table_scores,
    "quant-2k-pairs": table_pairs,
    "quant-2k-allocation": allocation_line,
    "quant-2k-verdicts": verdicts,
    "quant-speed": table_speed,
}


def render(root: Path, plots: bool) -> dict[str, str]:
    """Every block of :data:`BLOCKS` from ``ROOT/bench/results`` (this page draws no plots)."""
    _ROOT[0] = root
    return {name: make() for name, make in BLOCKS.items()}
