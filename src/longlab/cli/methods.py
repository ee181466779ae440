"""``longlab methods``: every method of the one registry, family by family, with its paper and parameters."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["add_methods_arguments", "cmd_methods", "methods_markdown", "update_readme", "README_MARKERS"]

#: The README's generated region: ``longlab methods --readme README.md`` rewrites what lies between them.
README_MARKERS = ("<!-- generated: longlab methods --markdown -->", "<!-- /generated -->")


def add_methods_arguments(sub: Any) -> None:
    m = sub.add_parser("methods", help="list every registered method")
    m.add_argument("--markdown", action="store_true",
                   help="one Markdown table of every family (the README's)")
    m.add_argument("--readme", metavar="FILE",
                   help="rewrite the table between the README's generated-region markers in FILE")
    m.set_defaults(func=cmd_methods)


def methods_markdown() -> str:
    """One Markdown table of every registered method: name, family (with a recipe part's kind), paper,
    parameters with their defaults and declared ranges."""
    from ..registry import REGISTRY

    lines = ["| method | family | paper | parameters (default, valid range) |", "|---|---|---|---|"]
    for fam, name, cls in REGISTRY.entries():
        kind, _, paper, params, _ = _method_row(fam, name, cls)
        lines.append(f"| `{name}` | {kind} | {paper} | {params.replace('|', '&#124;')} |")
    return "\n".join(lines)


def update_readme(path: str) -> bool:
    """Rewrite the README's generated region with :func:`methods_markdown`; True if it changed."""
    from pathlib import Path

    from ..errors import LonglabError
    from ..safeio import write_file_atomic

    text = Path(path).read_text(encoding="utf-8")
    start, end = README_MARKERS
    if start not in text or end not in text.split(start, 1)[1]:
        raise LonglabError(f"--readme: {path} has no generated region ({start} ... {end})")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{start}\n{methods_markdown()}\n{end}{tail}"
    if new != text:
        write_file_atomic(path, new, "--readme")
    return new != text


def _method_row(family: str, name: str, cls: type) -> tuple[str, str, str, str, str]:
    """One line of ``longlab methods``: family (with the recipe part's kind), name, paper, the parameters
    with their defaults and declared ranges, and the summary line of the docstring."""
    from ..registry import param_range

    params = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.default is dataclasses.MISSING:
            continue
        rng = param_range(f)
        params.append(f"{f.name}={f.default!r}" + (f" ({rng})" if rng else ""))
    summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    kind = f"{family}:{cls.kind}" if family == "recipe" else family
    return kind, name, getattr(cls, "paper", ""), ", ".join(params), summary


def cmd_methods(args: argparse.Namespace) -> int:
    """``longlab methods``: every method of the one registry, family by family."""
    from ..registry import FAMILIES, REGISTRY

    rows = [_method_row(fam, name, cls) for fam, name, cls in REGISTRY.entries()]
    if args.readme:
        changed = update_readme(args.readme)
        print(f"{args.readme}: the methods table {'rewritten' if changed else 'is current'}")
        return 0
    if args.markdown:
        print(methods_markdown())
        return 0
    for fam in FAMILIES.values():
        print(f"# {fam.what}s ({fam.where})")
        for kind, name, paper, params, summary in rows:
            if kind.split(":")[0] == fam.name:
                print(f"{name:<16} {kind:<15} {paper:<18} {summary}")
                print(f"{'':<16} params: {params or 'none'}")
    return 0
