"""Commit the memory measurements (issue #31) as slim stores and fill their pages.

    PYTHONPATH=src python bench/memory_docs.py --hgmem RUNDIR... --cdic RUNDIR/store --persist RUNDIR

copies the rows of each run store into ``bench/results/memory-hgmem``, ``bench/results/memory_cdic`` and
``bench/results/memory_persist`` as ``results.sqlite.gz`` (a new store, VACUUMed and gzipped; HGMem's
per-question memory dumps and chunk lists are dropped, its loop trace is kept as the plan decisions, the
number of memory points, of failed JSON calls and of dropped instruction echoes — what the page reports;
packed by ``bench/pack_store.py``, run keys cut to 16 hex digits), then rewrites the generated blocks
of ``docs/results/memory-{hgmem,cdic,persistbench}.md`` (``longlab.eval.pages.memory``; the same as
``longlab report --docs --page memory-hgmem`` etc.). A destination that exists and was not written by this
script is refused.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pack_store import pack

from longlab.errors import LonglabError
from longlab.eval.docs_tables import generate_docs
from longlab.eval.pages.memory import CDIC_DIR, HGMEM_DIR, PERSIST_DIR
from longlab.eval.store import ResultStore

MARK = ".memory_docs"  # a destination directory written by this script holds this file


def slim_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` without HGMem's per-question memory dump and chunk lists; the trace reduced to the plan
    decisions, the memory point count and the failed JSON calls."""
    ex = dict(extra or {})
    for key in ("memory", "chunks", "stored", "pieces"):
        if not isinstance(ex.get(key), (int, float)):  # HGMem's "chunks" count stays; lists go
            ex.pop(key, None)
    tr = ex.get("trace")
    if isinstance(tr, dict):
        ex["trace"] = {
            "rounds": [{"decision": s.get("decision")} for s in tr.get("rounds", [])],
            "points": tr.get("points", 0),
            "json_failures": tr.get("json_failures", 0),
            "instruction_copies": tr.get("instruction_copies", 0),  # the page's instructions note counts them
        }
    return ex


def export(sources: list[str], dest: str) -> int:
    """Rows of every source store -> ``dest/results.sqlite.gz`` (newest row per run key). Returns the rows."""
    out = Path(dest)
    if out.exists() and not (out / MARK).is_file():
        raise LonglabError(f"{dest} exists and was not written by bench/memory_docs.py; move it away")
    rows: dict[str, dict[str, Any]] = {}
    for s in sources:
        with ResultStore(s, readonly=True, what=s) as st:
            for r in st.rows():
                r = dict(r)
                r.pop("id", None)
                r["extra"] = slim_extra(r.get("extra"))
                rows[r["run_key"]] = r
    if not rows:
        raise LonglabError(f"no rows in {sources}")
    with tempfile.TemporaryDirectory() as tmp:
        with ResultStore(tmp) as st:
            st.add_many(rows.values())
        pack(tmp, [], short_keys=True)  # VACUUM, run keys cut to 16 hex digits, gzip with mtime 0
        out.mkdir(parents=True, exist_ok=True)
        (out / MARK).write_text("written by bench/memory_docs.py\n")
        shutil.copyfile(Path(tmp) / "results.sqlite.gz", out / "results.sqlite.gz")
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hgmem", nargs="+", metavar="DIR", help="HGMem + baseline run stores")
    ap.add_argument("--cdic", nargs="+", metavar="DIR", help="C-DIC run store(s)")
    ap.add_argument("--persist", nargs="+", metavar="DIR", help="memory_safety run store(s)")
    ap.add_argument("--root", default=".", help="repository root")
    a = ap.parse_args()
    root = Path(a.root)
    for srcs, dest, page in (
        (a.hgmem, HGMEM_DIR, "memory-hgmem"),
        (a.cdic, CDIC_DIR, "memory-cdic"),
        (a.persist, PERSIST_DIR, "memory-persistbench"),
    ):
        if srcs:
            print(f"{dest}: {export(srcs, str(root / dest))} rows")
        generate_docs(root, plots=False, page=page)


if __name__ == "__main__":
    main()
