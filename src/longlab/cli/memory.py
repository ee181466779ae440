"""``longlab memory run|eval ...``: memory systems over long documents and dialogues (issue #31).

``longlab memory run --doc FILE --question Q [--system hgmem]`` answers one question (prints the answer and
what it cost); ``longlab memory eval --task longdoc_multihop --length 2048 --samples 24 --systems hgmem rag
context:full context:snapkv@0.5 context:kivi4 reuse --out DIR`` stores one row per (system, sample) in
DIR/results.sqlite for ``longlab report DIR --baseline context:full``.

The backend is the local engine (``--model NAME [--recipe R]``) or any OpenAI-compatible endpoint
(``--base-url http://127.0.0.1:8000/v1 --endpoint-model NAME``). Further ``memory`` subcommands plug in
through :data:`SUBCOMMANDS` (``(module, function)`` pairs; a module that is not there is skipped).
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from ..errors import LonglabError

__all__ = [
    "add_memory_parser", "SUBCOMMANDS", "backend_from_args", "add_backend_arguments", "add_hgmem_arguments",
    "hgmem_config_from_args", "hgmem_flags_given",
]

#: memory subcommands: (module relative to longlab.cli, function adding its parser to memory's subparsers)
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    (".memory", "add_run_parser"),
    (".memory", "add_eval_parser"),
    (".memory", "add_page_parser"),
    (".memory_cdic", "add_cdic_parser"),
    (".memory_cdic", "add_persist_parser"),
)


def add_memory_parser(sub: Any) -> None:
    p = sub.add_parser("memory", help="memory systems (HGMem and baselines): run | eval")
    msub = p.add_subparsers(dest="memory_command", required=True)
    for module, func in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module, __package__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}{module}":
                continue  # that subcommand's module is not part of this tree
            raise
        getattr(mod, func)(msub)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend (one of --model or --base-url)")
    g.add_argument("--model", help="local longlab model name (e.g. qwen2.5-0.5b, tiny-llama)")
    g.add_argument("--recipe", default="full", help="KV recipe of every local chat call (default: full)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--endpoint-model", help="the endpoint's model name (with --base-url)")
    g.add_argument("--api-key", default="none", help="API key of the endpoint (default: none)")
    g.add_argument("--timeout", type=_positive(float), default=120.0, help="seconds per endpoint call")
    p.add_argument(
        "--embedder",
        default="minilm",
        choices=("minilm", "hash"),
        help="chunk/entity embeddings: all-MiniLM-L6-v2 (longlab[data]) or word hashing",
    )
    p.add_argument("--threads", type=_positive(int), help="torch CPU threads")
    h = p.add_argument_group("HGMem")
    add_hgmem_arguments(p, h, max_rounds=4, hops=2, top_chunks=4, top_entities=8, json_tokens=None)
    h.add_argument(
        "--answer-tokens",
        type=_positive(int),
        default=32,
        help="generated tokens of every system's answer (equal budget; 32)",
    )
    h.add_argument("--retries", type=int, default=1, help="re-asks of an invalid JSON reply (1)")


#: the HGMem loop's flags, the same wherever HGMem runs: (flag, HGMemConfig field, help); ranges are
#: :data:`longlab.memory.hgmem.HGMEM_RANGES`, checked when the command runs (the flag named)
HGMEM_FLAGS = (
    ("--max-rounds", "max_rounds", "plan/retrieve/evolve rounds"),
    ("--hops", "hops", "neighbourhood radius of local investigation"),
    ("--top-chunks", "top_chunks", "chunks retrieved per round"),
    ("--top-entities", "top_entities", "entities retrieved per round"),
    ("--json-tokens", "json_tokens", "cap on each JSON call's generated tokens (extract/plan/evolve/merge)"),
)


def add_hgmem_arguments(p: argparse.ArgumentParser, group: Any, **defaults: int | None) -> None:
    """The :data:`HGMEM_FLAGS` in ``group``, with this command's ``defaults`` (one per field; ``json_tokens``
    None: no cap). A flag left out stays None, so :func:`hgmem_flags_given` can tell what was given."""
    for flag, name, what in HGMEM_FLAGS:
        shown = "no cap" if defaults[name] is None else defaults[name]
        group.add_argument(flag, type=int, help=f"{what} (default {shown})")
    p.set_defaults(hgmem_defaults=dict(defaults))


def hgmem_flags_given(args: argparse.Namespace) -> list[str]:
    return [flag for flag, name, _ in HGMEM_FLAGS if getattr(args, name) is not None]


def hgmem_config_from_args(args: argparse.Namespace, **fields: Any) -> Any:
    """The checked :class:`~longlab.memory.hgmem.HGMemConfig` the HGMem flags name (the command's defaults
    where one is left out; a value outside its range is an error naming the flag), plus ``fields``."""
    from ..errors import check_range
    from ..memory.hgmem import HGMEM_RANGES, HGMemConfig

    values: dict[str, Any] = {}
    for flag, name, _ in HGMEM_FLAGS:
        value = getattr(args, name)
        value = args.hgmem_defaults[name] if value is None else value
        if value is not None:
            low, high = HGMEM_RANGES.get(name, HGMEM_RANGES["extract_tokens"])  # json_tokens: a JSON call's
            check_range(flag, value, low, high, integer=True)
        values[name] = value
    json_tokens = values.pop("json_tokens")
    return HGMemConfig.capped(json_tokens, **values, **fields)


def backend_from_args(args: argparse.Namespace) -> Any:
    """The backend the arguments name (a clear error when both or neither are given)."""
    from ..memory.backend import LocalBackend, OpenAIBackend, check_base_url

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if bool(args.model) == bool(args.base_url):
        raise LonglabError(
            "give exactly one backend: --model NAME (local) or --base-url URL --endpoint-model NAME"
        )
    if args.base_url:
        if not args.endpoint_model:
            raise LonglabError("--base-url needs --endpoint-model (the model name the endpoint serves)")
        url = check_base_url(args.base_url, flag="--base-url")  # errors name the flag
        return OpenAIBackend(url, args.endpoint_model, api_key=args.api_key, timeout=args.timeout)
    from ..models import build_tiny_model, tiny_tokenizer

    if args.model.startswith("tiny-"):  # the random test models built in code
        return LocalBackend(
            build_tiny_model(args.model), tiny_tokenizer(), recipe=args.recipe, name=args.model
        )
    return LocalBackend.load(args.model, recipe=args.recipe, dtype=args.dtype)


def config_from_args(args: argparse.Namespace) -> Any:
    return hgmem_config_from_args(args, answer_tokens=args.answer_tokens, retries=args.retries)


def _tokenizer_for(backend: Any) -> Any:
    tok = getattr(backend, "tokenizer", None)
    if tok is None:  # an endpoint: count and cut with the tiny tokenizer's words (no hub)
        return None
    return tok


def add_run_parser(msub: Any) -> None:
    p = msub.add_parser("run", help="answer one question about one document with one system")
    p.add_argument("--doc", required=True, metavar="FILE", help="the document (UTF-8 text)")
    p.add_argument("--question", required=True)
    p.add_argument(
        "--system",
        default="hgmem",
        help="hgmem | rag[:k=N] | context:RECIPE | reuse[:METHOD] (default: hgmem)",
    )
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    add_backend_arguments(p)
    p.set_defaults(func=cmd_run)


def add_eval_parser(msub: Any) -> None:
    p = msub.add_parser("eval", help="systems x samples -> rows in DIR/results.sqlite")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--task", choices=("longdoc_multihop",), help="generated task")
    src.add_argument(
        "--data", metavar="FILE", help="your own JSONL (NarrativeQA-/LoCoMo-style; see longlab.tasks.longdoc)"
    )
    p.add_argument("--length", type=_positive(int), default=2048, help="document tokens (generated task)")
    p.add_argument("--samples", type=_positive(int), default=24, help="questions (default 24)")
    p.add_argument("--questions-per-doc", type=_positive(int), default=8)
    p.add_argument("--distractors", type=int, default=8, help="headquarters facts nobody asks about (8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-doc", type=int, default=0, help="skip the first N documents (split runs)")
    p.add_argument("--docs", type=_positive(int), help="run only this many documents")
    p.add_argument(
        "--systems",
        nargs="+",
        default=["hgmem", "rag"],
        metavar="SYSTEM",
        help="hgmem rag[:k=N] context:RECIPE reuse[:METHOD] (default: hgmem rag)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="results directory")
    add_backend_arguments(p)
    p.set_defaults(func=cmd_eval)


def cmd_run(args: argparse.Namespace) -> int:
    from ..memory.embed import make_embedder
    from ..memory.runner import parse_system, run_systems
    from ..tasks.sample import Sample
    from .common import read_context_file

    parse_system(args.system)
    config = config_from_args(args)  # flag ranges are checked before anything is loaded
    doc = read_context_file(args.doc, flag="--doc")
    if not args.question.strip():
        raise LonglabError("--question is empty")
    embedder = make_embedder(args.embedder)
    backend = backend_from_args(args)
    sample = Sample(context=doc, question=args.question, task="memory_run", sample_id="run")
    (row,) = run_systems(
        backend,
        [sample],
        [args.system],
        embedder=embedder,
        config=config,
        tokenizer=_tokenizer_for(backend),
        log=lambda m: None,
    )
    print(row["prediction"])
    ex = row["extra"]
    if args.json:
        print(json.dumps(ex, default=str))
    else:
        print(
            f"[{args.system}] {ex['wall_per_question_s']:.1f} s, {ex.get('calls')} calls, "
            f"{ex.get('generated_per_question') or 0:.0f} generated tokens"
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..eval.store import ResultStore
    from ..memory.embed import make_embedder
    from ..memory.runner import parse_system, run_systems

    for s in args.systems:
        parse_system(s)
    if args.first_doc < 0:
        raise LonglabError(f"--first-doc must be >= 0, got {args.first_doc}")
    config = config_from_args(args)  # flag ranges are checked before anything is loaded
    embedder = make_embedder(args.embedder)
    backend = backend_from_args(args)
    tokenizer = _tokenizer_for(backend)
    if args.data:
        from ..tasks.longdoc import load_memory_jsonl

        samples = load_memory_jsonl(args.data)[: args.samples]
    else:
        from ..models import tiny_tokenizer
        from ..tasks.longdoc import longdoc_multihop

        samples = longdoc_multihop(
            tokenizer or tiny_tokenizer(),
            args.length,
            args.samples,
            args.seed,
            questions_per_doc=args.questions_per_doc,
            distractors=args.distractors,
        )
    docs = list(dict.fromkeys(s.metadata.get("doc") for s in samples))
    keep = set(docs[args.first_doc : args.first_doc + args.docs if args.docs else None])
    samples = [s for s in samples if s.metadata.get("doc") in keep]
    if not samples:
        raise LonglabError(f"--first-doc {args.first_doc} leaves no documents (there are {len(docs)})")
    with ResultStore(args.out) as store:
        rows = run_systems(
            backend,
            samples,
            args.systems,
            embedder=embedder,
            store=store,
            config=config,
            seed=args.seed,
            tokenizer=tokenizer,
        )
    print(f"{len(rows)} new rows in {args.out}; tables: longlab report {args.out} --baseline context:full")
    return 0


HGMEM_TITLE = "HGMem vs its baselines: multi-hop QA over long documents (issue #31)"


def add_page_parser(msub: Any) -> None:
    p = msub.add_parser("page", help="the HGMem results page (Markdown) from results directories")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="results directories (only read)")
    p.add_argument("--out", required=True, metavar="FILE", help="Markdown file to write")
    p.add_argument("--intro", metavar="FILE", help="Markdown put before the tables")
    p.add_argument("--notes", metavar="FILE", help="Markdown put after the tables")
    p.add_argument("--title", default=HGMEM_TITLE)
    p.set_defaults(func=cmd_page)


def cmd_page(args: argparse.Namespace) -> int:
    from ..memory.report import write_page
    from .common import read_context_file

    intro = read_context_file(args.intro, flag="--intro") if args.intro else ""
    notes = read_context_file(args.notes, flag="--notes") if args.notes else ""
    write_page(args.dirs, args.out, title=args.title, intro=intro, notes=notes)
    print(f"wrote {args.out}")
    return 0
