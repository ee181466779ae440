"""Slim a committed results store in place: drop per-row detail no page reads, shorten run keys, repack.

    python bench/pack_store.py bench/results/lab_results --drop checkpoint --short-keys
    python bench/pack_store.py bench/results/compression/redundant_niah --drop context.kept_spans@hico,comi

``DIR/results.sqlite.gz`` (or ``DIR/results.sqlite``) is copied to a private directory, edited there with
SQL (no row is re-added, so provenance columns stay as measured), VACUUMed, gzipped with mtime 0 (no
timestamp in the archive) and renamed over ``DIR/results.sqlite.gz``; a plain ``results.sqlite`` is then
removed. Only longlab result stores are accepted (``ResultStore`` opens them read-only first); a store with
``metrics`` rows is refused (the pack would have to keep their run keys in step).

- ``--drop KEY[@METHOD,...]``: remove ``extra.KEY`` (dotted: ``context.kept_spans``) from every row, or only
  from rows of those methods. What a page or a bench command reads must stay (the needle check of
  ``bench/compression_table.py`` reads ``kept_spans`` of llmlingua, longllmlingua and tpp rows).
- ``--short-keys``: cut run keys to 16 hex digits (64 bits; refused unless they stay unique). A store packed
  so no longer resumes a ``longlab eval`` run (its keys are the full hash): for stores written by commands
  that do not resume into them (the lab and memory stores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from longlab.errors import LonglabError
from longlab.eval.store import ResultStore

SHORT_KEY = 16


def _drop(extra: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node: Any = extra
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False


def pack(out_dir: str | Path, drops: list[str], short_keys: bool) -> dict[str, int]:
    """Slim and repack ``out_dir``'s store; returns ``{"rows", "dropped", "bytes_before", "bytes_after"}``."""
    out = Path(out_dir)
    packed, plain = out / "results.sqlite.gz", out / "results.sqlite"
    source = plain if plain.is_file() else packed
    before = source.stat().st_size if source.is_file() else 0
    with ResultStore(out, readonly=True, what=str(out)) as store:  # a longlab store, checked
        if store.metrics():
            raise LonglabError(f"{out}: the store has metrics rows; pack_store keeps rows only")
    rules = []
    for spec in drops:
        key, _, methods = spec.partition("@")
        rules.append((key, set(filter(None, methods.split(",")))))
    with tempfile.TemporaryDirectory(prefix="longlab-pack-") as tmp:
        work = Path(tmp) / "results.sqlite"
        if source == packed:
            with gzip.open(packed, "rb") as src, open(work, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copyfile(plain, work)
        con = sqlite3.connect(work)
        rows = con.execute("SELECT id, method, extra FROM results").fetchall()
        dropped = 0
        for rid, method, text in rows:
            extra = json.loads(text) if text else {}
            hit = sum(_drop(extra, key) for key, methods in rules if not methods or method in methods)
            if hit:
                dropped += hit
                con.execute("UPDATE results SET extra = ? WHERE id = ?", (json.dumps(extra), rid))
        if short_keys:
            keys = [k for (k,) in con.execute("SELECT run_key FROM results")]
            if len({k[:SHORT_KEY] for k in keys}) != len(keys):
                raise LonglabError(f"{out}: two run keys share their first {SHORT_KEY} hex digits")
            con.execute(f"UPDATE results SET run_key = substr(run_key, 1, {SHORT_KEY})")
        con.commit()
        con.execute("PRAGMA journal_mode = DELETE")
        con.execute("VACUUM")
        con.close()
        tmp_gz = out / f".results.sqlite.gz.{os.getpid()}.tmp"  # ours: renamed over the store, or removed
        try:
            with open(work, "rb") as src, open(tmp_gz, "wb") as raw:
                with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
                    shutil.copyfileobj(src, gz)
            os.replace(tmp_gz, packed)
        except BaseException:
            tmp_gz.unlink(missing_ok=True)
            raise
    if source == plain:
        plain.unlink()  # the store it packed, now in results.sqlite.gz
    return {"rows": len(rows), "dropped": dropped, "bytes_before": before,
            "bytes_after": packed.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a results directory holding results.sqlite(.gz)")
    ap.add_argument("--drop", action="append", default=[], metavar="KEY[@METHOD,...]")
    ap.add_argument("--short-keys", action="store_true")
    args = ap.parse_args(argv)
    r = pack(args.dir, args.drop, args.short_keys)
    print(f"{args.dir}: {r['rows']} rows, {r['dropped']} fields dropped, "
          f"{r['bytes_before']} -> {r['bytes_after']} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
