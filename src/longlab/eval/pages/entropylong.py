"""The generated block of ``docs/results/entropylong.md``: EntropyLong against a ground truth.

Reads ``bench/results/entropylong_truth.json`` (``bench/entropylong_truth.py``: per document, the chunks each
selection keeps and the cards it truly depends on). Precision and recall are pooled over documents, each with
a 95% percentile-bootstrap interval over documents (2,000 resamples, seed 0); verification vs
retrieval-only is a paired bootstrap on the same resampled documents. Moved from
``bench/entropylong_truth.py --report``. The fine-tune comparison (issue 34 item 4) comes from
``bench/results/entropylong_finetune.json`` (``--finetune``: per data variant, task and length, the adapter's
score minus the base model's on the same samples, with a 95% paired-bootstrap interval) when it exists;
until then the page states what was not run, with the LoRA step time measured by ``--time-lora-steps``
(``bench/results/entropylong_lora_timing.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..stats import Difference

__all__ = ["analyse", "finetune_text", "page", "render"]

METHODS = ("verification", "retrieval-only", "random")
SWEEP = (0.5, 1.0, 2.0)  # other deltas, from the stored dH of the same candidates (no rerun)
RESAMPLES = 2000


def _ratio_ci(hits: np.ndarray, den: np.ndarray, idx: np.ndarray) -> tuple[float, float, float]:
    point = hits.sum() / den.sum() if den.sum() else float("nan")
    h, d = hits[idx].sum(1), den[idx].sum(1)  # [R]
    stats = np.where(d > 0, h / np.maximum(d, 1), np.nan)
    lo, hi = np.nanquantile(stats, [0.025, 0.975])
    return float(point), float(lo), float(hi)


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    n = len(rows)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, size=(RESAMPLES, n))  # the same resampled documents for every method
    truth = np.array([r["truth"] for r in rows], dtype=float)
    out: dict[str, Any] = {"docs": n}
    for m in METHODS + tuple(f"delta={d:g}" for d in SWEEP):
        hits = np.array([r[f"{m}_hits"] for r in rows], dtype=float)
        sel = np.array([r[f"{m}_selected"] for r in rows], dtype=float)
        out[m] = {"precision": _ratio_ci(hits, sel, idx), "recall": _ratio_ci(hits, truth, idx),
                  "selected_per_doc": float(sel.mean())}
    # paired: verification - retrieval-only, on the same resampled documents
    hv = np.array([r["verification_hits"] for r in rows], dtype=float)
    sv = np.array([r["verification_selected"] for r in rows], dtype=float)
    hr = np.array([r["retrieval-only_hits"] for r in rows], dtype=float)
    sr = np.array([r["retrieval-only_selected"] for r in rows], dtype=float)
    for metric, (a_num, a_den, b_num, b_den) in {
        "precision": (hv, sv, hr, sr), "recall": (hv, truth, hr, truth),
    }.items():
        a = a_num[idx].sum(1) / np.maximum(a_den[idx].sum(1), 1)
        b = b_num[idx].sum(1) / np.maximum(b_den[idx].sum(1), 1)
        d = a - b
        point = (a_num.sum() / max(a_den.sum(), 1)) - (b_num.sum() / max(b_den.sum(), 1))
        lo, hi = np.quantile(d, [0.025, 0.975])
        p = min(1.0, 2 * min((d <= 0).mean(), (d >= 0).mean()))
        out[f"paired_{metric}"] = (float(point), float(lo), float(hi), float(p))
    deps = np.array([r["dependencies"] for r in rows], dtype=float)
    for key in ("value_flagged", "sentence_flagged"):
        out[key] = _ratio_ci(np.array([r[key] for r in rows], dtype=float), deps, idx)
    return out


def _fmt(t: tuple[float, ...]) -> str:
    return f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"


def page(result: dict[str, Any], timing: dict[str, Any] | None = None,
         finetune: dict[str, Any] | None = None) -> str:
    a = analyse(result)
    cfg, size = result["config"], result["size"]
    lines = [
        "EntropyLong (Jia et al., arXiv 2510.02330) keeps a retrieved chunk only when prepending it lowers "
        "the scorer's next-token entropy at a document's uncertain positions by at least delta. On web text "
        "nobody knows which chunks are right; on `longlab data groundtruth` corpora (entity cards with "
        "invented attributes, documents that use an attribute later without restating it) every dependent "
        "value has one true source card, so the kept chunks can be scored.",
        "",
        f"Size run: **{size['docs']} documents, {size['cards']} cards** (seed {size['seed']}), scorer "
        f"`{result['scorer']}`, retriever `{cfg['retriever']}`, alpha {cfg['alpha']}, merge gap "
        f"{cfg['merge_gap']}, query {cfg['query_tokens']} tokens, top-k {cfg['top_k']}, chunks of "
        f"{cfg['chunk_tokens']} tokens (a card is one chunk), delta {cfg['delta']}. " + _size_note(result),
        "",
        "Precision and recall are pooled over documents (sum of hits / sum of selected, / sum of true "
        "cards); "
        f"[95% percentile bootstrap over documents, {RESAMPLES} resamples]. `random`: as many chunks as "
        "retrieval-only, uniformly from the pool.",
        "",
        "| selection | precision | recall | chunks per document |",
        "|---|---|---|---|",
    ]
    for m in METHODS + tuple(f"delta={d:g}" for d in SWEEP):
        if m.startswith("delta="):
            label = f"verification, delta {m[6:]} (same candidates)"
        elif m == "verification":
            label = f"verification, delta {cfg['delta']:g} (paper)"
        else:
            label = m
        lines.append(f"| {label} | {_fmt(a[m]['precision'])} | {_fmt(a[m]['recall'])} | "
                     f"{a[m]['selected_per_doc']:.2f} |")
    pp, pr = a["paired_precision"], a["paired_recall"]

    def verdict(t: tuple[float, ...]) -> str:
        return "significant" if t[1] > 0 or t[2] < 0 else "not significant"

    def pval(p: float) -> str:
        return f"< {1 / RESAMPLES:g}" if p == 0 else f"= {p:.3g}"

    raised = pp[1] > 0
    claim = ("verification raises precision (significant)" if raised else
             "verification does **not** raise precision here" + (" (it lowers it, significant)" if pp[2] < 0
                                                                  else " (difference not significant)"))
    lines += [
        "",
        "Paired (verification - retrieval-only, same resampled documents):",
        "",
        f"- precision {pp[0]:+.3f} [{pp[1]:+.3f}, {pp[2]:+.3f}], bootstrap p {pval(pp[3])}: {verdict(pp)};",
        f"- recall {pr[0]:+.3f} [{pr[1]:+.3f}, {pr[2]:+.3f}], bootstrap p {pval(pr[3])}: {verdict(pr)}.",
        "",
        "Reading: the paper's claim (verification raises precision sharply at a small recall cost) — "
        f"{claim}, and recall changes by {pr[0]:+.3f}. Both selections are far above random.",
        "",
        "What the entropy threshold flags (share of dependent values, same intervals): the position before "
        f"the value's first token {_fmt(a['value_flagged'])}; any position of the sentence that uses the "
        f"value (the entity's invented name included) {_fmt(a['sentence_flagged'])}.",
        "",
        f"Command ({result['hardware']['cpu']}, 1 thread, load {result['hardware']['load_avg_1m']:.1f} at "
        f"the end, commit {result['hardware']['git_commit']}, {result['hardware']['date']}; "
        f"{result['seconds']:.0f} s):",
        "",
        "```bash",
        result["command"],
        ".venv/bin/python bench/entropylong_truth.py --report   # this page from the stored JSON",
        "```",
        "",
        *finetune_text(result, timing, finetune),
    ]
    return "\n".join(lines)


def _full_size(result: dict[str, Any]) -> bool:
    size = result["size"]
    return (size["docs"], size["cards"]) == (size["issue_size"]["docs"], size["issue_size"]["cards"])


def _size_note(result: dict[str, Any]) -> str:
    """Whether the run has the issue's size, and its time per document (on one core)."""
    per = f"{result['seconds_per_doc']} s per document on one core"
    if _full_size(result):
        resumed = result.get("resumed_docs") or 0
        piece = f" (the last piece, resumed after {resumed} documents)" if resumed else ""
        return f"This is the issue's size; {per}{piece}."
    issue = result["size"]["issue_size"]
    return (f"The issue's size ({issue['docs']} documents, {issue['cards']} cards) was **not run** "
            f"({per} here).")


def finetune_reading(finetune: dict[str, Any]) -> list[str]:
    """The verdict on item 4, counted from the stored cells: how many adapter - base and verification -
    other differences are significant, in which direction, and the cells where no model can move (every
    model scores 0 on every sample, or 1 on every sample: floor or ceiling)."""
    cells, pairs = finetune["cells"], finetune.get("pairs") or []

    def count(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
        up = sum(1 for c in rows if _sig(c) == "significant" and c["diff"] > 0)
        down = sum(1 for c in rows if _sig(c) == "significant" and c["diff"] < 0)
        return up, down, len(rows) - up - down

    up, down, flat = count(cells)
    pup, pdown, pflat = count(pairs)
    bounded = sorted({(c["task"], c["length"]) for c in cells if c["base"] in (0.0, 1.0)
                      and all(o["adapter"] == c["base"] for o in cells
                              if (o["task"], o["length"]) == (c["task"], c["length"]))})
    if up == 0 and down == 0:
        verdict = (f"**this fine-tune shows nothing**: none of the {len(cells)} adapter - base "
                   "differences is significant")
        scope = "a null result here does not rule out an effect"
    elif up == 0:
        verdict = (f"**no data variant helps**: none of the {len(cells)} adapter - base differences is "
                   f"significantly above 0, {down} {'is' if down == 1 else 'are'} significantly below; "
                   f"{flat} not significant")
        scope = "they say nothing about the effect"
    else:
        verdict = (f"of the {len(cells)} adapter - base differences, **{up} significantly above 0 and {down} "
                   f"below**; {flat} not significant")
        scope = "they say nothing about the effect"
    text = (f"Reading: {verdict}. Verified data against the other variants' data: {pup} significantly "
            f"better, {pdown} worse, {pflat} not significant (of {len(pairs)}).")
    if bounded:
        text += (" Where the base model and every adapter score 0 or 1 on every sample ("
                 + ", ".join(f"{t} at {n}" for t, n in bounded)
                 + "), the cell cannot show a difference either way.")
    text += (" These are the issue's sizes (about 300 LoRA steps of a 135M model at 2k tokens, "
             f"{finetune['size']['samples']} samples per cell); {scope} of longer training or a larger "
             "model.")
    return [text, ""]


def _sig(c: dict[str, Any]) -> str:
    """A stored paired difference's verdict, by the one rule (``Difference.significant``)."""
    d = Difference(mean=c["diff"], low=c["low"], high=c["high"], n=c["n"])
    return "significant" if d.significant else "not significant"


def _loss(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def finetune_text(result: dict[str, Any], timing: dict[str, Any] | None,
                  finetune: dict[str, Any] | None) -> list[str]:
    """The page's lines on item 4 (does the data help?): the stored comparison, or what was not run and
    the measured time it would take."""
    run = ".venv/bin/python bench/entropylong_truth.py --finetune"
    if finetune:
        size = finetune["size"]
        lines = [
            "## Does the data help? (LoRA fine-tunes)",
            "",
            f"`{finetune['model']}` + a LoRA adapter (rank 8, q/k/v/o) trained {size['steps']} steps at "
            f"{size['seq_len']} tokens on each data variant of a {size['docs']}-document ground-truth "
            "corpus, minus the base model, on the same samples (`longlab eval`, recipe `full`); [95% paired "
            f"bootstrap]; {size['samples']} samples per task and length.",
            "",
            "| data variant | task | length | n | adapter | base | adapter - base | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in finetune["cells"]:
            lines.append(f"| {c['variant']} | {c['task']} | {c['length']} | {c['n']} | {c['adapter']:.3f} | "
                         f"{c['base']:.3f} | {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] | "
                         f"{_sig(c)} |")
        pairs = finetune.get("pairs") or []
        if pairs:
            lines += ["", "Verified data against the other variants' data (the two adapters on the same "
                      "samples, [95% paired bootstrap]):", "",
                      "| adapters | task | length | n | difference | |", "|---|---|---|---|---|---|"]
            for c in pairs:
                lines.append(f"| {c['variant']} - {c['other']} | {c['task']} | {c['length']} | {c['n']} | "
                             f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] | {_sig(c)} |")
        lines += ["", *finetune_reading(finetune)]
        training = finetune.get("training") or {}
        if training:
            lines += ["", "Training (from each adapter's record): language-model loss on the held-out "
                      "sequences before and after, and the time per step on the machine that trained it.", "",
                      "| data variant | steps | held-out sequences | held-out loss before | after | "
                      "training loss, first 10% | last 10% | s per step |",
                      "|---|---|---|---|---|---|---|---|"]
            for v, t in training.items():
                lines.append(f"| {v} | {t['steps_done']} | {t.get('heldout_sequences', '?')} | "
                             f"{_loss(t['heldout_loss_before'])} | {_loss(t['heldout_loss_after'])} | "
                             f"{_loss(t['loss_first_10pct'])} | {_loss(t['loss_last_10pct'])} | "
                             f"{t['seconds_per_step']:.1f} |")
        lines += ["", "```bash", finetune["command"], "```", ""]
        if not _full_size(result):
            lines += ["Not done here: the issue's full size (500 documents, 5k cards).", ""]
        return lines
    missing = "" if _full_size(result) else "the issue's full size (500 documents, 5k cards), and "
    lines = [f"Not done here: {missing}the fine-tune comparison (item 4: ~300 LoRA steps of SmolLM2 at 2k "
             "tokens on each of the three data variants, then vt and niah at 2k and 4k against the base "
             "model)."]
    if timing:
        per, steps = timing["seconds_per_step"], timing["steps_estimated"]
        hours = per * steps / 3600
        build = result["seconds_per_doc"] * 200 / 3600
        hw = timing["hardware"]
        lines[0] += (
            " It is too long for one working session here, so it runs across sessions and resumes from its "
            "committed state (`bench/state/entropylong_ft`, `bench/state/README.md`); its table appears "
            "here when all four models are evaluated. Its cost, timed on one of this project's hosts: one "
            f"LoRA step of `{timing['model']}` at "
            f"{timing['seq_len']} tokens (rank 8, q/k/v/o, batch 1, fp32, one thread) took **{per:.1f} s** "
            f"(median of the steps after the first; {', '.join(f'{x:.1f}' for x in timing['step_seconds'])} "
            f"s; peak RSS {timing['peak_rss_gib']:.1f} GiB; {hw['cpu']}, load {hw['load_avg_1m']:.1f}), so "
            f"{steps} steps take about **{hours:.1f} h per data variant, {3 * hours:.1f} h for the three**, "
            f"before building the data (verification at {result['seconds_per_doc']} s per document: "
            f"~{build:.1f} h for 200 documents; the baselines skip the dH prefill) and the evaluations "
            "(not timed)."
        )
        merge = timing.get("merge_check")
        if merge:
            lines[0] += (f" The timed adapter, saved and loaded back as `longlab eval --model DIR` loads it, "
                         f"merged into {merge['modules']} projections (logits moved by up to "
                         f"{merge['max_logit_change']:.2f} from the base model's).")
        lines += ["", "```bash", f"{timing['command']}   # the step time above", "```"]
    lines += [
        "",
        "The comparison is one command (each step a `longlab` command that resumes; `--dry-run` lists them: "
        "`longlab data entropylong --selection verification|retrieval|random`, `longlab train lora`, "
        "`longlab eval --model DIR` with the adapter merged); its table appears here once "
        "`bench/results/entropylong_finetune.json` exists:",
        "",
        "```bash",
        f"bench/heavy.sh {run}",
        "```",
        "",
    ]
    return lines


def render(root: Path, plots: bool) -> dict[str, str]:
    """The page's ``entropylong`` block."""
    results = root / "bench" / "results"
    extra = []
    for name in ("entropylong_lora_timing.json", "entropylong_finetune.json"):
        path = results / name
        extra.append(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None)
    truth = json.loads((results / "entropylong_truth.json").read_text(encoding="utf-8"))
    return {"entropylong": page(truth, *extra)}
