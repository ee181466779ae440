"""Which part of the prompt protocol makes longlab and kvpress answer differently: per-factor ablations.

    python bench/kvpress_cases.py --out runs/cases.jsonl
    python bench/kvpress_layout.py --cases runs/cases.jsonl --side longlab --variants kvpress,longlab \\
        --out runs/layout-longlab.json
    python bench/kvpress_layout.py --cases runs/cases.jsonl --side kvpress --variants kvpress,longlab \\
        --out runs/layout-kvpress.json
    python bench/kvpress_layout.py --table runs/layout-longlab.json,runs/layout-kvpress.json

A *variant* fixes the prompt's token ids; both sides then run on exactly those ids, so a difference
between variants on one side is the layout's, and a difference between sides on one variant is the
engine's (chunking, budget rounding, ties). Every variant uses the chat template and splits the
prompt where kvpress's pipeline does (the context part, chat header included, is compressed; the rest
is fed after compression):

- ``kvpress``: user turn = context + question (glued), then the assistant header, then
  ``answer_prefix + " "`` -- kvpress's pipeline called as ``pipe(context, question=q,
  answer_prefix=prefix + " ")``; the driver checks that its own ``preprocess`` gives these ids;
- ``kvpress-bare``: the same with ``answer_prefix`` as given (no added space);
- ``longlab``: longlab's layout before this change: user turn = context + ``"\\n\\n"`` + question,
  ``answer_prefix`` as given;
- ``longlab-space``: that layout with ``answer_prefix + " "``;
- ``plain``: longlab's completion layout (no chat template): context, newline, question, space-led prefix.

``--side longlab`` runs longlab's eval runner (:class:`longlab.eval.sample_runner.SampleRunner`: one
shared prefill in ``--chunk-size`` chunks, compression once at the end, batched decode) on the ids;
``--side kvpress`` runs kvpress's pipeline (its ``_forward``: one prefill forward under the press,
then the question and greedy decoding) on the same ids, in ``--kvpress-python`` through a subprocess.
Both score with longlab's scorer of the row (``string_match_all`` for these cases).
``--table`` prints correct counts per (side, variant, recipe) with Wilson intervals, and paired
differences against a reference cell (``--reference SIDE:VARIANT``, default ``kvpress:kvpress``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (separator between context and question, space after the answer prefix, chat)
    "kvpress": ("", True, True),
    "kvpress-bare": ("", False, True),
    "longlab": ("\n\n", False, True),
    "longlab-space": ("\n\n", True, True),
    "plain": ("\n", False, False),
}
PRESSES = {"full": None, "knorm": "KnormPress", "streaming": "StreamingLLMPress", "snapkv": "SnapKVPress",
           "tova": "TOVAPress", "expected": "ExpectedAttentionPress"}


def variant_ids(tokenizer, sample: dict, variant: str) -> tuple[list[int], list[int]]:
    """(context part, question part) token ids of ``sample`` under ``variant`` (split as kvpress does)."""
    sep, space, chat = VARIANTS[variant]
    prefix = sample.get("answer_prefix") or ""
    if space and prefix and not prefix.endswith(" "):
        prefix += " "
    if not chat:
        if prefix and not prefix[0].isspace():
            prefix = " " + prefix
        ctx_text, q_text = sample["context"], sep + sample["question"] + prefix
        ctx = tokenizer(ctx_text)["input_ids"]
    else:
        marker = "\u2063SPLIT\u2063"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample["context"] + marker}], add_generation_prompt=True,
            tokenize=False,
        )
        head, suffix = rendered.split(marker)
        ctx = tokenizer(head, add_special_tokens=False)["input_ids"]
        q_text = sep + sample["question"] + suffix + prefix
    return list(ctx), list(tokenizer(q_text, add_special_tokens=False)["input_ids"])


def _press_of(recipe: str) -> tuple[str | None, float]:
    """kvpress press class and compression ratio of a recipe name such as ``knorm@0.5``."""
    name, _, ratio = recipe.partition("@")
    name = name.split(":")[0]
    if name not in PRESSES:
        raise SystemExit(f"kvpress_layout: no kvpress press for {recipe!r}; known: {', '.join(PRESSES)}")
    return PRESSES[name], float(ratio.split(":")[0]) if ratio else 0.0


def kvpress_driver(args: argparse.Namespace) -> int:
    """Inside the kvpress venv: run the pipeline's ``_forward`` on the given ids; write predictions."""
    import kvpress
    import torch
    import transformers
    from transformers import pipeline

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    job = json.loads(Path(args.job).read_text())
    pipe = pipeline("kv-press-text-generation", model=job["model_dir"], device="cpu", dtype=torch.float32)
    rows, checked = [], []
    for item in job["items"]:
        if item["variant"] == "kvpress":  # the pipeline's own preprocessing must give the same ids
            s = item["sample"]
            prefix = s.get("answer_prefix") or ""
            inputs = pipe.preprocess(s["context"], [s["question"]], prefix + " " if prefix else "", 10**9)
            own = [inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()]
            checked.append([s["sample_id"], own == [item["ctx"], item["q"]]])
        for recipe in job["recipes"]:
            press_name, ratio = _press_of(recipe)
            press = getattr(kvpress, press_name)(compression_ratio=ratio) if press_name else None
            t0 = time.perf_counter()
            (answer,) = pipe._forward(
                {"context_ids": torch.tensor([item["ctx"]]), "questions_ids": [torch.tensor([item["q"]])]},
                max_new_tokens=item["max_new_tokens"], press=press,
            )
            rows.append({"variant": item["variant"], "recipe": recipe,
                         "sample_id": item["sample"]["sample_id"], "prediction": answer.strip(),
                         "seconds": time.perf_counter() - t0})
            print(f"kvpress {item['variant']} {recipe} {item['sample']['sample_id']}: {answer.strip()!r}",
                  file=sys.stderr, flush=True)
            with open(job["out"] + ".partial", "a") as fh:  # progress survives an interrupted run
                fh.write(json.dumps(rows[-1]) + "\n")
    Path(job["out"]).write_text(json.dumps({"rows": rows, "own_ids_equal": checked,
                                            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                                            else "", "transformers": transformers.__version__}))
    return 0


def run_longlab(samples: list, variants: list[str], recipes: list[str], chunk_size: int) -> list[dict]:
    """longlab on the given ids: the context prefilled under each recipe (compressed once, after its last
    chunk, as kvpress compresses), the question part fed uncompressed, greedy decoding; scored by the
    harness's metric."""
    import torch

    from longlab.cache import LonglabCache
    from longlab.engine.stream import Stream, eos_token_ids
    from longlab.models import load_model
    from longlab.recipe import parse_recipe
    from longlab.tasks.registry import score_sample
    from longlab.tasks.sample import Sample

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    eos = eos_token_ids(model, tokenizer)
    rows = []
    for variant in variants:
        for raw in samples:
            sample = Sample.from_dict(raw)
            ctx, q = variant_ids(tokenizer, raw, variant)
            t0 = time.perf_counter()
            for recipe in recipes:
                with torch.inference_mode(), LonglabCache(parse_recipe(recipe)) as cache:
                    stream = Stream(model, cache, 1)
                    stream.feed([ctx], chunk_size, compress="end")
                    logits = stream.feed([q], chunk_size, compress="none")
                    (tokens,) = stream.decode(logits, raw["max_new_tokens"], eos)
                prediction = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                rows.append({"variant": variant, "recipe": recipe, "sample_id": sample.sample_id,
                             "prediction": prediction, "score": score_sample(sample, prediction)})
            print(f"longlab {variant} {sample.sample_id}: {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                  flush=True)
    return rows


def run_kvpress(
    args: argparse.Namespace, samples: list, variants: list[str], recipes: list[str]
) -> list[dict]:
    from longlab.models import load_model
    from longlab.paths import cache_dir
    from longlab.tasks.registry import score_sample
    from longlab.tasks.sample import Sample

    _, tokenizer = load_model("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="kvpress-layout-") as tmp:
        job = {"model_dir": str(cache_dir() / "models" / "smollm2-135m"), "recipes": recipes,
               "out": str(Path(tmp) / "out.json"), "items": []}
        for variant in variants:
            for s in samples:
                ctx, q = variant_ids(tokenizer, s, variant)
                job["items"].append({"variant": variant, "sample": s, "ctx": ctx, "q": q,
                                     "max_new_tokens": s["max_new_tokens"]})
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        proc = subprocess.run([str(args.kvpress_python), __file__, "--kvpress-driver", "--job",
                               str(Path(tmp) / "job.json")], env=env)
        if proc.returncode != 0:
            raise SystemExit(f"kvpress_layout: the kvpress driver failed (exit {proc.returncode})")
        out = json.loads((Path(tmp) / "out.json").read_text())
    bad = [sid for sid, ok in out["own_ids_equal"] if not ok]
    if bad:
        print(f"warning: kvpress's own preprocessing differs from variant 'kvpress' for {bad}",
              file=sys.stderr)
    by_id = {s["sample_id"]: Sample.from_dict(s) for s in samples}
    for row in out["rows"]:
        row["score"] = score_sample(by_id[row["sample_id"]], row["prediction"])
    return out["rows"]


def table(paths: list[str], reference: str) -> int:
    from longlab.eval.stats import paired_difference, score_estimate

    cells: dict[tuple[str, str, str], dict[str, float]] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        side = result["label"]
        for row in result["rows"]:
            cells.setdefault((side, row["variant"], row["recipe"]), {})[row["sample_id"]] = row["score"]
    ref_side, _, ref_variant = reference.partition(":")
    recipes = list(dict.fromkeys(k[2] for k in cells))
    print(f"| side | variant | {' | '.join(recipes)} |")
    print("|---|---|" + "---:|" * len(recipes))
    for side, variant in dict.fromkeys((k[0], k[1]) for k in cells):
        out = []
        for recipe in recipes:
            mine = cells.get((side, variant, recipe))
            ref = cells.get((ref_side, ref_variant, recipe))
            if mine is None:
                out.append("")
                continue
            ids = sorted(mine)
            est = score_estimate([mine[i] for i in ids])
            text = f"{sum(mine.values()):g}/{len(ids)}"
            if ref is not None and (side, variant) != (ref_side, ref_variant) and set(ref) >= set(ids):
                d = paired_difference([mine[i] for i in ids], [ref[i] for i in ids])
                star = "*" if d.significant else ""
                text += f" ({100 * d.mean:+.0f} [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{star})"
            else:
                text += f" [{100 * est.low:.0f}, {100 * est.high:.0f}]%"
            out.append(text)
        print(f"| {side} | {variant} | {' | '.join(out)} |")
    print(f"(correct / n; in brackets: Wilson 95% interval for the reference {reference}, else the paired "
          "difference from it in points with its 95% bootstrap interval, * = excludes 0)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=Path, help="JSONL cases (bench/kvpress_cases.py)")
    p.add_argument("--side", choices=("longlab", "kvpress"))
    p.add_argument("--variants", default="kvpress,longlab", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--recipes", default="full,knorm@0.5,streaming@0.5,snapkv@0.5,tova@0.5")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="longlab's prefill chunk (eval's default: 128)")
    p.add_argument("--only", default=None, help="comma-separated sample ids (default: every case)")
    p.add_argument("--label", default=None, help="the side's name in --table (default: --side and chunk)")
    p.add_argument("--kvpress-python", type=Path, default=ROOT / ".venv-kvpress" / "bin" / "python")
    p.add_argument("--out", type=Path)
    p.add_argument("--table", default=None, help="comma-separated result files: print the table")
    p.add_argument("--reference", default="kvpress:kvpress", help="SIDE:VARIANT the table compares with")
    p.add_argument("--kvpress-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kvpress_driver:
        return kvpress_driver(args)
    if args.table:
        return table(args.table.split(","), args.reference)
    if not (args.cases and args.side and args.out):
        p.error("--cases, --side and --out are required (or --table)")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    recipes = [r for r in args.recipes.split(",") if r]
    lines = args.cases.read_text(encoding="utf-8").splitlines()
    samples = [json.loads(line) for line in lines if line.strip()]
    if args.only:
        keep = set(args.only.split(","))
        samples = [s for s in samples if s["sample_id"] in keep]
    t0 = time.perf_counter()
    if args.side == "longlab":
        rows = run_longlab(samples, variants, recipes, args.chunk_size)
        label = args.label or f"longlab/chunk{args.chunk_size}"
    else:
        rows = run_kvpress(args, samples, variants, recipes)
        label = args.label or "kvpress"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"label": label, "cases": str(args.cases), "variants": variants,
                                    "recipes": recipes, "chunk_size": args.chunk_size, "rows": rows,
                                    "seconds": time.perf_counter() - t0,
                                    "command": "python bench/kvpress_layout.py " + " ".join(
                                        sys.argv[1:] if argv is None else argv)}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
