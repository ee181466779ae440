"""The HGMem results page, generated from stored rows (``longlab memory page DIR... --out FILE``).

Per system: accuracy with its 95% Wilson interval, mean wall seconds and generated / prompt tokens per
question (offline work — HGMem's extraction, the KV store's first prefill — spread over the document's
questions), and for HGMem the structured-output failures and the plan decisions. Every "A vs B" is a paired
bootstrap of the per-question score difference on the same questions, marked "not significant" when its
95% interval holds 0.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..errors import LonglabError

__all__ = ["load_memory_rows", "page_markdown", "write_page"]


def load_memory_rows(dirs: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """Rows of every results directory (read-only), the newest row per (model, system, task, sample)."""
    from ..eval.store import ResultStore

    rows: dict[tuple, dict[str, Any]] = {}
    for d in dirs:
        with ResultStore(d, readonly=True, what="DIR") as store:
            for r in store.rows():
                key = (r["model"], r["recipe"], r["task"], r["length"], r["sample_id"])
                if key not in rows or str(r["created_at"]) > str(rows[key]["created_at"]):
                    rows[key] = r
    if not rows:
        raise LonglabError("no rows in the given results directories")
    return list(rows.values())


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def page_markdown(
    rows: list[dict[str, Any]], *, title: str, intro: str = "", notes: str = "", reference: str = "hgmem"
) -> str:
    """The page: a table per (model, task, length) and the paired differences against ``reference``."""
    from ..eval.stats import paired_difference, score_estimate
    from .hgmem import instructions_note

    out = [f"# {title}", ""] if title else []
    if intro:
        out += [intro.strip(), ""]
    cells = sorted({(r["model"], r["task"], r["length"]) for r in rows}, key=str)
    for model, task, length in cells:
        sel = [r for r in rows if (r["model"], r["task"], r["length"]) == (model, task, length)]
        systems = sorted({r["recipe"] for r in sel}, key=lambda s: (s != reference, s))
        out += [
            f"## {model}, {task}, {length} tokens",
            "",
            "| system | accuracy [95% CI] | n | wall s / question | generated tokens / question | "
            "prompt tokens / question |",
            "|---|---|---|---|---|---|",
        ]
        by = {s: {r["sample_id"]: r for r in sel if r["recipe"] == s} for s in systems}
        for s in systems:
            rs = list(by[s].values())
            est = score_estimate([float(r["score"]) for r in rs])
            ex = [r["extra"] or {} for r in rs]
            gen = _mean([float(e.get("generated_per_question") or 0) for e in ex])
            prompt = _mean([float(e.get("prompt_per_question") or 0) for e in ex])
            wall = _mean([float(e.get("wall_per_question_s") or 0) for e in ex])
            out.append(
                f"| {s} | {est.mean:.3f} [{est.low:.3f}, {est.high:.3f}] | {est.n} | {wall:.1f} | "
                f"{gen:.0f} | {prompt:.0f} |"
            )
        out.append("")
        if reference in by:
            out += [
                f"Paired differences, {reference} minus each system, on the same questions (bootstrap "
                f"95% CI):",
                "",
                "| comparison | difference [95% CI] | n | verdict |",
                "|---|---|---|---|",
            ]
            for s in systems:
                if s == reference:
                    continue
                common = sorted(set(by[reference]) & set(by[s]))
                if not common:
                    continue
                d = paired_difference(
                    [float(by[reference][i]["score"]) for i in common],
                    [float(by[s][i]["score"]) for i in common],
                )
                verdict = (
                    "not significant"
                    if not d.significant
                    else f"{reference} {'better' if d.mean > 0 else 'worse'} (significant)"
                )
                out.append(
                    f"| {reference} - {s} | {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] | {d.n} | {verdict} |"
                )
            out.append("")
            hg = [r["extra"] or {} for r in by[reference].values()]
            if hg and "trace" in hg[0]:
                decisions = Counter(step.get("decision", "?") for e in hg for step in e["trace"]["rounds"])
                docs = {e.get("doc"): e for e in hg}
                chunks = sum(int(e.get("chunks") or 0) for e in docs.values())
                failed = sum(int(e.get("extract_failures") or 0) for e in docs.values())
                ents = sum(int(e.get("entities") or 0) for e in docs.values())
                points = _mean([float(e["trace"].get("points", 0)) for e in hg])
                jf = sum(int(e["trace"].get("json_failures", 0)) for e in hg)
                constrained = Counter(str(e.get("constrained")) for e in hg)
                note = instructions_note(
                    (int(e.get("hgmem_prompts", 1)) for e in hg),
                    sum(int(e["trace"].get("instruction_copies", 0)) for e in hg),
                )
                out += [
                    f"{reference} internals: extraction gave no valid JSON for {failed} of {chunks} chunks "
                    f"({ents} entities in the graphs of {len(docs)} documents); loop calls without a valid "
                    f"JSON reply after retries: {jf}; plan decisions over all rounds: "
                    f"{', '.join(f'{k} {v}' for k, v in sorted(decisions.items()))}; memory points at "
                    f"answer time: {points:.1f} on average; grammar-constrained decoding: "
                    f"{', '.join(f'{k} x{v}' for k, v in sorted(constrained.items()))} (False: parse and "
                    f"retry); {note}.",
                    "",
                ]
    if notes:
        out += [notes.strip(), ""]
    return "\n".join(out)


def write_page(
    dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *, title: str, intro: str = "", notes: str = ""
) -> str:
    """Generate the page from the rows of ``dirs`` and write it to ``out`` (a Markdown file)."""
    from ..safeio import write_file_atomic

    text = page_markdown(load_memory_rows(dirs), title=title, intro=intro, notes=notes)
    write_file_atomic(out, text, "--out")
    return text
