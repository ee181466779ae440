"""``longlab`` command line: generate | methods | example | eval | calibrate | train | report.

User errors (bad arguments, unknown names, missing files) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import stat
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from .recipe import LonglabError, shorten, split_recipes

EXAMPLE_QUESTION = "What is the access code for the archive room?"
EXAMPLE_RECIPES = ("full", "snapkv@0.5", "streaming@0.5", "h2o@0.5", "adakv@0.75")


def example_context() -> str:
    return resources.files("longlab").joinpath("data/example_context.txt").read_text(encoding="utf-8")


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def read_context_file(name: str, encoding: str = "utf-8", flag: str = "--context-file") -> str:
    """The text of a context file, or a LonglabError saying what is wrong: missing, a directory or a
    device (``/dev/null``), unreadable, empty, binary (NUL characters) or not in ``encoding``
    (UTF-8 by default; a leading BOM is dropped)."""
    path = Path(name)
    try:
        codec = codecs.lookup(encoding).name
    except LookupError:
        raise LonglabError(
            f"--encoding: unknown encoding {shorten(encoding)} (e.g. utf-8, latin-1, cp1252)"
        ) from None
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")
            raise LonglabError(f"{flag}: {path} is {kind}, not a text file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise LonglabError(f"{flag}: no such file: {path}") from None
    except OSError as exc:
        raise LonglabError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig" if codec == "utf-8" else codec)
    except UnicodeDecodeError as err:
        raise LonglabError(
            f"{flag}: {path} is not valid {codec} text (byte {err.start}: {err.reason}); "
            "give the file's encoding with --encoding, e.g. --encoding latin-1"
        ) from None
    except LookupError:  # e.g. rot13: a codec, but not a text encoding
        raise LonglabError(f"--encoding: {shorten(encoding)} is not a text encoding") from None
    if "\x00" in text:
        raise LonglabError(f"{flag}: {path} looks binary (it contains NUL characters); give a text file")
    if not text.strip():
        raise LonglabError(f"{flag}: {path} is empty (context is empty)")
    return text


def _cmd_generate(args: argparse.Namespace) -> int:
    from .models import load_model
    from .pipeline import generate

    if args.docs or args.reuse:
        return _generate_docs(args)
    if args.context_file and args.context is not None:
        raise LonglabError("give the context with --context-file FILE or --context TEXT, not both")
    if args.context_file:
        context = read_context_file(args.context_file, args.encoding)
    elif args.context is not None:
        context = args.context
    else:
        raise LonglabError("give the context with --context-file FILE or --context TEXT")
    if args.context_parallel is not None:  # longlab.cp_generate: the prefill split over processes
        from .cp_generate import cli_generate

        return cli_generate(args, context)
    from .recipe import parse_recipe

    parse_recipe(args.recipe)  # fail on a bad recipe before loading the model
    spec = {}
    if args.speculative is not None or args.verify is not None or args.gamma is not None:
        from .spec.api import prepare

        prepare(args.speculative, args.verify, args.gamma)  # checked before the model loads
        spec = dict(speculative=args.speculative, verify=args.verify, gamma=args.gamma)
    model, tokenizer = load_model(args.model, position=args.position)
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
        **spec,
    )
    print(result.text)
    summary = result.summary()
    if result.speculation:
        s = result.speculation
        summary += (f" | {s['spec']}: acceptance {s['acceptance_rate']:.2f}, "
                    f"{s['tokens_per_forward']:.2f} tokens/target forward")
    print(summary, file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def _generate_docs(args: argparse.Namespace) -> int:
    """``longlab generate --docs A B --reuse METHOD [--store DIR]`` (longlab.reuse)."""
    from .models import load_model
    from .pipeline import generate
    from .reuse import DocStore, parse_reuse
    from .reuse.cli import default_store_dir

    if not args.docs:
        raise LonglabError("--reuse needs --docs FILE [FILE ...]: the documents whose KV is reused")
    if args.context_file or args.context is not None:
        raise LonglabError("give the prompt with --docs or with --context/--context-file, not both")
    if not args.question:
        raise LonglabError("--docs needs --question")
    docs = [read_context_file(f, args.encoding, "--docs") for f in args.docs]
    method = parse_reuse(args.reuse or "full-prefill")  # checked before the model loads
    from .reuse.compose import reuse_recipe

    reuse_recipe(args.recipe, method)  # --recipe compresses the assembled cache (longlab.reuse.compose)
    store = DocStore(args.store or default_store_dir())
    model, tokenizer = load_model(args.model)
    result = generate(
        model, tokenizer, docs=docs, question=args.question, reuse=method, store=store, recipe=args.recipe,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
    )
    pre = result.reuse
    print(result.text)
    print(
        f"{result.summary()} | fetch {pre.fetch_s:.2f}s assemble {pre.assemble_s:.2f}s "
        f"compute {pre.compute_s:.2f}s"
        f" | recomputed {pre.recompute_fraction:.1%} of document token-layers | store {pre.store_stats}",
        file=sys.stderr if args.quiet_summary else sys.stdout,
    )
    return 0


def _method_row(family: str, name: str, cls: type) -> tuple[str, str, str, str, str]:
    """One line of ``longlab methods``: family (with the recipe part's kind), name, paper, the parameters
    with their defaults and declared ranges, and the summary line of the docstring."""
    from .registry import param_range

    params = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.default is dataclasses.MISSING:
            continue
        rng = param_range(f)
        params.append(f"{f.name}={f.default!r}" + (f" ({rng})" if rng else ""))
    summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    kind = f"{family}:{cls.kind}" if family == "recipe" else family
    return kind, name, getattr(cls, "paper", ""), ", ".join(params), summary


def _cmd_methods(args: argparse.Namespace) -> int:
    """``longlab methods``: every method of the one registry, family by family."""
    from .registry import FAMILIES, REGISTRY

    rows = [_method_row(fam, name, cls) for fam, name, cls in REGISTRY.entries()]
    if args.markdown:
        print("| method | family | paper | parameters (default, valid range) |\n|---|---|---|---|")
        for kind, name, paper, params, _ in rows:
            print(f"| `{name}` | {kind} | {paper} | {params} |")
        return 0
    for fam in FAMILIES.values():
        print(f"# {fam.what}s ({fam.where})")
        for kind, name, paper, params, summary in rows:
            if kind.split(":")[0] == fam.name:
                print(f"{name:<16} {kind:<15} {paper:<18} {summary}")
                print(f"{'':<16} params: {params or 'none'}")
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    from .models import load_model
    from .pipeline import generate
    from .recipe import parse_recipe

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


# --------------------------------------------------------------------------------------------------
# longlab eval


def _csv(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def _recipe_list(text: str) -> list[str]:
    try:
        recipes = split_recipes(text)
    except LonglabError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not recipes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of recipes")
    return recipes


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``longlab eval`` options."""
    from .eval.config import (
        DEFAULT_CHUNK_SIZE,
        DEFAULT_DEPTHS,
        DEFAULT_LENGTHS,
        DEFAULT_RECIPES,
        DEFAULT_TASKS,
        GRID_TASK,
    )

    parser.description = (
        "Evaluate recipes on long-context tasks. Each sample's context is prefilled once and the cache "
        "is branched into every recipe, whose rows decode as one batch; rows go to DIR/results.sqlite, "
        "finished rows are skipped on re-runs."
    )
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, local path or HF id")
    parser.add_argument(
        "--recipes", type=_recipe_list, default=list(DEFAULT_RECIPES),
        help="comma-separated recipes, e.g. full,snapkv@0.5 (default: the 15-recipe default sweep)",
    )
    parser.add_argument(
        "--tasks", type=_csv(str, "task names"), default=None,
        help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)}; {GRID_TASK} uses --depths)",
    )
    parser.add_argument(
        "--lengths", type=_csv(int, "integers"), default=None,
        help=f"comma-separated prompt lengths in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument("--samples", type=int, default=4, help="samples per task and length (default: 4)")
    parser.add_argument("--out", required=True, metavar="DIR", help="results directory")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate only the first N samples")
    parser.add_argument("--seed", type=int, default=0, help="task generation seed (default: 0)")
    parser.add_argument("--query-aware", action="store_true", help="compress with the question in the prompt")
    parser.add_argument(
        "--compress", choices=("end", "chunk"), default="end",
        help="KV policies cut the cache once after the prefill (end: recipes share the prefix; default) or "
             "after every --chunk-size chunk (chunk: bounded memory for long inputs, as `generate` does; "
             "each compressing recipe prefills alone)",
    )
    parser.add_argument("--jsonl", metavar="PATH", help="evaluate a JSONL file in the common format instead")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
        help=f"prefill chunk size in tokens; the last chunk is per recipe (default: {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N",
        help="cap each sample's own answer limit at N tokens (the smaller of the two is used)",
    )
    parser.add_argument(
        "--depths", type=_csv(float, "numbers"), default=list(DEFAULT_DEPTHS),
        help="needle depths in [0, 1] for the niah_grid task",
    )
    parser.add_argument("--backend", choices=("serial", "ray"), default="serial")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers, one model each (default: 2)")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; 1 is faster on a busy machine)"
    )
    parser.add_argument(
        "--batch-decode", action=argparse.BooleanOptionalAction, default=True,
        help="decode the recipes of a sample as one batch, finished rows leaving it (default: on; the "
             "tokens are those of one stream per recipe; --no-batch-decode decodes each alone)",
    )
    parser.add_argument(
        "--prefill-metrics", action="store_true",
        help="sparse prefill policies record density, attention recall and output error vs dense per layer "
             "and head (metrics table; off by default: normal runs pay nothing)",
    )
    parser.add_argument(
        "--metric-rows", type=int, default=32,
        help="query rows sampled per chunk for recall and output error (default: 32)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.md and the plots")
    parser.add_argument(
        "--skip-rows", metavar="FILE",
        help="a JSON list of rows measured elsewhere (model, recipe, task, length, sample_id; optional "
             "compress, query_aware): those cells are not run again (e.g. a committed copy of an old store)",
    )
    parser.add_argument(
        "--reuse", type=_recipe_list, metavar="METHODS",
        help="KV-reuse methods as a grid axis, on multi-document tasks "
             "(multidoc_qa_1/2 or a --jsonl of {documents, question, answers}), "
             "e.g. full-prefill,cacheblend@0.15,prophetkv@0.2; each x every --recipes given (KV recipes "
             "compressing the assembled cache; default: none)",
    )
    parser.add_argument("--num-docs", type=int, default=8, help="with --reuse: documents per sample")
    parser.add_argument(
        "--speculative", nargs="+", metavar="DRAFT",
        help="speculative decoding as the grid axis: drafts (lookup, self:streaming:budget=256, model:NAME), "
             "each x every --verify, next to plain decoding (longlab.eval.spec_grid)",
    )
    parser.add_argument("--verify", nargs="+", metavar="VERIFIER", help="with --speculative: full, dustin")
    parser.add_argument("--gamma", type=int, help="with --speculative: draft tokens per step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--positions", type=_recipe_list, metavar="METHODS",
        help="position methods as a grid axis, each applied at load (rows' model: NAME|METHOD), plus none: "
             "e.g. yarn:factor=2,pi:factor=2,drope:weights=DIR",
    )


def _print_score_tables(out: str) -> None:
    """The score tables with 95% confidence intervals and paired differences vs ``full``, the sentence
    on how to read them, then the prefill-metrics table when there is one."""
    from .eval.report import load_metrics, load_rows, prefill_table, score_table

    rows = load_rows(out)
    print()
    print(score_table(rows))  # ends with the how-to-read sentence
    prefill = prefill_table(rows, load_metrics(out))
    if prefill:
        print(prefill + "\n")


def _reuse_samples(args: argparse.Namespace, tokenizer: Any, make_samples: Callable) -> list:
    """The generated samples of ``longlab eval --reuse`` (a generator's ValueError becomes a LonglabError)."""
    try:
        return [
            s
            for task in args.tasks or ["multidoc_qa_1"]
            for length in args.lengths or [2048]
            for s in make_samples(
                task, tokenizer, length, args.samples, args.seed,
                **({"num_docs": args.num_docs} if task.startswith("multidoc_") else {}),
            )
        ]
    except LonglabError:
        raise
    except ValueError as exc:
        raise LonglabError(f"--tasks/--lengths: {exc}") from None


def _eval_reuse(args: argparse.Namespace) -> int:
    """``longlab eval --reuse ...`` (longlab.eval.reuse_grid): reuse methods x multi-document samples."""
    from .eval.config import DEFAULT_RECIPES
    from .eval.reuse_grid import run_reuse_eval
    from .eval.store import check_results_dir
    from .models import load_model
    from .reuse import parse_reuse
    from .reuse.compose import reuse_recipe
    from .tasks import generate as make_samples
    from .tasks.multidoc import load_multidoc_jsonl

    recipes = ["full"] if args.recipes == list(DEFAULT_RECIPES) else args.recipes  # KV recipes after reuse
    for spec in args.reuse:
        method = parse_reuse(spec)  # every method (and method x recipe) checked before the model loads
        for recipe in recipes:
            try:
                reuse_recipe(recipe, method)
            except LonglabError as exc:
                raise LonglabError(f"--recipes: {exc}") from None
    check_results_dir(args.out)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    if args.jsonl:
        try:
            samples = load_multidoc_jsonl(args.jsonl)
        except ValueError as exc:
            raise LonglabError(f"--jsonl: {exc}") from None
    else:
        samples = _reuse_samples(args, tokenizer, make_samples)
    samples = samples[: args.limit] if args.limit else samples
    summary = run_reuse_eval(
        args.out, args.model, args.reuse, samples, seed=args.seed, max_new_tokens=args.max_new_tokens,
        model=model, tokenizer=tokenizer, log=None if args.no_progress else print, recipes=recipes,
    )
    print(
        f"longlab eval --reuse: {summary.written} new rows, {summary.skipped} skipped, "
        f"{summary.total} in the grid; {summary.seconds:.1f}s"
    )
    _print_score_tables(args.out)
    return 0


def _eval_spec(args: argparse.Namespace) -> int:
    """``longlab eval --speculative ...`` (longlab.eval.spec_grid): plain + drafts x verifiers per sample."""
    from .eval.config import DEFAULT_RECIPES
    from .eval.spec_grid import run_spec_eval, spec_configs, spec_table
    from .eval.store import check_results_dir
    from .models import load_model
    from .tasks import generate as make_samples
    from .tasks import load_jsonl

    specs = spec_configs(args.speculative, args.verify, args.gamma)  # checked before the model loads
    recipes = ["full"] if args.recipes == list(DEFAULT_RECIPES) else args.recipes
    check_results_dir(args.out)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    try:
        samples = load_jsonl(args.jsonl) if args.jsonl else [
            s for task in args.tasks or ["passkey"] for length in args.lengths or [1024]
            for s in make_samples(task, tokenizer, length, args.samples, args.seed)
        ]
    except LonglabError:
        raise
    except ValueError as exc:
        raise LonglabError(f"--tasks/--lengths/--jsonl: {exc}") from None
    samples = samples[: args.limit] if args.limit else samples
    written, skipped = run_spec_eval(
        args.out, args.model, recipes, specs, samples, seed=args.seed, max_new_tokens=args.max_new_tokens,
        model=model, tokenizer=tokenizer, log=None if args.no_progress else print,
    )
    print(f"longlab eval --speculative: {written} new rows, {skipped} skipped")
    print(spec_table(args.out))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """``longlab eval``: run the grid, then print the summary table and the report's paths."""
    from .eval.config import EvalConfig
    from .eval.grid import run_eval

    if args.skip_rows and (args.reuse or args.speculative):
        raise LonglabError("--skip-rows runs with KV recipes only, not with --reuse or --speculative")
    if args.compress != "end" and (args.reuse or args.speculative):
        raise LonglabError("--compress chunk runs with KV recipes only, not with --reuse or --speculative")
    if args.reuse:
        return _eval_reuse(args)
    if args.speculative:
        return _eval_spec(args)

    config = EvalConfig(
        out=args.out, model=args.model, recipes=list(args.recipes), tasks=args.tasks, lengths=args.lengths,
        samples=args.samples, seed=args.seed, query_aware=args.query_aware, chunk_size=args.chunk_size,
        max_new_tokens=args.max_new_tokens, limit=args.limit, jsonl=args.jsonl, depths=list(args.depths),
        backend=args.backend, workers=args.workers, threads=args.threads, batch_decode=args.batch_decode,
        prefill_metrics=args.prefill_metrics, metric_rows=args.metric_rows, compress=args.compress,
        skip_rows=args.skip_rows, report=not args.no_report,
        progress=not args.no_progress,
    )
    for position in args.positions or []:  # position methods as a grid axis (longlab.position), one store
        run_eval(dataclasses.replace(config, position=position, report=False))
    summary = run_eval(config)  # with --positions: the model's own RoPE, last, with the report
    print(
        f"longlab eval: {summary.written} new rows, {summary.skipped} skipped, {summary.total} in the grid; "
        f"{summary.seconds:.1f}s"
    )
    if summary.report:
        _print_score_tables(config.out)
        for key, path in summary.report.items():
            print(f"{key:>22}: {path}")
    else:
        print(f"results: {Path(config.out) / 'results.sqlite'}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .eval.report import main as report_main

    return report_main(
        args.dir, html=not args.no_html, baseline=args.baseline, all_configs=args.all_configs,
        report_dir=args.report_dir,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longlab", description="Long-context inference methods, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

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
    g.add_argument("--strict", action="store_true", help="error (not warn) beyond the model's context length")
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
    g.set_defaults(func=_cmd_generate)

    from .reuse.cli import add_store_arguments, store_main

    st = sub.add_parser("store", help="per-document KV store for --docs: add | list | rm | gc")
    add_store_arguments(st)
    st.set_defaults(func=lambda a: store_main(a, read_context_file))

    m = sub.add_parser("methods", help="list every registered method")
    m.add_argument("--markdown", action="store_true")
    m.set_defaults(func=_cmd_methods)

    e = sub.add_parser("example", help="the bundled long-context example under several recipes")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--recipes", default=",".join(EXAMPLE_RECIPES))
    e.set_defaults(func=_cmd_example)

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

    t = sub.add_parser("train", help="train a learned method's weights (IndexMem; DroPE, RoPE-ID, RePo)")
    add_train_arguments(t)
    from .position.train import TRAINABLE, add_position_train_arguments, position_train_main

    add_position_train_arguments(t)  # adds drope, ropeid, repo (longlab.position)
    t.set_defaults(func=lambda a: position_train_main(a) if a.method in TRAINABLE else train_main(a))

    from .lab.cli import add_lab_arguments  # longlab.lab: the layers lab (train/eval small LMs on CPU)

    add_lab_arguments(sub.add_parser("lab", help="layers lab: train/test small LMs with swappable mixers"))

    r = sub.add_parser("report", help="tables and plots from a results directory")
    r.add_argument("dir", metavar="DIR", help="results directory (its results.sqlite is only read)")
    r.add_argument("--no-html", action="store_true")
    r.add_argument("--baseline", default="full", help="recipe the difference tables subtract (default: full)")
    r.add_argument(
        "--all-configs", action="store_true",
        help="count every row, also older ones of the same sample and recipe under other config hashes",
    )
    r.add_argument("--report-dir", metavar="OUT", help="write report.md and the plots here (default: DIR)")
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
