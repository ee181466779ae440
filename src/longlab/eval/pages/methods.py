"""The parameter table of each family page, generated from the one registry (:mod:`longlab.registry`).

Each family page (``docs/families/NAME.md``) shows, between its ``params`` markers, every registered
method the family covers: its name, the string a user writes, its paper and each parameter with its
default and declared valid range (:func:`longlab.registry.param_range`), exactly what ``longlab methods``
checks when a method is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

__all__ = ["FAMILY_METHODS", "family_params_table", "method_params"]

_MODALITY_MIXERS = ("crisscross", "ema", "emformer", "lif", "ts", "vlta")
_COMPRESSION_KV = ("hico-drop",)
_SPEC_DECODE = ("losa",)


def _recipe(kind: str, *, exclude: tuple[str, ...] = (), include: tuple[str, ...] = ()
            ) -> Callable[[str, str, type], bool]:
    def pick(family: str, name: str, cls: type) -> bool:
        if name in include:
            return True
        return family == "recipe" and getattr(cls, "kind", "") == kind and name not in exclude

    return pick


def _family(*families: str, exclude: tuple[str, ...] = (), include: tuple[str, ...] = ()
            ) -> Callable[[str, str, type], bool]:
    def pick(family: str, name: str, cls: type) -> bool:
        return name in include or (family in families and name not in exclude)

    return pick


def _kv_and_decode(family: str, name: str, cls: type) -> bool:
    kind = getattr(cls, "kind", "")
    return family == "recipe" and (
        (kind == "kv" and name not in _COMPRESSION_KV) or (kind == "decode" and name not in _SPEC_DECODE)
    )


#: family page stem -> which registered methods its parameter table lists
FAMILY_METHODS: dict[str, Callable[[str, str, type], bool]] = {
    "kv-eviction": _kv_and_decode,
    "kv-quant": _recipe("quant"),
    "sparse-prefill": _recipe("prefill"),
    "rag-reuse": _family("reuse"),
    "spec-decode": _family("draft", "verify", include=_SPEC_DECODE),
    "compression": _recipe("context", include=_COMPRESSION_KV),
    "position": _family("position"),
    "layers-lab": _family("mixer", exclude=_MODALITY_MIXERS),
    "modalities": lambda family, name, cls: family == "mixer" and name in _MODALITY_MIXERS,
}


def method_params(cls: type) -> list[tuple[str, str, str]]:
    """``(name, default, valid range)`` of each user-settable parameter of a registered method class."""
    from ...registry import param_range

    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        out.append((f.name, default, param_range(f)))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "&#124;").replace("\n", " ")


def family_params_table(page: str) -> str:
    """The Markdown table of the methods of one family page (:data:`FAMILY_METHODS`)."""
    import longlab.methods  # noqa: F401  (importing it registers every method)

    from ...registry import REGISTRY

    pick = FAMILY_METHODS[page]
    lines = ["| method | kind | paper | parameters: default (valid range) |", "|---|---|---|---|"]
    for family, name, cls in REGISTRY.entries():
        if not pick(family, name, cls):
            continue
        kind = f"{family}: {cls.kind}" if family == "recipe" else family
        params = "<br>".join(
            f"`{p}` = `{d}`" + (f" ({r})" if r else "") for p, d, r in method_params(cls)
        ) or "—"
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(
            f"| `{name}`<br>{_cell(summary)} | {kind} | {_cell(getattr(cls, 'paper', '') or '—')} | "
            f"{_cell(params)} |"
        )
    if len(lines) == 2:
        raise ValueError(f"family page {page!r} selects no registered method")
    return "\n".join(lines)


def render_family(page: str) -> Callable[[Path, bool], dict[str, str]]:
    """A generator body for ``docs/families/PAGE.md``: its ``params`` block."""

    def render(root: Path, plots: bool) -> dict[str, str]:
        return {"params": family_params_table(page)}

    return render
