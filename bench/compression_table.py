"""The equal-memory table for context compression (issue #13), from a ``longlab eval`` results dir.

    .venv/bin/python bench/compression_table.py DIR [DIR ...] --out docs/results/compression

For each task: accuracy (mean score, 95% CI: Wilson for pass/fail) of every method at each removed
fraction r (kept KV memory 1 - r of the full cache: a context compressor keeps ``ceil((1-r) n)`` context
tokens, a KV policy ``ceil((1-r) n)`` entries per head), on the same samples; a paired bootstrap of each
method against SnapKV at the same r (and against the full cache); the compression step's own time
(``extra.context_s``) against the prefill time it saves (full prefill minus the method's prefill, paired
per sample, medians). Writes ``DIR/compression_table.md`` (or ``--out``.md) and a plot (``--out``.png).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from longlab.eval.pages.compression import load, plot, table  # the page's own table (one copy)
from longlab.eval.stats import wilson_interval


def needles(data: dict, ratios: list[float], tokenizer_dir: str) -> str:
    """Does the asked needle's number survive each deletion method, whole? The samples are regenerated
    (same task, length, seed) and tokenized as the harness does; the kept spans of each row are decoded."""
    from transformers import AutoTokenizer

    from longlab.prompt import encode_prompts
    from longlab.tasks import generate_samples

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = ["| task | method | r | needle kept whole | needle cut (digits kept, number not) |",
             "|---|---|---|---|---|"]
    for task, cells in sorted(data.items()):
        full = cells.get(("full", 0.0), {})
        if not full:
            continue
        length = next(iter(full.values()))["length"]
        samples = {s.sample_id: s for s in generate_samples(task, tok, length, num_samples=64, seed=0)}
        for m in ("llmlingua", "longllmlingua", "tpp"):
            for r in ratios[1:]:
                rows = cells.get((m, r), {})
                whole = cut = n = 0
                for sid, row in rows.items():
                    s = samples.get(sid)
                    if s is None or len(row["extra"]["context"]["kept_spans"]) >= 512:
                        continue
                    (ctx,), _ = encode_prompts(tok, [s.context], [s.question], [s.answer_prefix])
                    spans = row["extra"]["context"]["kept_spans"]
                    text = tok.decode([ctx[i] for a, b in spans for i in range(a, b)])
                    ans = s.answers[0]
                    n += 1
                    whole += ans in text
                    cut += ans not in text and any(ans[i:i + 4] in text for i in range(len(ans) - 3))
                if n:
                    lines.append(f"| {task} | {m} | {r:g} | {_count(whole, n)} | {_count(cut, n)} |")
    return "\n".join(lines) + "\n"


def _count(k: int, n: int) -> str:
    """``k/n [lo, hi]``: a count with its 95% Wilson interval on the fraction."""
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", default=None, help="stem of the .md and .png (default: DIR/compression_table)")
    ap.add_argument("--ratios", default="0,0.5,0.75,0.875,0.9375")
    ap.add_argument("--alias", action="append", default=[], metavar="RECIPE=COLUMN@R",
                    help="put RECIPE's rows in column COLUMN at removed fraction R (repeatable)")
    ap.add_argument("--needles", default=None, metavar="TOKENIZER_DIR",
                    help="also check needle survival (the model's tokenizer directory)")
    args = ap.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    aliases = {}
    for item in args.alias:
        recipe, _, target = item.rpartition("=")
        column, _, r = target.rpartition("@")
        aliases[recipe] = (column, float(r))
    data = load(args.dirs, aliases)
    text, curves = table(data, ratios)
    if args.needles:
        text += "\nNeedle survival in the compressed context (the asked number, decoded kept spans):\n\n"
        text += needles(data, ratios, args.needles)
    stem = Path(args.out) if args.out else Path(args.dirs[0]) / "compression_table"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    if curves:
        plot(curves, stem.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
