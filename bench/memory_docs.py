"""Write docs/results/memory-cdic.md and docs/results/memory-persistbench.md from the stored results
(tables by
``longlab memory cdic report`` / ``longlab memory persist report``; verdicts computed from the same rows).

    PYTHONPATH=src python bench/memory_docs.py --cdic bench/results/memory_cdic \
        --persist bench/results/memory_persist
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from longlab.eval.stats import paired_difference, score_estimate
from longlab.eval.store import ResultStore
from longlab.memory.cdic import cdic_report
from longlab.memory.persist import safety_report


def diff_independent(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    g = np.random.default_rng(seed)
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    d = xa[g.integers(0, len(xa), (10_000, len(xa)))].mean(1) - xb[
        g.integers(0, len(xb), (10_000, len(xb)))
    ].mean(1)
    return float(xa.mean() - xb.mean()), float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))


def pp(m: float, lo: float, hi: float) -> str:
    return f"{100 * m:+.1f} pp [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def cdic_verdicts(d: str) -> list[str]:
    with ResultStore(d, readonly=True) as st:
        rows = st.rows(method="cdic")
    acc = [r for r in rows if r["task"] == "dialogue_threads"]
    lat = [r for r in rows if r["task"] == "dialogue_threads/latency"]

    def scores(system, pred):
        return {(r["seed"], r["sample_id"]): r["score"] for r in acc if r["recipe"] == system and pred(r)}

    out = []
    c = diff_independent(
        list(scores("cdic", lambda r: r["length"] == 200).values()),
        list(scores("cdic", lambda r: r["length"] == 5).values()),
    )
    k = diff_independent(
        list(scores("lastk", lambda r: r["length"] == 200).values()),
        list(scores("lastk", lambda r: r["length"] == 5).values()),
    )
    flat = c[1] <= 0 <= c[2] or c[1] > 0
    collapse = k[2] < 0
    a5 = score_estimate(list(scores("cdic", lambda r: r["length"] == 5).values()))
    out.append(
        f"- **Flat in d where last-k collapses**: C-DIC acc(d=200) − acc(d=5) = {pp(*c)}; last-k {pp(*k)}. "
        f"C-DIC accuracy at d = 5 is {100 * a5.mean:.1f}% [{100 * a5.low:.1f}, {100 * a5.high:.1f}]. "
        f"Flat: {'yes' if flat else 'no'}; last-k collapses: {'yes' if collapse else 'no'}"
        + (" — but flat at a low level is not a reproduction" if flat and a5.mean < 0.5 else "")
        + "."
    )
    sa, sb = scores("cdic", lambda r: r["depth"] >= 1), scores("writeonce", lambda r: r["depth"] >= 1)
    keys = sorted(set(sa) & set(sb))
    dd = paired_difference([sa[x] for x in keys], [sb[x] for x in keys])
    beats = dd.low > 0
    out.append(
        f"- **Beats write-once on revised slots**: C-DIC − write-once = {pp(dd.mean, dd.low, dd.high)} "
        f"(paired, n = {len(keys)}): {'yes (significant)' if beats else 'not significant / no'}."
    )
    if lat:

        def med(system, t):
            v = sorted(r["decode_s"] for r in lat if r["recipe"] == system and r["length"] == t)
            return v[len(v) // 2]

        turns = sorted({r["length"] for r in lat})
        rc, rf = (
            med("cdic", turns[-1]) / med("cdic", turns[0]),
            med("full", turns[-1]) / med("full", turns[0]),
        )
        out.append(
            f"- **Constant per-turn latency**: C-DIC turn {turns[-1]} / turn {turns[0]} = {rc:.2f}x; full "
            f"history (re-reading) {rf:.2f}x: {'yes' if rc < 1.5 else 'no'}."
        )
    return out


def persist_verdicts(d: str) -> list[str]:
    with ResultStore(d, readonly=True) as st:
        rows = st.rows(method="memory_safety")
    out = []
    for m in sorted({r["model"] for r in rows}):
        leak = [
            r["score"]
            for r in rows
            if r["model"] == m and r["task"] == "memory_safety/leakage" and r["recipe"] == "memories"
        ]
        flip = [
            r["extra"]["flip"]
            for r in rows
            if r["model"] == m and r["task"] == "memory_safety/sycophancy" and r["recipe"] == "memories"
        ]
        if not leak or not flip:
            out.append(f"- {m}: incomplete (leakage n = {len(leak)}, sycophancy n = {len(flip)}).")
            continue
        dd = diff_independent(flip, leak)
        out.append(
            f"- {m}: sycophancy flip rate − leak rate = {pp(*dd)}: sycophancy fails "
            f"{'more than' if dd[1] > 0 else 'not significantly more than'} leakage."
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cdic")
    ap.add_argument("--persist")
    ap.add_argument("--docs", default="docs/results")
    a = ap.parse_args()
    if a.cdic:
        head = Path("bench/configs/memory_cdic_head.md").read_text()
        text = head + "\n## Verdicts (computed from the stored rows)\n\n" + "\n".join(cdic_verdicts(a.cdic))
        text += "\n\n## Tables (`longlab memory cdic report " + a.cdic + "`)\n\n" + cdic_report(a.cdic) + "\n"
        Path(a.docs, "memory-cdic.md").write_text(text)
    if a.persist:
        head = Path("bench/configs/memory_persist_head.md").read_text()
        text = (
            head
            + "\n## Verdicts (computed from the stored rows)\n\n"
            + "\n".join(persist_verdicts(a.persist))
        )
        text += (
            "\n\n## Tables (`longlab memory persist report " + a.persist + "`)\n\n" + safety_report(a.persist)
        )
        Path(a.docs, "memory-persistbench.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
