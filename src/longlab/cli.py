"""``longlab`` command line: generate | methods | example | eval | calibrate | train | report.

User errors (bad arguments, unknown names, missing files) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from importlib import resources
from pathlib import Path

from .recipe import LonglabError, split_recipes

EXAMPLE_QUESTION = "What is the access code for the archive room?"
EXAMPLE_RECIPES = ("full", "snapkv@0.5", "streaming@0.5", "h2o@0.5", "adakv@0.75")


def example_context() -> str:
    return resources.files("longlab").joinpath("data/example_context.txt").read_text(encoding="utf-8")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .models import load_model
    from .pipeline import generate

    if args.context_file:
        path = Path(args.context_file)
        if not path.is_file():
            raise LonglabError(f"--context-file: no such file: {path}")
        context = path.read_text(encoding="utf-8")
    elif args.context is not None:
        context = args.context
    else:
        raise LonglabError("give the context with --context-file FILE or --context TEXT")
    from .recipe import parse_recipe

    parse_recipe(args.recipe)  # fail on a bad recipe before loading the model
    model, tokenizer = load_model(args.model)
    result = generate(
        model,
        tokenizer,
        context,
        args.question,
        args.recipe,
        max_new_tokens=args.max_new_tokens,
        chunk_size=args.chunk_size,
        query_aware=args.query_aware,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        strict=args.strict,
    )
    print(result.text)
    print(result.summary(), file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    from .recipe import REGISTRY, get_method_class

    get_method_class("full")  # loads the registry
    rows = []
    for name in sorted(REGISTRY, key=lambda n: (REGISTRY[n].kind, n)):
        cls = REGISTRY[name]
        params = ", ".join(
            f"{f.name}={f.default!r}"
            for f in dataclasses.fields(cls)
            if f.init and f.default is not dataclasses.MISSING
        )
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        rows.append((name, cls.kind, cls.paper, params, summary))
    if args.markdown:
        print("| method | kind | paper | parameters |\n|---|---|---|---|")
        for name, kind, paper, params, _ in rows:
            print(f"| `{name}` | {kind} | {paper} | {params} |")
        return 0
    for name, kind, paper, params, summary in rows:
        print(f"{name:<16} {kind:<8} {paper:<18} {summary}")
        print(f"{'':<16} {'':<8} params: {params}")
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    from .models import load_model
    from .pipeline import generate

    model, tokenizer = load_model(args.model)
    print(f"model {args.model}: loaded in {model.longlab_load_seconds:.1f}s")
    print(f"question: {EXAMPLE_QUESTION}  (expected answer: 7316)")
    context = example_context()
    modes = {"query-agnostic": False, "query-aware": True}
    for recipe in split_recipes(args.recipes):
        for mode, query_aware in modes.items():
            if recipe == "full" and query_aware:
                continue  # nothing is compressed: both modes are the same run
            result = generate(
                model,
                tokenizer,
                context,
                EXAMPLE_QUESTION,
                recipe,
                max_new_tokens=24,
                query_aware=query_aware,
            )
            print(f"{result.summary()} [{mode}]")
            print(f"    answer: {result.text!r}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .eval.runner import main as eval_main

    return eval_main(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from .eval.report import main as report_main

    return report_main(args.dir, html=not args.no_html)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longlab", description="Long-context inference methods, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question about a long context under a recipe")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--recipe", default="snapkv@0.5", help="e.g. full, snapkv@0.5, streaming:budget=512")
    g.add_argument("--context-file")
    g.add_argument("--context")
    g.add_argument("--question")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--chunk-size", type=int, default=1024)
    g.add_argument("--query-aware", action="store_true", help="compress with the question in the prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--strict", action="store_true", help="error (not warn) beyond the model's context length")
    g.add_argument("--quiet-summary", action="store_true", help="print the summary line to stderr")
    g.set_defaults(func=_cmd_generate)

    m = sub.add_parser("methods", help="list every registered method")
    m.add_argument("--markdown", action="store_true")
    m.set_defaults(func=_cmd_methods)

    e = sub.add_parser("example", help="the bundled long-context example under several recipes")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--recipes", default=",".join(EXAMPLE_RECIPES))
    e.set_defaults(func=_cmd_example)

    try:
        from .eval.runner import add_eval_arguments
    except ImportError:  # the harness is optional for the core commands
        add_eval_arguments = None
    if add_eval_arguments is not None:
        ev = sub.add_parser("eval", help="run a grid of model x recipe x task x length x sample")
        add_eval_arguments(ev)
        ev.set_defaults(func=_cmd_eval)

    try:
        from .quant.calibrate import add_calibrate_arguments, calibrate_main
    except ImportError:
        add_calibrate_arguments = None
    if add_calibrate_arguments is not None:
        c = sub.add_parser("calibrate", help="offline calibration (PM-KVQ bit allocation)")
        add_calibrate_arguments(c)
        c.set_defaults(func=calibrate_main)

    from .kv.indexmem_train import add_train_arguments, train_main

    t = sub.add_parser("train", help="train a learned method's weights (IndexMem)")
    add_train_arguments(t)
    t.set_defaults(func=train_main)

    r = sub.add_parser("report", help="tables and plots from a results directory")
    r.add_argument("dir")
    r.add_argument("--no-html", action="store_true")
    r.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LonglabError as exc:
        print(f"longlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("longlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
