"""``longlab data entropylong|groundtruth``: build long-context training data (EntropyLong, arXiv 2510.02330).

``entropylong`` extends each document of a corpus (``--corpus DIR``: a folder of .txt/.jsonl files or a
ground-truth folder; or ``--generate N``: a ground-truth corpus made in memory) with distant chunks that
lower the scorer model's entropy at its uncertain positions, writing JSONL (or Parquet) with provenance
(:func:`longlab.data.entropylong.build_dataset`). ``groundtruth`` writes a corpus whose true source card
of every dependent position is known (:func:`longlab.data.groundtruth.generate_corpus`). Every setting is
checked before a model loads; ``--out`` is never a file longlab did not write.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_data_parser"]

CONFIG_FLAGS = ("alpha", "merge_gap", "query_tokens", "top_k", "chunk_tokens", "delta", "retriever",
                "target_tokens", "max_doc_tokens", "max_queries", "prefill_chunk", "batch_tokens", "seed",
                "selection")


def add_data_parser(sub: Any) -> None:
    from ..data.entropylong import EntropyLongConfig

    d = sub.add_parser("data", help="build long-context training data (EntropyLong) and ground-truth corpora")
    dsub = d.add_subparsers(dest="data_command", required=True)
    defaults = EntropyLongConfig()
    e = dsub.add_parser("entropylong", help="extend documents with entropy-verified distant chunks "
                        "(EntropyLong, arXiv 2510.02330)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus",
                     help="folder of .txt / .jsonl documents, or a `longlab data groundtruth` folder")
    src.add_argument("--generate", type=int, metavar="N",
                     help="generate a ground-truth corpus of N documents")
    e.add_argument("--cards", type=int, default=None, help="with --generate: entity cards (default 10 x N)")
    e.add_argument("--out", required=True,
                   help="output file: .jsonl, or .parquet (pyarrow: pip install 'longlab[data]'); resumes "
                   "OUT.partial of an interrupted run")
    e.add_argument("--restart", action="store_true",
                   help="discard OUT.partial of an interrupted run (other settings or code version), start "
                   "over")
    e.add_argument("--model", default="smollm2-135m", help="scorer model (default smollm2-135m)")
    e.add_argument("--max-docs", type=int, default=None, help="extend only the first N documents")
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name in CONFIG_FLAGS:
        flag = "--" + name.replace("_", "-")
        value = getattr(defaults, name)
        if name == "retriever":
            e.add_argument(flag, default=value, help=f"embedding (all-MiniLM-L6-v2 cosine) or bm25 "
                           f"(default {value})")
        elif name == "selection":
            e.add_argument(flag, default=value, help="chunks before the document: verification (kept if "
                           "dH >= delta; the paper), retrieval (every retrieved chunk) or random (as many, "
                           f"uniformly from the pool): the baselines (default {value})")
        else:
            e.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    e.set_defaults(func=entropylong_main)

    g = dsub.add_parser("groundtruth", help="write a corpus with known long-range dependencies")
    g.add_argument("--docs", type=int, required=True, help="documents, in [1, 100000]")
    g.add_argument("--cards", type=int, required=True, help="entity cards, in [1, 1000000]")
    g.add_argument("--out", required=True, help="output folder (new, empty, or one this command wrote)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--refs-per-doc", type=int, default=2, help="entities a document uses (default 2)")
    g.add_argument("--uses-per-ref", type=int, default=2, help="attributes used per entity (default 2)")
    g.set_defaults(func=groundtruth_main)


def _flagged(exc: Exception, names: dict[str, str]) -> Exception:
    from ..errors import LonglabError

    text = str(exc)
    for name, flag in names.items():
        if text.startswith(f"{name} must"):
            return LonglabError(f"{flag}{text[len(name):]}")
    return exc


def groundtruth_main(args: argparse.Namespace) -> int:
    from ..data.groundtruth import generate_corpus, owns_groundtruth_dir, write_corpus
    from ..errors import LonglabError
    from ..safeio import check_output_dir

    check_output_dir(args.out, "--out", owned=owns_groundtruth_dir, what="ground-truth corpus")
    names = {"docs": "--docs", "cards": "--cards", "seed": "--seed", "refs_per_doc": "--refs-per-doc",
             "uses_per_ref": "--uses-per-ref"}
    try:
        corpus = generate_corpus(args.docs, args.cards, seed=args.seed, refs_per_doc=args.refs_per_doc,
                                 uses_per_ref=args.uses_per_ref)
    except LonglabError as exc:
        raise _flagged(exc, names) from None
    path = write_corpus(corpus, args.out)
    deps = sum(len(v) for v in (corpus.truth or {}).values())
    print(f"wrote {path}: {len(corpus.documents)} documents, {len(corpus.pool)} cards, "
          f"{deps} dependent values")
    return 0


def entropylong_main(args: argparse.Namespace) -> int:
    from ..data.entropylong import EntropyLongConfig, MiniLMEmbedder, build_dataset, owns_output
    from ..data.groundtruth import generate_corpus, load_corpus
    from ..errors import LonglabError, check_range
    from ..safeio import check_output_file

    cfg = EntropyLongConfig(**{n: getattr(args, n) for n in CONFIG_FLAGS}).validate()
    if args.max_docs is not None:
        check_range("--max-docs", args.max_docs, 1, 1_000_000, integer=True)
    if args.threads is not None:
        check_range("--threads", args.threads, 1, 1024, integer=True)
    if args.generate is not None:
        check_range("--generate", args.generate, 1, 100_000, integer=True)
        cards = 10 * args.generate if args.cards is None else args.cards
        try:
            corpus = generate_corpus(args.generate, cards, seed=cfg.seed)
        except LonglabError as exc:
            raise _flagged(exc, {"cards": "--cards", "docs": "--generate"}) from None
    else:
        if args.cards is not None:
            raise LonglabError("--cards: an option of --generate, not of --corpus")
        corpus = load_corpus(args.corpus, "--corpus")
    if str(args.out).lower().endswith(".parquet"):
        import importlib.util

        if importlib.util.find_spec("pyarrow") is None:
            raise LonglabError("--out: a .parquet output needs pyarrow: pip install 'longlab[data]' "
                               "(or write .jsonl)")
    check_output_file(args.out, "--out", owned=owns_output, what="EntropyLong dataset")
    if cfg.retriever == "embedding":
        MiniLMEmbedder.check_installed()
    import torch

    from ..models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    summary = build_dataset(corpus, model, tokenizer, args.out, cfg, scorer=args.model,
                            progress=not args.no_progress, max_docs=args.max_docs,
                            restart=args.restart)
    if summary.get("complete_already"):
        print(f"{summary['out']} is complete already ({summary['documents']} documents, same settings)")
    else:
        print(f"wrote {summary['out']}: {summary['documents']} documents ({summary['skipped']} resumed, "
              f"{summary['written']} new; {summary['selected_chunks_new']} {summary['selected_kind']} chunks "
              "in the new ones)")
    return 0
