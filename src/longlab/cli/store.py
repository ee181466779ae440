"""``longlab store add|list|rm|gc``: manage a per-document KV store from the command line.

Documents are stored in their prompt layout (:func:`~longlab.reuse.api.doc_segment`), so a later
``longlab generate --docs FILE ... --reuse METHOD --store DIR`` reads them instead of prefilling them
(APE's prefix-conditioned entries are made at their first use).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..errors import LonglabError
from ..paths import cache_dir

__all__ = ["add_store_parser", "add_store_arguments", "store_main", "default_store_dir"]


def default_store_dir() -> Path:
    """``$LONGLAB_CACHE/docstore`` (default ``~/.cache/longlab/docstore``)."""
    return cache_dir() / "docstore"


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_store_parser(sub: Any) -> None:
    from .common import read_context_file

    st = sub.add_parser("store", help="per-document KV store for --docs: add | list | rm | gc")
    add_store_arguments(st)
    st.set_defaults(func=lambda a: store_main(a, read_context_file))


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Per-document KV store for RAG prompts (safetensors files + an SQLite index)."
    sub = parser.add_subparsers(dest="store_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="DIR", help=f"store directory (default: {default_store_dir()})")
    a = sub.add_parser("add", parents=[common], help="prefill documents alone and store their KV")
    a.add_argument("files", nargs="+", metavar="FILE")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--encoding", default="utf-8")
    a.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    a.add_argument("--max-bytes", type=_nonneg_int, help="evict least recently used entries beyond this size")
    sub.add_parser("list", parents=[common], help="list the stored documents")
    r = sub.add_parser("rm", parents=[common], help="remove entries by id")
    r.add_argument("ids", nargs="+", metavar="ID")
    g = sub.add_parser("gc", parents=[common], help="drop bad entries and orphan files; evict to --max-bytes")
    g.add_argument("--max-bytes", type=_nonneg_int)


def store_main(args: argparse.Namespace, read_text=None) -> int:
    """Run one ``longlab store`` command; ``read_text(name, encoding, flag)`` reads a document file."""
    from ..reuse.api import doc_segment
    from ..reuse.docstore import DocStore

    root = Path(args.store) if args.store else default_store_dir()
    cmd = args.store_command
    if cmd == "add":
        from ..models import load_model

        texts = [read_text(f, args.encoding, "store add") for f in args.files]  # read before the model loads
        store = DocStore(root, dtype=args.dtype, max_bytes=args.max_bytes)
        model, tokenizer = load_model(args.model)
        for name, text in zip(args.files, texts):
            start = time.perf_counter()
            doc_id = store.put(model, tokenizer, doc_segment(text))
            entry = next(e for e in store.entries() if e.doc_id == doc_id)
            print(f"{doc_id}  {entry.n_tokens:>6} tokens  {entry.nbytes / 2**20:8.2f} MiB  "
                  f"{time.perf_counter() - start:6.2f}s  {name}")
        return 0
    if cmd == "list":
        if not (root / "index.sqlite").is_file():
            print(f"no document store at {root}")
            return 0
        store = DocStore(root, readonly=True)
        entries = store.entries()
        print(f"{len(entries)} entries, {store.total_bytes() / 2**20:.2f} MiB in {root}")
        for e in entries:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
            preview = " ".join(e.text.split())[:40]
            print(f"{e.doc_id}  {e.n_tokens:>6} tok  {e.nbytes / 2**20:8.2f} MiB  {e.dtype:<8}  {used}  "
                  f"{e.model_name[:24]:<24}  {preview}")
        return 0
    if not (root / "index.sqlite").is_file():  # rm and gc never create a store
        raise LonglabError(f"store {cmd}: no document store at {root}")
    store = DocStore(root)
    if cmd == "rm":
        missing = [i for i in args.ids if not store.remove(i)]
        if missing:
            raise LonglabError(f"store rm: unknown document id(s): {', '.join(missing)}")
        print(f"removed {len(args.ids)} entries")
        return 0
    out = store.gc(max_bytes=args.max_bytes)
    print(f"gc: {out['bad_rows']} bad entries, {out['orphan_files']} orphan files removed, "
          f"{out['evicted']} evicted; {len(store)} entries, {store.total_bytes() / 2**20:.2f} MiB left")
    return 0
