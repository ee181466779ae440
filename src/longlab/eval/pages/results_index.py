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
    """``{"results-index": table}``: one row per ``docs/results/*.md`` page that a generator fills."""
    from . import GENERATORS  # this module is one of them: imported when rendering, not at import

    rows = ["| page | generated blocks | regenerate with |", "|---|---|---|"]
    for gen in sorted(GENERATORS, key=lambda g: g.page):
        if not gen.page.startswith("docs/results/") or gen.page == INDEX:
            continue
        path = root / gen.page
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        name = Path(gen.page).stem
        blocks = _BEGIN.findall(text)
        shown = ", ".join(f"`{b}`" for b in blocks) if blocks else "—"
        rows.append(f"| [{_title(text, name)}]({name}.md) | {len(blocks)}: {shown} | "
                    f"`longlab report --docs --page results/{name}` |")
    return {"results-index": "\n".join(rows)}
