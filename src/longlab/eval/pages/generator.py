"""A page generator (:mod:`longlab.eval.docs_tables`): the page it fills and how its blocks render."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Generator"]


@dataclass(frozen=True)
class Generator:
    """One page's generator: ``page`` (relative to the repo root) and ``render(root, plots)`` returning
    ``{block name: markdown}``; with ``plots`` True it also (re)writes the PNGs the page shows."""

    page: str
    render: Callable[[Path, bool], dict[str, str]]
