"""The generated blocks of the memory-system pages (issue #31): ``docs/results/memory-hgmem.md``,
``docs/results/memory-cdic.md`` and ``docs/results/memory-persistbench.md``.

Each reads one committed results store (``results.sqlite.gz``, slimmed by ``bench/memory_docs.py
--export``): ``bench/results/memory-hgmem`` (``longlab memory eval`` rows), ``bench/results/memory_cdic``
(``longlab memory cdic eval``) and ``bench/results/memory_persist`` (``longlab memory persist safety``).
Tables carry 95% intervals (Wilson for a rate, percentile bootstrap for a difference); "A vs B" on the same
questions is a paired bootstrap and reads "not significant" when its interval holds 0. The verdict lines
(does the paper's claim reproduce here) are computed from the same rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "HGMEM_DIR",
    "MEMORY_GENERATORS",
    "CDIC_DIR",
    "PERSIST_DIR",
    "cdic_verdicts",
    "hgmem_verdicts",
    "persist_verdicts",
    "render_cdic",
    "render_hgmem",
    "render_persist",
]

HGMEM_DIR = "bench/results/memory-hgmem"
CDIC_DIR = "bench/results/memory_cdic"
PERSIST_DIR = "bench/results/memory_persist"


def _has_store(d: Path) -> bool:
    return (d / "results.sqlite").is_file() or (d / "results.sqlite.gz").is_file()


def _missing(d: str) -> str:
    return f"No committed results in `{d}` yet: nothing was measured for this page."


def _verdicts_and_report(root: Path, rel: str, block: str, verdicts: Any, report: Any) -> dict[str, str]:
    """Block ``block``: the verdict lines computed from the store ``root/rel``, then its report tables."""
    d = root / rel
    if not _has_store(d):
        return {block: _missing(rel)}
    text = "### Verdicts (computed from the stored rows)\n\n" + "\n".join(verdicts(d))
    return {block: text + "\n\n" + report(str(d)).strip()}


def diff_independent(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` of two independent samples with its 95% percentile-bootstrap interval
    (10,000 resamples of each, ``seed``)."""
    g = np.random.default_rng(seed)
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    d = xa[g.integers(0, len(xa), (10_000, len(xa)))].mean(1) - xb[
        g.integers(0, len(xb), (10_000, len(xb)))
    ].mean(1)
    return float(xa.mean() - xb.mean()), float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))


def _pp(m: float, lo: float, hi: float) -> str:
    return f"{100 * m:+.1f} pp [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _pct(e: Any) -> str:
    return f"{100 * e.mean:.1f}% [{100 * e.low:.1f}, {100 * e.high:.1f}] (n = {e.n})"


# ------------------------------------------------------------------------------------------------ HGMem
def hgmem_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The claim (HGMem answers multi-hop questions better than RAG) checked on the stored rows: HGMem
    minus top-k RAG and minus the whole document, paired on the same questions."""
    from ..stats import paired_difference, score_estimate

    by: dict[str, dict[str, float]] = {}
    for r in rows:
        by.setdefault(r["recipe"], {})[r["sample_id"]] = float(r["score"])
    if "hgmem" not in by:
        return ["- HGMem: no stored rows."]
    out = []

    def vs(other: str) -> Any:
        keys = sorted(set(by["hgmem"]) & set(by.get(other, {})))
        if not keys:
            return None
        return paired_difference([by["hgmem"][k] for k in keys], [by[other][k] for k in keys])

    rag = next((s for s in sorted(by) if s.startswith("rag")), None)
    d = vs(rag) if rag else None
    hg = score_estimate(list(by["hgmem"].values()))
    out.append(f"- HGMem accuracy: {_pct(hg)}.")
    if d is None:
        out.append("- **HGMem beats RAG**: no RAG rows on the same questions; not tested.")
    else:
        verdict = (
            "reproduces (significant)"
            if d.significant and d.mean > 0
            else ("the opposite holds (significant)" if d.significant else "not significant: not reproduced")
        )
        out.append(
            f"- **HGMem beats RAG** (paper: 55% vs 45% on NarrativeQA): HGMem − {rag} = "
            f"{_pp(d.mean, d.low, d.high)} (paired, n = {d.n}): {verdict}."
        )
    full = by.get("context:full")
    if full:
        fe = score_estimate(list(full.values()))
        dd = vs("context:full")
        line = f"- Whole document in context (`context:full`): {_pct(fe)}"
        if dd is not None:
            line += (
                f"; HGMem − context:full = {_pp(dd.mean, dd.low, dd.high)} (paired, n = {dd.n}, "
                f"{'significant' if dd.significant else 'not significant'})"
            )
        out.append(line + ".")
        if fe.high < 0.5:
            out.append(
                "- **The small model is the limit**: with the whole 1k-token document in context the model "
                "answers under half of the two-hop questions (upper 95% bound below 50%), so no memory "
                "system built on it can be expected to; the comparison measures the memory machinery "
                "with a weak reader and extractor, not the paper's setting (GPT-4o / Qwen served by vLLM)."
            )
    return out


def render_hgmem(root: Path, plots: bool) -> dict[str, str]:
    """Blocks ``memory-hgmem-verdict`` and ``memory-hgmem`` (tables per system: accuracy, wall time and
    tokens per question, paired differences against HGMem, HGMem's internals)."""
    from ...memory.report import load_memory_rows, page_markdown

    d = root / HGMEM_DIR
    if not _has_store(d):
        return {"memory-hgmem-verdict": _missing(HGMEM_DIR), "memory-hgmem": _missing(HGMEM_DIR)}
    rows = load_memory_rows([d])
    return {
        "memory-hgmem-verdict": "\n".join(hgmem_verdicts(rows)),
        "memory-hgmem": page_markdown(rows, title="").strip(),
    }


# ------------------------------------------------------------------------------------------------ C-DIC
def cdic_verdicts(d: str | Path) -> list[str]:
    """The spec's three reproduction criteria on the stored rows: flat in d where last-k collapses, beats
    write-once on revised slots (paired), constant per-turn latency."""
    from ..stats import paired_difference, score_estimate
    from ..store import ResultStore

    with ResultStore(d, readonly=True) as st:
        rows = st.rows(method="cdic")
    acc = [r for r in rows if r["task"] == "dialogue_threads"]
    lat = [r for r in rows if r["task"] == "dialogue_threads/latency"]

    def scores(system: str, pred: Any) -> dict[tuple[int, str], float]:
        return {(r["seed"], r["sample_id"]): r["score"] for r in acc if r["recipe"] == system and pred(r)}

    dists = sorted({r["length"] for r in acc})
    lo_d, hi_d = dists[0], dists[-1]
    c = diff_independent(
        list(scores("cdic", lambda r: r["length"] == hi_d).values()),
        list(scores("cdic", lambda r: r["length"] == lo_d).values()),
    )
    k = diff_independent(
        list(scores("lastk", lambda r: r["length"] == hi_d).values()),
        list(scores("lastk", lambda r: r["length"] == lo_d).values()),
    )
    flat = c[1] <= 0 <= c[2] or c[1] > 0
    collapse = k[2] < 0
    a5 = score_estimate(list(scores("cdic", lambda r: r["length"] == lo_d).values()))
    out = [
        f"- **Flat in d where last-k collapses**: C-DIC acc(d={hi_d}) − acc(d={lo_d}) = {_pp(*c)}; last-k "
        f"{_pp(*k)}. C-DIC accuracy at d = {lo_d} is {_pct(a5)}. Flat: {'yes' if flat else 'no'}; last-k "
        f"collapses: {'yes' if collapse else 'no'}"
        + (" — but flat at a low level is not a reproduction" if flat and a5.mean < 0.5 else "")
        + "."
    ]
    sa, sb = scores("cdic", lambda r: r["depth"] >= 1), scores("writeonce", lambda r: r["depth"] >= 1)
    keys = sorted(set(sa) & set(sb))
    dd = paired_difference([sa[x] for x in keys], [sb[x] for x in keys])
    beats = "yes (significant)" if dd.significant and dd.mean > 0 else "not significant / no"
    out.append(
        f"- **Beats write-once on revised slots**: C-DIC − write-once = {_pp(dd.mean, dd.low, dd.high)} "
        f"(paired, n = {len(keys)}): {beats}."
    )
    if lat:

        def med(system: str, t: int) -> float:
            v = sorted(r["decode_s"] for r in lat if r["recipe"] == system and r["length"] == t)
            return v[len(v) // 2]

        turns = sorted({r["length"] for r in lat})
        rc = med("cdic", turns[-1]) / med("cdic", turns[0])
        rf = med("full", turns[-1]) / med("full", turns[0])
        out.append(
            f"- **Constant per-turn latency**: C-DIC turn {turns[-1]} / turn {turns[0]} = {rc:.2f}x; full "
            f"history (re-reading) {rf:.2f}x: {'yes' if rc < 1.5 else 'no'}."
        )
    return out


def render_cdic(root: Path, plots: bool) -> dict[str, str]:
    """Block ``memory-cdic``: the verdicts and the tables of ``longlab memory cdic report``."""
    from ...memory.cdic import cdic_report

    return _verdicts_and_report(root, CDIC_DIR, "memory-cdic", cdic_verdicts, cdic_report)


# ------------------------------------------------------------------------------------------- PersistBench
def persist_verdicts(d: str | Path) -> list[str]:
    """Per model: leakage with vs without memories (paired), and sycophancy flips vs leaks; where HGMem
    rows exist (recipe ``hgmem-memories``), their rates (Wilson) and the paired differences to the raw
    memories (and, for leakage, to no memories) on the same items, and the failures split by whether the
    item's marker / false belief reached one of HGMem's points."""
    from ..stats import paired_difference, score_estimate
    from ..store import ResultStore

    with ResultStore(d, readonly=True) as st:
        rows = st.rows(method="memory_safety")
    out = []
    for m in sorted({r["model"] for r in rows}):

        def sel(task: str, recipe: str, m: str = m) -> dict[str, dict[str, Any]]:
            return {
                r["sample_id"]: r
                for r in rows
                if r["model"] == m and r["task"] == task and r["recipe"] == recipe
            }

        lw, lo = sel("memory_safety/leakage", "memories"), sel("memory_safety/leakage", "no-memories")
        sw = sel("memory_safety/sycophancy", "memories")
        if not lw or not sw:
            out.append(f"- {m}: incomplete (leakage n = {len(lw)}, sycophancy n = {len(sw)}).")
            continue
        keys = sorted(set(lw) & set(lo))
        dl = paired_difference([float(lw[k]["score"]) for k in keys], [float(lo[k]["score"]) for k in keys])
        flip = [float(r["extra"]["flip"]) for r in sw.values()]
        dd = diff_independent(flip, [float(r["score"]) for r in lw.values()])
        out.append(
            f"- {m}: leak rate with − without memories = {_pp(dl.mean, dl.low, dl.high)} "
            f"(paired, n = {dl.n}, "
            f"{'significant' if dl.significant else 'not significant'}); sycophancy flip rate − leak rate = "
            f"{_pp(*dd)}: sycophancy fails {'more than' if dd[1] > 0 else 'not significantly more than'} "
            f"leakage."
        )
        hl = sel("memory_safety/leakage", "hgmem-memories")
        hs = sel("memory_safety/sycophancy", "hgmem-memories")
        for what, h, raw, key in (("leak rate", hl, lw, "score"), ("sycophancy flip rate", hs, sw, "flip")):
            common = sorted(set(h) & set(raw))
            if not common:
                continue

            def val(r: dict[str, Any], key: str = key) -> float:
                return float(r["score"] if key == "score" else r["extra"][key])

            via, plain = [val(h[k]) for k in common], [val(raw[k]) for k in common]
            dh = paired_difference(via, plain)
            pts = np.mean([h[k]["extra"]["hgmem"]["points"] for k in common])
            carried = "points_with_marker" if key == "score" else "points_with_belief"
            share = np.mean([float(h[k]["extra"].get(carried, 0) > 0) for k in common])
            versus_none = ""
            if key == "score" and set(common) <= set(lo):  # leakage also pairs with the no-memory answers
                dn = paired_difference(via, [val(lo[k]) for k in common])
                versus_none = (
                    f"; HGMem − no memories = {_pp(dn.mean, dn.low, dn.high)} "
                    f"({'significant' if dn.significant else 'not significant'})"
                )
            sig = "significant" if dh.significant else "not significant"
            split = ""
            if 0 < share < 1:  # where the memory reached a point vs where it did not: the same items, raw
                parts = []
                for name, keep in (("whose points carry it", True), ("whose points do not", False)):
                    ks = [k for k in common if (h[k]["extra"].get(carried, 0) > 0) is keep]
                    parts.append(
                        f"on the {len(ks)} items {name}, {sum(val(h[k]) for k in ks):.0f} through HGMem vs "
                        f"{sum(val(raw[k]) for k in ks):.0f} with the raw memories"
                    )
                split = f" ({'leaks' if key == 'score' else 'flips'} {'; '.join(parts)})"
            out.append(
                f"- {m}, memories through HGMem (the model's own memory points for the query, "
                f"{pts:.1f} points per item on average; {100 * share:.0f}% of items carry the "
                f"{'marker' if key == 'score' else 'false belief'} into a point; "
                f"{_instructions_note([h[k] for k in common])}): {what} "
                f"{_pct(score_estimate(via))} through HGMem vs {_pct(score_estimate(plain))} with the raw "
                f"memories on the same items; HGMem − raw memories = {_pp(dh.mean, dh.low, dh.high)} "
                f"(paired, n = {dh.n}, {sig}){versus_none}{split}."
            )
    return out


def _instructions_note(rows: list[dict[str, Any]]) -> str:
    """:func:`longlab.memory.hgmem.instructions_note` of persist rows (their points and echo counts)."""
    from ...memory.hgmem import instructions_note

    extras = [r.get("extra") or {} for r in rows]
    return instructions_note(
        (int(e.get("hgmem_prompts", 1)) for e in extras),
        sum(int((e.get("hgmem") or {}).get("instruction_copies", 0)) for e in extras),
        [p for e in extras for p in e.get("hgmem_points", [])],
    )


def render_persist(root: Path, plots: bool) -> dict[str, str]:
    """Block ``memory-persistbench``: verdicts and the tables of ``longlab memory persist report``."""
    from ...memory.persist import safety_report

    return _verdicts_and_report(root, PERSIST_DIR, "memory-persistbench", persist_verdicts, safety_report)


def _generators() -> tuple[Any, ...]:
    from .generator import Generator

    return (
        Generator("docs/results/memory-hgmem.md", render_hgmem),
        Generator("docs/results/memory-cdic.md", render_cdic),
        Generator("docs/results/memory-persistbench.md", render_persist),
    )


#: the three memory pages, registered in :data:`longlab.eval.pages.GENERATORS`
MEMORY_GENERATORS = _generators()
