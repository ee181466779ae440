"""Method registry and recipes.

A *recipe* names one prefill policy, a chain of KV policies (eviction, then quantization) and one
decode policy. Recipes have string names so the CLI, the results database and the plots speak the
same language::

    full                      # the empty recipe: dense prefill, no eviction, full decode
    snapkv@0.5                # SnapKV removing 50% of the context KV entries
    streaming:budget=512      # StreamingLLM keeping 512 entries per head
    prism+snapkv@0.5+kivi2    # sparse prefill, then eviction, then 2-bit quantization

``name@r`` sets ``compression_ratio=r``; ``name:k=v,k2=v2`` sets dataclass fields. Values are parsed
as JSON scalars (numbers, ``true``/``false``) and otherwise kept as strings — never evaluated.

This module is a leaf: it imports nothing from longlab. The method families register themselves when
:mod:`longlab.methods` is imported, which the package face (``import longlab``) does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "split_recipes",
    "LonglabError",
    "Method",
    "Recipe",
    "REGISTRY",
    "register",
    "get_method_class",
    "parse_method",
    "format_method",
    "parse_recipe",
]


class LonglabError(ValueError):
    """A user error: bad argument, unknown name, empty input. The CLI prints it without a traceback."""


KINDS = ("prefill", "kv", "quant", "decode")


@dataclass
class Method:
    """Base of every registered method. Hyper-parameters are dataclass fields, validated in
    ``__post_init__``; ``repr(method)`` is stored with each result row."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "kv"
    paper: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # overridden by methods with constraints
        pass


REGISTRY: dict[str, type[Method]] = {}


def register(name: str):
    """Class decorator: ``@register("snapkv")`` makes the method known to recipes, the CLI and docs."""

    def wrap(cls: type[Method]) -> type[Method]:
        if cls.kind not in KINDS:
            raise TypeError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}")
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise TypeError(f"method name {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return wrap


def get_method_class(name: str) -> type[Method]:
    if name not in REGISTRY:
        raise LonglabError(f"unknown method {name!r}; valid names: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_method(spec: str) -> Method:
    """``"snapkv@0.5"`` -> ``SnapKV(compression_ratio=0.5)``; ``"streaming:budget=512"`` -> ..."""
    spec = spec.strip()
    if not spec:
        raise LonglabError("empty method name in recipe")
    head, _, params = spec.partition(":")
    name, _, ratio = head.partition("@")
    cls = get_method_class(name.strip())
    kwargs: dict[str, Any] = {}
    if ratio:
        try:
            kwargs["compression_ratio"] = float(ratio)
        except ValueError:
            raise LonglabError(
                f"in {spec!r}: compression ratio after '@' must be a number, got {ratio!r}"
            ) from None
    if params:
        for item in params.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise LonglabError(f"in {spec!r}: expected key=value, got {item!r}")
            kwargs[key.strip()] = _parse_value(value.strip())
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(kwargs) - names
    if unknown:
        raise LonglabError(
            f"{name} has no parameter {', '.join(sorted(unknown))}; "
            f"parameters: {', '.join(sorted(names)) or 'none'}"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise LonglabError(f"{spec!r}: {exc}") from None


_PARAM_ITEM = re.compile(r"^[A-Za-z_]\w*\s*=")


def split_recipes(text: str) -> list[str]:
    """Split a comma-separated list of recipes, keeping each method's ``key=value`` parameters together.

    ``"full,streaming:budget=512,sinks=4,snapkv@0.5"`` -> ``["full", "streaming:budget=512,sinks=4",
    "snapkv@0.5"]``: an item of the form ``key=value`` continues the parameter list of the recipe before it,
    which must end in a method with parameters (``name:...``)."""
    recipes: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if _PARAM_ITEM.match(item) and "@" not in item and ":" not in item:
            if not recipes or ":" not in recipes[-1].rsplit("+", 1)[-1]:
                raise LonglabError(
                    f"in {text!r}: parameter {item!r} does not follow a method with parameters "
                    "(write name:key=value,key2=value2)"
                )
            recipes[-1] += "," + item
        else:
            recipes.append(item)
    return recipes


def format_method(method: Method) -> str:
    """Inverse of :func:`parse_method`: non-default fields only, ratio as ``@r``."""
    out = method.name
    extras = []
    for f in dataclasses.fields(method):
        if not f.init:
            continue
        value = getattr(method, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        if value == default:
            continue
        if f.name == "compression_ratio":
            out += f"@{value:g}"
        else:
            extras.append(f"{f.name}={json.dumps(value) if not isinstance(value, str) else value}")
    if extras:
        out += ":" + ",".join(extras)
    return out


@dataclass
class Recipe:
    """What to compute (prefill), what to keep (KV policies, in order) and what to read (decode)."""

    prefill: Method | None = None
    kv: list[Method] = field(default_factory=list)
    decode: Method | None = None

    @property
    def is_empty(self) -> bool:
        return self.prefill is None and self.decode is None and all(m.name == "full" for m in self.kv)

    @property
    def methods(self) -> list[Method]:
        return [m for m in (self.prefill, *self.kv, self.decode) if m is not None]

    @property
    def name(self) -> str:
        return format_recipe(self)

    def __str__(self) -> str:
        return self.name


def parse_recipe(spec: str | Recipe | None) -> Recipe:
    """Parse ``"prism+snapkv@0.5+kivi2"``; ``None``/``""``/``"full"`` give the empty recipe."""
    if isinstance(spec, Recipe):
        return spec
    recipe = Recipe()
    if spec is None or not str(spec).strip():
        return recipe
    for part in str(spec).split("+"):
        method = parse_method(part)
        if method.kind == "prefill":
            if recipe.prefill is not None:
                raise LonglabError(f"recipe {spec!r} names two prefill policies")
            recipe.prefill = method
        elif method.kind == "decode":
            if recipe.decode is not None:
                raise LonglabError(f"recipe {spec!r} names two decode policies")
            recipe.decode = method
        else:
            recipe.kv.append(method)
    # Quantization always runs after eviction: stable sort keeps the user's order within a kind.
    recipe.kv.sort(key=lambda m: m.kind == "quant")
    return recipe


def format_recipe(recipe: Recipe) -> str:
    parts = [format_method(m) for m in recipe.methods if not (m.name == "full" and len(recipe.methods) > 1)]
    return "+".join(parts) if parts else "full"
