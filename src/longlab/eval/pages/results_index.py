"""The generated table of ``docs/results/index.md``: every results page with generated blocks, its title,
those blocks and the command that regenerates them (read from the pages themselves, so a page added to
the site shows up here without an edit; ``longlab report --docs`` refuses a marker no generator fills)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["render"]

_BEGIN = re.compile(r"^<!-- BEGIN generated:([A-Za-z0-9_.-]+) -->$", re.M)
INDEX = "docs/results/index.md"


def _title(text: str, fallback: str) -> str:
    return next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), fallback)


def render(root: Path, plots: bool) -> dict[str, str]:
    """``{"results-index": table}``: a row per ``docs/results/*.md`` page with generated blocks."""
    rows = ["| page | generated blocks | regenerate with |", "|---|---|---|"]
    for path in sorted((root / "docs/results").glob("*.md")):
        if path == root / INDEX:
            continue
        text = path.read_text(encoding="utf-8")
        blocks = _BEGIN.findall(text)
        if not blocks:
            continue
        name = path.stem
        shown = ", ".join(f"`{b}`" for b in blocks)
        rows.append(f"| [{_title(text, name)}]({name}.md) | {len(blocks)}: {shown} | "
                    f"`longlab report --docs --page results/{name}` |")
    return {"results-index": "\n".join(rows)}
