"""``longlab eval``: every option of the one grid driver (:mod:`longlab.eval.driver`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import LonglabError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (3.10: the tomli backport, a dependency there)
    import tomli as tomllib
from .common import csv_of, recipe_list

__all__ = ["add_eval_arguments", "cmd_eval", "config_argv", "expand_config"]

MAX_CONFIG_BYTES = 1 << 20  # a named run configuration is a few lines; refuse anything larger unread


def add_eval_parser(sub: Any) -> None:
    ev = sub.add_parser("eval", help="run a grid of model x recipe x task x length x sample")
    add_eval_arguments(ev)
    ev.set_defaults(func=cmd_eval)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``longlab eval`` options."""
    from ..eval.config import (
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
        "--recipes", type=recipe_list,
        help="comma-separated recipes, e.g. full,snapkv@0.5 (default: the 15-recipe default sweep; full with "
             "--reuse or --speculative)",
    )
    parser.add_argument(
        "--tasks", type=csv_of(str, "task names"), default=None,
        help=f"comma-separated tasks (default: {','.join(DEFAULT_TASKS)}; {GRID_TASK} uses --depths)",
    )
    parser.add_argument(
        "--lengths", type=csv_of(int, "integers"), default=None,
        help=f"comma-separated prompt lengths in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument("--samples", type=int,
                        help="samples per task and length (default: 4; not with --jsonl)")
    parser.add_argument(
        "--config", metavar="FILE",
        help="a TOML file of these options (keys are the option names: tasks = [\"passkey\"], "
             "max-new-tokens = 12, query-aware = true); options given on the command line win",
    )
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
        "--depths", type=csv_of(float, "numbers"),
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
        "--reuse", type=recipe_list, metavar="METHODS",
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
        "--positions", type=recipe_list, metavar="METHODS",
        help="position methods as a grid axis, each applied to the model while its rows run (rows' model: "
             "NAME|METHOD), plus none: e.g. yarn:factor=2,pi:factor=2,drope:weights=DIR",
    )
    parser.add_argument(
        "--positions-only", action="store_true",
        help="with --positions: run exactly the methods listed, not the model's own RoPE besides (list none "
             "to include it); e.g. when own RoPE's rows at a long length are not needed",
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


def _config_flags(path: str, table: dict[str, Any], parser: argparse.ArgumentParser) -> list[str]:
    """The command-line flags that the TOML ``table`` stands for, each value checked by the option's
    own type and choices (the same checks as on the command line), or a LonglabError naming the key."""
    actions = {a.option_strings[0][2:]: a for a in parser._actions if a.option_strings  # noqa: SLF001
               and a.option_strings[0].startswith("--") and a.dest not in ("help", "config")}
    flags: list[str] = []
    for key, value in table.items():
        name = key.replace("_", "-")
        action = actions.get(name)
        if action is None:
            raise LonglabError(f"{path}: unknown key {key!r}; allowed: {', '.join(sorted(actions))}")
        flag = f"--{name}"
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            if not isinstance(value, bool):
                raise LonglabError(f"{path}: {key} must be true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                flags.append(flag if value else f"--no-{name}")
            elif value:
                flags.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            raise LonglabError(f"{path}: {key} must be a string, a number or a non-empty list of them, "
                               f"got {value!r}")
        texts = [str(v) for v in items]
        if action.nargs != "+":  # one argument: a list is the comma-separated form
            texts = [",".join(texts)]
        for text in texts:
            try:
                parsed = action.type(text) if action.type else text
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise LonglabError(f"{path}: {key} = {value!r}: {exc}") from None
            if action.choices is not None and parsed not in action.choices:
                allowed = ", ".join(map(str, action.choices))
                raise LonglabError(f"{path}: {key} = {value!r}; allowed: {allowed}")
        flags += [flag, *texts]
    return flags


def config_argv(path: str | Path) -> list[str]:
    """``longlab eval`` flags from a TOML run configuration (``bench/configs/*.toml``): one top-level key
    per option, named as the option without its dashes. Unknown keys, wrong types, values an option
    refuses, a missing, oversized or malformed file: a LonglabError naming the file and the key."""
    path = str(path)
    file = Path(path)
    if not file.is_file():
        raise LonglabError(f"--config: {path} is not a file")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LonglabError(f"--config: {path} is larger than {MAX_CONFIG_BYTES} bytes; expected a short TOML")
    try:
        table = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LonglabError(f"--config: {path} is not valid TOML: {exc}") from None
    parser = argparse.ArgumentParser(prog="longlab eval")
    add_eval_arguments(parser)
    return _config_flags(path, table, parser)


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` (``eval ...``) with ``--config FILE`` replaced by the file's flags, placed before the
    other options so that those given on the command line win (argparse keeps the last value)."""
    if not argv or argv[0] != "eval":
        return argv
    rest = list(argv[1:])
    files = []
    i = 0
    while i < len(rest):
        if rest[i] == "--config":
            if i + 1 >= len(rest):
                raise LonglabError("--config: expected a TOML file")
            files.append(rest[i + 1])
            del rest[i : i + 2]
        elif rest[i].startswith("--config="):
            files.append(rest.pop(i).split("=", 1)[1])
        else:
            i += 1
    if len(files) > 1:
        raise LonglabError("--config: give one file")
    return ["eval", *(config_argv(files[0]) if files else []), *rest]


def _print_score_tables(out: str) -> None:
    """The score tables with 95% confidence intervals and paired differences vs ``full``, the sentence
    on how to read them, then the prefill-metrics table when there is one."""
    from ..eval.report import load_metrics, load_rows, prefill_table, score_table

    rows = load_rows(out)
    print()
    print(score_table(rows))  # ends with the how-to-read sentence
    prefill = prefill_table(rows, load_metrics(out))
    if prefill:
        print(prefill + "\n")
    from ..eval.spec_tables import spec_markdown  # the speculative axis: speed, bytes against plain decoding

    speculation = spec_markdown(rows)
    if speculation:
        print(speculation + "\n")


def cmd_eval(args: argparse.Namespace) -> int:
    """``longlab eval``: run the grid, then print the summary table and the report's paths."""
    from ..eval.config import EvalConfig
    from ..eval.driver import run_eval

    config = EvalConfig(
        out=args.out, model=args.model, recipes=args.recipes, tasks=args.tasks, lengths=args.lengths,
        samples=args.samples, seed=args.seed, query_aware=args.query_aware, chunk_size=args.chunk_size,
        max_new_tokens=args.max_new_tokens, limit=args.limit, jsonl=args.jsonl, depths=args.depths,
        backend=args.backend, workers=args.workers, threads=args.threads, batch_decode=args.batch_decode,
        prefill_metrics=args.prefill_metrics, metric_rows=args.metric_rows, compress=args.compress,
        skip_rows=args.skip_rows, report=not args.no_report, progress=not args.no_progress,
        positions=args.positions, positions_only=args.positions_only,
        reuse=args.reuse, num_docs=args.num_docs, speculative=args.speculative,
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
