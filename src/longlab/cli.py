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
    """``longlab generate``: one request (context, or documents with --reuse) through the engine."""
    from .engine import Engine
    from .generation import GenerationResult
    from .models import load_model
    from .request import Request

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
    ).check()  # every argument checked before the model loads
    if args.context_parallel is not None:  # longlab.cp_generate: the prefill split over processes
        from .cp_generate import cli_generate

        return cli_generate(args, request)
    store = None
    if docs:
        from .reuse.cli import default_store_dir

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
    from .generation import generate
    from .models import load_model
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
        "--recipes", type=_recipe_list,
        help="comma-separated recipes, e.g. full,snapkv@0.5 (default: the 15-recipe default sweep; full with "
             "--reuse or --speculative)",
    )
    parser.add_argument(
        "--tasks", type=_csv(str, "task names"), default=None,
        help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)}; {GRID_TASK} uses --depths)",
    )
    parser.add_argument(
        "--lengths", type=_csv(int, "integers"), default=None,
        help=f"comma-separated prompt lengths in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument("--samples", type=int,
                        help="samples per task and length (default: 4; not with --jsonl)")
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
        "--chunk-size", type=int,
        help=f"prefill chunk size in tokens; the last chunk is per recipe (default: {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N",
        help="cap each sample's own answer limit at N tokens (the smaller of the two is used)",
    )
    parser.add_argument(
        "--depths", type=_csv(float, "numbers"),
        help="needle depths in [0, 1] for the niah_grid task "
             f"(default: {','.join(map(str, DEFAULT_DEPTHS))})",
    )
    parser.add_argument("--backend", choices=("serial", "ray"), default="serial")
    parser.add_argument("--workers", type=int,
                        help="with --backend ray: workers, one model each (default: 2)")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; 1 is faster on a busy machine)"
    )
    parser.add_argument(
        "--batch-decode", action=argparse.BooleanOptionalAction, default=None,
        help="decode the cells of a sample as one batch, finished rows leaving it (default: on, off with "
             "--speculative; the tokens are those of one stream per cell; --no-batch-decode decodes each "
             "alone)",
    )
    parser.add_argument(
        "--prefill-metrics", action="store_true",
        help="sparse prefill policies record density, attention recall and output error vs dense per layer "
             "and head (metrics table; off by default: normal runs pay nothing)",
    )
    parser.add_argument(
        "--metric-rows", type=int,
        help="with --prefill-metrics: query rows sampled per chunk for recall and output error (default: 32)",
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
             "e.g. full-prefill,cacheblend:recompute=0.15,prophetkv:recompute=0.2; each x every --recipes "
             "(KV recipes compressing the assembled cache; default: none)",
    )
    parser.add_argument("--num-docs", type=int,
                        help="documents per generated multidoc_qa_* sample (default: 8)")
    parser.add_argument(
        "--speculative", nargs="+", metavar="DRAFT",
        help="speculative decoding as a grid axis: drafts (lookup, self:streaming:budget=256, model:NAME), "
             "each x every --verify, next to plain decoding (each row decodes alone, timed against plain)",
    )
    parser.add_argument("--verify", nargs="+", metavar="VERIFIER", help="with --speculative: full, dustin")
    parser.add_argument("--gamma", type=int, help="with --speculative: draft tokens per step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--positions", type=_recipe_list, metavar="METHODS",
        help="position methods as a grid axis, each applied to the model while its rows run (rows' model: "
             "NAME|METHOD), plus none: e.g. yarn:factor=2,pi:factor=2,drope:weights=DIR",
    )
    parser.add_argument(
        "--score", choices=("decode", "forced"), default="decode",
        help="decode: the task's metric on the decoded answer (default); forced: teacher forcing, 1 when "
             "greedy decoding would emit the first answer exactly (one forward, no decoding), with each "
             "row's agreement with the full cache (fidelity)",
    )
    parser.add_argument(
        "--strict", action=argparse.BooleanOptionalAction, default=True,
        help="refuse prompts beyond the model's max_position_embeddings (default; --no-strict runs them)",
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
    from .eval.tables import spec_markdown  # the speculative axis: speed and bytes against plain decoding

    speculation = spec_markdown(rows)
    if speculation:
        print(speculation + "\n")


def _cmd_eval(args: argparse.Namespace) -> int:
    """``longlab eval``: run the grid, then print the summary table and the report's paths."""
    from .eval.config import EvalConfig
    from .eval.driver import run_eval

    config = EvalConfig(
        out=args.out, model=args.model, recipes=args.recipes, tasks=args.tasks, lengths=args.lengths,
        samples=args.samples, seed=args.seed, query_aware=args.query_aware, chunk_size=args.chunk_size,
        max_new_tokens=args.max_new_tokens, limit=args.limit, jsonl=args.jsonl, depths=args.depths,
        backend=args.backend, workers=args.workers, threads=args.threads, batch_decode=args.batch_decode,
        prefill_metrics=args.prefill_metrics, metric_rows=args.metric_rows, compress=args.compress,
        skip_rows=args.skip_rows, report=not args.no_report, progress=not args.no_progress,
        positions=args.positions, reuse=args.reuse, num_docs=args.num_docs, speculative=args.speculative,
        verify=args.verify, gamma=args.gamma, score=args.score, strict=args.strict,
    )
    summary = run_eval(config)
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
