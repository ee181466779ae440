"""``longlab memory cdic|persist ...``: C-DIC (the lab's revisable per-thread memory) and PersistBench /
``memory_safety`` (argparse only; torch is imported when a command runs). ``add_cdic_parser`` and
``add_persist_parser`` add their subcommands to the ``longlab memory`` subparsers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import LonglabError

__all__ = ["add_cdic_parser", "add_memory_parser", "add_persist_parser"]


def _threads(n: int) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ persist
def add_persist_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("persist", help="PersistBench: memory_safety, generations for a judge, FR@K")
    sub = p.add_subparsers(dest="persist_command", required=True)
    s = sub.add_parser(
        "safety", help="judge-free memory_safety (leakage, sycophancy) with and without memories"
    )
    s.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, qwen2.5-0.5b, ...")
    s.add_argument("--out", required=True, help="results directory (results.sqlite)")
    s.add_argument("--n", type=int, default=200, help="items per kind (default 200)")
    s.add_argument("--kinds", default="leakage,sycophancy")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-tokens", type=int, default=40)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--threads", type=int, default=0)
    s.add_argument(
        "--memory-system",
        default="raw",
        choices=("raw", "hgmem"),
        help="raw: the memories verbatim, with and without (default); hgmem: the memory points of an HGMem "
        "memory the model builds per item (the HGMem flags below), recipe hgmem-memories",
    )
    s.add_argument("--embedder", default="hash", choices=("minilm", "hash"), help="HGMem's embedder (hash)")
    from ..memory.persist import PERSIST_HGMEM
    from .memory import add_hgmem_arguments

    h = s.add_argument_group("HGMem loop (with --memory-system hgmem; recorded in every row)")
    add_hgmem_arguments(s, h, **PERSIST_HGMEM)
    s.set_defaults(func=_persist_safety)

    g = sub.add_parser("generate", help="generations on a PersistBench JSONL, stored for an external judge")
    g.add_argument("--data", required=True, help="PersistBench JSONL (memories, query, failure_type, ...)")
    g.add_argument("--model", help="local longlab model (or --base-url URL --endpoint-model NAME)")
    g.add_argument(
        "--base-url", help="OpenAI-compatible API root of the model under test (longlab serve, vLLM, ...)"
    )
    g.add_argument("--endpoint-model", help="the endpoint's model name (with --base-url)")
    g.add_argument("--out", required=True, help="JSONL of generations (a new file)")
    g.add_argument("--limit", type=int)
    g.add_argument(
        "--generations", type=int, help="at most this many per entry (default: 3/3/1 as the paper)"
    )
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--threads", type=int, default=0)
    g.set_defaults(func=_persist_generate)

    j = sub.add_parser("judge", help="score stored generations through an OpenAI-compatible endpoint; FR@K")
    j.add_argument("records", help="JSONL written by `persist generate`")
    j.add_argument(
        "--judge-url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    j.add_argument("--judge-model", required=True)
    j.add_argument("--out", required=True, help="JSONL of judged records (a new file)")
    j.add_argument("--k", type=int, default=3)
    j.set_defaults(func=_persist_judge)

    r = sub.add_parser("report", help="memory_safety rates with 95%% intervals from a results directory")
    r.add_argument("dir")
    r.set_defaults(func=_persist_report)


def _read_jsonl(path: str, flag: str) -> list[dict]:
    from ..safeio import read_user_file

    out = []
    for i, line in enumerate(read_user_file(path, flag).decode("utf-8", "strict").splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LonglabError(f"{flag} line {i}: not JSON ({exc.msg})") from None
            need = ("id", "failure_type", "memories", "query", "generation", "response")
            if not isinstance(obj, dict) or any(k not in obj for k in need):
                raise LonglabError(f"{flag} line {i}: a generation record needs {', '.join(need)}")
            out.append(obj)
    return out


def _write_new(path: str, lines: list[str], flag: str) -> None:
    from pathlib import Path

    from ..safeio import write_file_atomic

    if Path(path).exists():
        raise LonglabError(f"{flag}: {path} exists; longlab never overwrites it: give a new file")
    write_file_atomic(path, "".join(line + "\n" for line in lines), flag)


def _persist_hgmem_config(args: argparse.Namespace) -> Any:
    """The HGMem configuration of ``--memory-system hgmem`` (the same HGMem flags as ``memory run|eval``,
    with this command's smaller defaults, :func:`longlab.memory.persist.persist_hgmem_config`'s); the flags
    are refused with ``--memory-system raw``, where nothing would read them."""
    from .memory import hgmem_config_from_args, hgmem_flags_given

    given = hgmem_flags_given(args)
    if args.memory_system != "hgmem":
        if given:
            raise LonglabError(f"{', '.join(given)}: only with --memory-system hgmem")
        return None
    return hgmem_config_from_args(args)


def _persist_safety(args: argparse.Namespace) -> int:
    from ..memory.persist import run_memory_safety

    cfg = _persist_hgmem_config(args)
    _threads(args.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.memory_system == "hgmem":
        from ..memory.embed import make_embedder
        from ..memory.persist import run_memory_safety_hgmem

        n = run_memory_safety_hgmem(
            args.model,
            args.out,
            n=args.n,
            kinds=kinds,
            seed=args.seed,
            max_tokens=args.max_tokens,
            embedder=make_embedder(args.embedder),
            config=cfg,
            log=_log,
        )
        print(f"{n} rows written to {args.out}")
        return 0
    n = run_memory_safety(
        args.model,
        args.out,
        n=args.n,
        kinds=kinds,
        seed=args.seed,
        max_tokens=args.max_tokens,
        batch=args.batch,
        log=_log,
    )
    print(f"{n} rows written to {args.out}")
    return 0


def _persist_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..memory.backend import LocalBackend
    from ..memory.persist import generate_records, load_persistbench
    from ..models import load_model

    if Path(args.out).exists():
        raise LonglabError(f"--out: {args.out} exists; longlab never overwrites it: give a new file")
    if bool(args.model) == bool(args.base_url):
        raise LonglabError(
            "give exactly one model under test: --model NAME (local) or --base-url URL --endpoint-model NAME"
        )
    if args.base_url and not args.endpoint_model:
        raise LonglabError("--base-url needs --endpoint-model (the model name the endpoint serves)")
    backend: Any = None
    if args.base_url:  # the URL is checked before any data is read
        from ..memory.persist import openai_judge

        # the judge's OpenAI-compatible chat backend, here for the model under test
        backend = openai_judge(
            args.base_url,
            args.endpoint_model,
            os.environ.get("OPENAI_API_KEY", "none"),
            url_flag="--base-url",
            model_flag="--endpoint-model",
        )
    entries = load_persistbench(args.data, limit=args.limit)
    if backend is None:
        _threads(args.threads)
        model, tok = load_model(args.model)
        backend = LocalBackend(model, tok, name=args.model)
    recs = generate_records(entries, backend, max_tokens=args.max_tokens, generations=args.generations)
    _write_new(args.out, [json.dumps(r, ensure_ascii=False) for r in recs], "--out")
    print(f"{len(recs)} generations of {len(entries)} entries written to {args.out}")
    return 0


def _persist_judge(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from ..memory.persist import fr_table, judge_records, openai_judge

    if Path(args.out).exists():
        raise LonglabError(f"--out: {args.out} exists; longlab never overwrites it: give a new file")
    judge = openai_judge(args.judge_url, args.judge_model, os.environ.get("OPENAI_API_KEY", "none"))
    recs = _read_jsonl(args.records, "records")
    judged = judge_records(recs, judge)
    _write_new(args.out, [json.dumps(r, ensure_ascii=False) for r in judged], "--out")
    for ft, (rate, n, hits) in sorted(fr_table(judged, args.k).items()):
        print(f"{ft}: FR@{args.k} = {rate:.1f}% ({hits}/{n} entries)")
    return 0


def _persist_report(args: argparse.Namespace) -> int:
    from ..memory.persist import safety_report

    print(safety_report(args.dir))
    return 0


# ------------------------------------------------------------------------------------------ cdic
def add_cdic_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cdic", help="C-DIC: revisable per-thread compressed memory (layers lab)")
    sub = p.add_subparsers(dest="cdic_command", required=True)
    t = sub.add_parser("train", help="train C-DIC (ra-TBPTT) or the token-LM baseline on dialogue_threads")
    t.add_argument(
        "--system",
        required=True,
        choices=("cdic", "tokens"),
        help="cdic: the compressor/reader; tokens: the LM read by full-history and last-k",
    )
    t.add_argument("--out", required=True, help="checkpoint directory (new or longlab's)")
    t.add_argument("--minutes", type=float, default=10.0, help="wall-time budget of training")
    t.add_argument("--max-steps", type=int, default=100_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.set_defaults(func=_cdic_train)

    e = sub.add_parser(
        "eval", help="accuracy by distance and revisions, per-turn latency, into a results store"
    )
    e.add_argument("--cdic", required=True, help="C-DIC checkpoint directory")
    e.add_argument("--tokens", required=True, help="token-LM checkpoint directory")
    e.add_argument("--out", required=True, help="results directory")
    e.add_argument("--per-cell", type=int, default=24, help="questions per (distance, revisions) cell")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=1)
    e.set_defaults(func=_cdic_eval)

    r = sub.add_parser("report", help="tables with 95%% intervals and paired tests from a results directory")
    r.add_argument("dir")
    r.set_defaults(func=_cdic_report)


def _cdic_train(args: argparse.Namespace) -> int:
    from ..memory.cdic import train_system

    _threads(args.threads)
    info = train_system(
        args.system, args.out, minutes=args.minutes, max_steps=args.max_steps, seed=args.seed, log=_log
    )
    print(json.dumps(info))
    return 0


def _cdic_eval(args: argparse.Namespace) -> int:
    from ..memory.cdic import evaluate_systems

    _threads(args.threads)
    n = evaluate_systems(args.cdic, args.tokens, args.out, per_cell=args.per_cell, seed=args.seed, log=_log)
    print(f"{n} rows written to {args.out}")
    return 0


def _cdic_report(args: argparse.Namespace) -> int:
    from ..memory.cdic import cdic_report

    print(cdic_report(args.dir))
    return 0


def add_memory_parser(subparsers: Any) -> None:
    """A minimal ``longlab memory`` with ``cdic`` and ``persist`` (the full command lives in
    cli/memory.py)."""
    p = subparsers.add_parser("memory", help="memory systems over long interactions (C-DIC, PersistBench)")
    sub = p.add_subparsers(dest="memory_command", required=True)
    add_cdic_parser(sub)
    add_persist_parser(sub)
