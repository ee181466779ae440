"""``longlab methods``: every method of the one registry, family by family, with its paper and parameters."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["add_methods_arguments", "cmd_methods"]


def add_methods_arguments(sub: Any) -> None:
    m = sub.add_parser("methods", help="list every registered method")
    m.add_argument("--markdown", action="store_true",
                   help="one Markdown table of every family (the README's)")
    m.set_defaults(func=cmd_methods)


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
    if args.markdown:
        print("| method | family | paper | parameters (default, valid range) |\n|---|---|---|---|")
        for kind, name, paper, params, _ in rows:
            print(f"| `{name}` | {kind} | {paper} | {params} |")
        return 0
    for fam in FAMILIES.values():
        print(f"# {fam.what}s ({fam.where})")
        for kind, name, paper, params, summary in rows:
            if kind.split(":")[0] == fam.name:
                print(f"{name:<16} {kind:<15} {paper:<18} {summary}")
                print(f"{'':<16} params: {params or 'none'}")
    return 0
