"""``longlab generate`` (one request through the engine) and ``longlab example`` (the bundled example)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from typing import Any

from ..errors import LonglabError
from ..recipe import split_recipes
from .common import read_context_file

__all__ = ["EXAMPLE_QUESTION", "EXAMPLE_RECIPES", "example_context", "add_generate_arguments",
           "add_example_arguments", "cmd_generate", "cmd_example"]

EXAMPLE_QUESTION = "What is the access code for the archive room?"
EXAMPLE_RECIPES = ("full", "snapkv@0.5", "streaming@0.5", "h2o@0.5", "adakv@0.75")


def example_context() -> str:
    return resources.files("longlab").joinpath("data/example_context.txt").read_text(encoding="utf-8")


def add_generate_arguments(sub: Any) -> None:
    """``longlab generate``: one request (a context, or documents with --reuse) through the engine."""
    g = sub.add_parser("generate", help="answer a question about a long context under a recipe")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--recipe", default="snapkv@0.5", help="e.g. full, snapkv@0.5, streaming:budget=512")
    g.add_argument("--context-file")
    g.add_argument("--encoding", default="utf-8", help="the --context-file's text encoding (default utf-8)")
    g.add_argument("--context")
    g.add_argument("--question")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--chunk-size", type=int, default=1024)
    g.add_argument("--query-aware", action="store_true", help="compress with the question in the prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--strict", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse a prompt beyond the model's context length (default; --no-strict: warn, run)")
    g.add_argument("--quiet-summary", action="store_true", help="print the summary line to stderr")
    g.add_argument("--context-parallel", type=int, metavar="N",
                   help="prefill over N processes (ring attention, gloo); needs --recipe full")
    g.add_argument("--docs", nargs="+", metavar="FILE", help="RAG prompt: documents, each prefilled alone")
    g.add_argument("--reuse", help="with --docs: e.g. prophetkv:recompute=0.2, cacheblend, epic:k=16")
    g.add_argument("--store", metavar="DIR", help="with --docs: document KV store (default: cache docstore)")
    g.add_argument("--speculative", help="draft: lookup, self:streaming:budget=256, model:NAME, ...")
    g.add_argument("--verify", help="with --speculative: full (exact, default) or dustin:budget=1024")
    g.add_argument("--gamma", type=int, help="with --speculative: draft tokens per step (default: draft's)")
    g.add_argument("--position", help="position method: yarn:factor=4, ntk:factor=2, drope:weights=DIR, ...")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """``longlab generate``: one request (context, or documents with --reuse) through the engine."""
    from ..engine import Engine
    from ..generation import GenerationResult
    from ..models import load_model
    from ..request import Request

    given = [flag for flag, on in (("--context-file", args.context_file),
                                   ("--context", args.context is not None), ("--docs", args.docs)) if on]
    if len(given) != 1:
        raise LonglabError(
            "give the prompt with one of --context-file FILE, --context TEXT or --docs FILE ..., not both"
        )
    if args.context_file:
        context = read_context_file(args.context_file, args.encoding)
    else:
        context = args.context
    docs = [read_context_file(f, args.encoding, "--docs") for f in args.docs] if args.docs else None
    if docs and not args.question:
        raise LonglabError("--docs needs --question")
    if args.reuse and not docs:
        raise LonglabError("--reuse needs --docs FILE [FILE ...]: the documents whose KV is reused")
    if args.store is not None and not docs:
        raise LonglabError("--store: only with --docs (the document KV store)")
    if args.store is not None and not args.store.strip():
        raise LonglabError("--store is empty: give a directory (default: the cache's docstore)")
    request = Request(
        context=context, documents=docs, question=args.question, recipe=args.recipe,
        reuse=args.reuse, speculative=args.speculative, verify=args.verify, gamma=args.gamma,
        position=args.position, query_aware=args.query_aware, chunk_size=args.chunk_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        strict=args.strict, batch_decode=False,
    )
    try:
        request.check()  # every argument checked before the model loads
    except LonglabError as exc:
        raise LonglabError(as_flag(str(exc), request)) from None
    if args.context_parallel is not None:  # longlab.ops.cp_generate: the prefill split over processes
        from ..ops.cp_generate import cli_generate

        return cli_generate(args, request)
    store = None
    if docs:
        from .store import default_store_dir

        store = args.store or default_store_dir()
    model, tokenizer = load_model(args.model)
    result = Engine(model, tokenizer, store=store).run([request])[0]
    print(result.text)
    summary = GenerationResult.of([result]).summary()
    if result.speculation:
        s = result.speculation
        summary += (f" | {s['spec']}: acceptance {s['acceptance_rate']:.2f}, "
                    f"{s['tokens_per_forward']:.2f} tokens/target forward")
    if result.reuse is not None:
        pre = result.reuse
        summary += (f" | fetch {pre.fetch_s:.2f}s assemble {pre.assemble_s:.2f}s compute {pre.compute_s:.2f}s"
                    f" | recomputed {pre.recompute_fraction:.1%} of document token-layers"
                    f" | store {pre.store_stats}")
    print(summary, file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def as_flag(message: str, request: Any) -> str:
    """A request's error as the command line says it: a leading field name (``chunk_size must ...``)
    becomes its flag (``--chunk-size must ...``)."""
    import dataclasses
    import re

    fields = {f.name for f in dataclasses.fields(request)}
    match = re.match(r"(\w+)\b", message)
    if match and match.group(1) in fields:
        return "--" + match.group(1).replace("_", "-") + message[match.end():]
    return message


def add_example_arguments(sub: Any) -> None:
    e = sub.add_parser("example", help="the bundled long-context example under several recipes")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--recipes", default=",".join(EXAMPLE_RECIPES))
    e.set_defaults(func=cmd_example)


def cmd_example(args: argparse.Namespace) -> int:
    from ..generation import generate
    from ..models import load_model
    from ..recipe import parse_recipe

    recipes = split_recipes(args.recipes)
    if not recipes:
        raise LonglabError("--recipes is empty: name at least one recipe (e.g. full,snapkv@0.5)")
    for recipe in recipes:
        try:
            parse_recipe(recipe)  # every recipe is checked before the model loads and the first one runs
        except LonglabError as exc:
            raise LonglabError(f"--recipes: {exc}") from None
    model, tokenizer = load_model(args.model)
    print(f"model {args.model}: loaded in {model.longlab_load_seconds:.1f}s")
    print(f"question: {EXAMPLE_QUESTION}  (expected answer: 7316)")
    context = example_context()
    modes = {"query-agnostic": False, "query-aware": True}
    for recipe in recipes:
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
