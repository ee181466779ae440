"""``longlab report --docs``: every generated table of the documentation site, from committed result data.

A page keeps its prose by hand; each table (and each plot it shows) lies between two markers::

    <!-- BEGIN generated:NAME -->
    ... written by longlab report --docs: do not edit ...
    <!-- END generated:NAME -->

A *generator* (one per page, :func:`generators`) reads ``bench/results/`` (the committed compact rows)
and the registry, and returns ``{NAME: markdown}``; it may also write PNG plots under ``docs/``. The
markdown goes between the page's markers; text outside them is never touched. ``--check`` renders the
same text and reports each page that differs from its data (the drift check of ``tests/test_docs.py``)
without writing anything.

A page that lacks a generator's marker pair, or has a marker pair no generator fills, is an error (a
block that nothing regenerates would drift silently).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import LonglabError
from .pages.generator import Generator

__all__ = [
    "BEGIN",
    "END",
    "Generator",
    "PageDiff",
    "block_names",
    "check_docs",
    "fill_blocks",
    "generate_docs",
    "generators",
    "repo_root",
]

BEGIN = "<!-- BEGIN generated:{name} -->"
END = "<!-- END generated:{name} -->"
_BEGIN_RE = re.compile(r"<!-- BEGIN generated:([A-Za-z0-9_.-]+) -->")
_NOTE = "<!-- written by `longlab report --docs` from committed data: edit the generator, not this block -->"


@dataclass(frozen=True)
class PageDiff:
    """A page whose generated blocks differ from its data: the names of those blocks."""

    page: str
    blocks: tuple[str, ...]


def block_names(text: str) -> list[str]:
    """The generated block names of a page, in order (each must have its END marker)."""
    names = _BEGIN_RE.findall(text)
    for name in names:
        if END.format(name=name) not in text:
            raise LonglabError(f"generated block {name!r}: no {END.format(name=name)} marker")
    if len(set(names)) != len(names):
        raise LonglabError(f"generated blocks named twice: {sorted(n for n in names if names.count(n) > 1)}")
    return names


def fill_blocks(text: str, blocks: dict[str, str], *, page: str = "page") -> tuple[str, list[str]]:
    """``text`` with each named block replaced by its markdown; returns (new text, names that changed).

    Every block of ``blocks`` must have its marker pair in ``text`` and every marker pair of ``text`` a
    block, else :class:`LonglabError` naming the page and the block."""
    present = block_names(text)
    missing = sorted(set(blocks) - set(present))
    if missing:
        raise LonglabError(f"{page}: no marker pair for generated block(s) {missing}")
    orphans = sorted(set(present) - set(blocks))
    if orphans:
        raise LonglabError(f"{page}: marker pair(s) {orphans} that no generator fills")
    changed = []
    for name, body in blocks.items():
        start, end = BEGIN.format(name=name), END.format(name=name)
        head, rest = text.split(start, 1)
        old, tail = rest.split(end, 1)
        new = f"\n{_NOTE}\n\n{body.strip()}\n\n"
        if old != new:
            changed.append(name)
        text = f"{head}{start}{new}{end}{tail}"
    return text, changed


def repo_root(start: str | Path = ".") -> Path:
    """The repository root at or above ``start``: the directory holding ``mkdocs.yml`` and ``docs/``."""
    here = Path(start).resolve()
    for cand in (here, *here.parents):
        if (cand / "mkdocs.yml").is_file() and (cand / "docs").is_dir():
            return cand
    raise LonglabError(f"--docs: no mkdocs.yml with a docs/ folder at or above {here}: run it in the repo")


def generators() -> list[Generator]:
    """Every page generator, in page order (:data:`longlab.eval.pages.GENERATORS`)."""
    from .pages import GENERATORS

    return list(GENERATORS)


def _short(page: str) -> str:
    """``docs/results/position.md`` -> ``results/position`` (how ``--page`` names a page)."""
    return page.removeprefix("docs/").removesuffix(".md")


def _run(root: Path, *, write: bool, plots: bool, only: str | None = None) -> list[PageDiff]:
    diffs: list[PageDiff] = []
    gens = generators()
    if only is not None:
        gens = [g for g in gens if only in (g.page, _short(g.page), Path(g.page).stem)]
        if not gens:
            names = ", ".join(_short(g.page) for g in generators())
            raise LonglabError(f"--page: unknown page {only!r}; pages: {names}")
    for gen in gens:
        path = root / gen.page
        if not path.is_file():
            raise LonglabError(f"--docs: {gen.page} not found under {root}")
        text = path.read_text(encoding="utf-8")
        try:
            blocks = gen.render(root, plots)
        except (OSError, ValueError, KeyError) as err:  # missing, damaged or foreign result data
            raise LonglabError(
                f"--docs: {gen.page}: its result data under {root / 'bench' / 'results'} does not give the "
                f"page ({type(err).__name__}: {err}); rerun the command its Reproduce section names"
            ) from None
        new, changed = fill_blocks(text, blocks, page=gen.page)
        if changed:
            diffs.append(PageDiff(gen.page, tuple(changed)))
            if write:
                from ..safeio import write_file_atomic

                write_file_atomic(path, new, "--docs")
    return diffs


def generate_docs(root: str | Path = ".", *, plots: bool = True, page: str | None = None) -> list[PageDiff]:
    """Rewrite every generated block (and plot) of the site under ``root``; return the pages changed."""
    return _run(repo_root(root), write=True, plots=plots, only=page)


def check_docs(root: str | Path = ".", *, page: str | None = None) -> list[PageDiff]:
    """The pages whose generated blocks differ from what their data gives now (nothing is written)."""
    return _run(repo_root(root), write=False, plots=False, only=page)
