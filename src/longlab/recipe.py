"""Method registry and recipes.

A *recipe* names one prefill policy, a chain of KV policies (eviction, then quantization) and one
decode policy. Recipes have string names so the CLI, the results database and the plots speak the
same language::

    full                      # the empty recipe: dense prefill, no eviction, full decode
    snapkv@0.5                # SnapKV removing 50% of the context KV entries
    streaming:budget=512      # StreamingLLM keeping 512 entries per head
    prism+snapkv@0.5+kivi2    # sparse prefill, then eviction, then 2-bit quantization

``name@r`` sets ``compression_ratio=r``; ``name:k=v,k2=v2`` sets dataclass fields. Values are parsed
as JSON scalars (numbers, ``true``/``false``) and otherwise kept as strings — never evaluated — and
each is checked against its field's declared type (ints within int64, floats finite) before the
method is built.

This module is a leaf: it imports nothing from longlab. The method families register themselves when
:mod:`longlab.methods` is imported, which the package face (``import longlab``) does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "split_recipes",
    "LonglabError",
    "check_range",
    "check_choice",
    "build_method",
    "LonglabTypeError",
    "shorten",
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


class LonglabTypeError(LonglabError, TypeError):
    """A user error of the wrong type (``context=None``, ``seed="abc"``): a LonglabError and a TypeError."""


def shorten(text: object, limit: int = 80) -> str:
    """``repr(text)`` cut to about ``limit`` characters with an ellipsis, for echoing user input in errors
    (a 100 KB recipe name is not printed whole)."""
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    return f"{shown[: limit - 1]}\u2026 ({len(str(text))} characters)"


# ---------------------------------------------------------------------------------------------- validators
# One place for the field checks of every method's ``validate()`` and the tools' arguments: each raises
# LonglabError naming the field and its allowed range, and returns the value it accepted.


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(low: float | None, high: float | None, integer: bool, low_open: bool, high_open: bool) -> str:
    """``[0, 1)`` -> "in [0, 1)", ``(0, inf)`` -> "a positive number", ``[1, inf)`` -> ">= 1";
    integers: "an integer >= 1", "a positive integer"."""
    if low is None and high is None:
        text = ""
    elif high is None and low == 0 and low_open:
        text = "positive"
    elif high is None:
        text = f"{'>' if low_open else '>='} {_num(low)}"
    elif low is None:
        text = f"{'<' if high_open else '<='} {_num(high)}"
    else:
        text = f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if integer:
        return "a positive integer" if text == "positive" else f"an integer {text}".rstrip()
    return "a positive number" if text == "positive" else text or "a number"


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    integer: bool = False,
    low_open: bool = False,
    high_open: bool = False,
) -> Any:
    """Return ``value`` if it is a number (an ``int`` with ``integer=True``; never a bool, NaN or infinity)
    with ``low (<|<=) value (<|<=) high``; else raise :class:`LonglabError` naming ``name`` and the range::

        check_range("snapkv: compression_ratio", 1.5, 0, 1, high_open=True)
        # LonglabError: snapkv: compression_ratio must be in [0, 1), got 1.5
    """
    text = _range_text(low, high, integer, low_open, high_open)
    numeric = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not numeric:
        kind = text if text.startswith("a") else f"a number {text}"
        raise LonglabError(f"{name} must be {kind}, got {shorten(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        kind = text.replace("a ", "a finite ", 1) if text.startswith("a ") else f"a finite number {text}"
        raise LonglabError(f"{name} must be {kind}, got {value!r}")
    ok = (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high)
    )
    if not ok:
        raise LonglabError(f"{name} must be {text}, got {shorten(value)}")
    return value


def _choice_text(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, bool) or choice is None else repr(choice)


def check_choice(name: str, value: Any, choices: tuple | list) -> Any:
    """Return ``value`` if it is one of ``choices`` (same type too: ``1`` is not ``true``); else raise
    :class:`LonglabError`: ``kivi2: pooling must be 'avg' or 'max', got 'mean'``."""
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    shown = [_choice_text(c) for c in choices]
    listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    raise LonglabError(f"{name} must be {listed}, got {shorten(value)}")


KINDS = ("prefill", "kv", "quant", "decode", "context")  # context: a prompt transform (longlab.compress)


@dataclass
class Method:
    """Base of every registered method. Hyper-parameters are dataclass fields, validated in
    ``__post_init__``; ``repr(method)`` is stored with each result row."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "kv"
    paper: ClassVar[str] = ""

    # Capabilities: what a method needs or does, declared on its class, so the hook and the harness
    # never check concrete classes or read hyper-parameter fields (subclasses override; these defaults
    # describe a method that acts only where its kind says).
    needs_observe: ClassVar[bool] = False  # wants observe(ctx) before attention on every forward (H2O)
    reads_attention: ClassVar[bool] = False  # a KV policy that computes attention itself: attend(ctx)
    acts_during_decode: ClassVar[bool] = False  # a KV/storage policy that changes the cache or its
    #   own state at decode steps (decode-time eviction, quantizing new entries); decode policies
    #   (kind "decode") act at decode by definition
    reports_prefill_metrics: ClassVar[bool] = False  # a prefill policy whose chunks PrefillMetrics measures
    batch_select_safe: ClassVar[bool] = False  # all its decode-time state is in the cache layer's tensors,
    #   batch first, so Cache.batch_select_indices keeps it right when a batched decode drops finished rows

    @property
    def observation_window(self) -> int:
        """Tokens at the end of the compressed prefill chunk this method's compression reads (0: none);
        the harness makes the chunk it compresses at least this long."""
        return 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # overridden by methods with constraints
        pass

    def check(self, field: str, low: float | None = None, high: float | None = None, *,
              choices: tuple | list | None = None, **options: bool) -> None:
        """Check one field with :func:`check_range` (``low``/``high``, ``integer=``, ``low_open=``,
        ``high_open=``) or :func:`check_choice` (``choices=``), naming it as :meth:`field_label` does."""
        value = getattr(self, field)
        if choices is not None:
            check_choice(self.field_label(field), value, choices)
        else:
            check_range(self.field_label(field), value, low, high, **options)

    def field_label(self, field: str) -> str:
        """How errors name a field: ``"snapkv: window_size"``."""
        return f"{self.name or type(self).__name__}: {field}"


REGISTRY: dict[str, type[Method]] = {}


class LiveView(Mapping):
    """Read-only, live view ``name -> value`` computed from a registry on each access, so an entry
    registered later appears too (``SELECTORS`` over the method registry, ``TASKS`` over the tasks)."""

    def __init__(self, label: str, table: Callable[[], dict[str, Any]]) -> None:
        self._label, self._table = label, table

    def __getitem__(self, name: str) -> Any:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"{self._label}({list(self._table())})"


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
        raise LonglabError(f"unknown method {shorten(name)}; valid names: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _parse_value(text: str, label: str = "value") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except ValueError:  # an integer of more than 4300 digits (Python's conversion limit)
        raise LonglabError(f"{label} must be a number of at most 4300 digits, got {shorten(text)}") from None


_INT64 = (-(2**63), 2**63 - 1)


def _matches(value: Any, tp: Any) -> bool:
    """Does ``value`` (a JSON scalar or list from a recipe string) fit the declared field type ``tp``?

    ``int``: an integer (not a bool) within int64; ``float``: a finite number; ``bool``: true/false;
    ``str``: a string; unions, ``None``, ``Literal`` and ``tuple``/``list`` of these are checked
    recursively. Types this does not know are left to the method's own ``validate()``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return abs(value) <= sys.float_info.max and math.isfinite(float(value))
    if tp is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        args = typing.get_args(tp)
        if not args:
            return True
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
    return True


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(arg) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in typing.get_args(tp))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list of ({', '.join(_describe(a) for a in args)})" if args else "a list"
    return {
        bool: "true or false",
        int: "an integer in [-2^63, 2^63 - 1]",
        float: "a finite number",
        str: "a string",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _field_types(cls: type[Method]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: leave checking to validate()
        return {}


def parse_method(spec: str) -> Method:
    """``"snapkv@0.5"`` -> ``SnapKV(compression_ratio=0.5)``; ``"streaming:budget=512"`` -> ...

    Every value is checked against its dataclass field's declared type before the method is built
    (``random:seed=abc`` and a 23-digit ``budget`` are refused here, not deep inside a run)."""
    if not isinstance(spec, str):
        raise LonglabTypeError(f"a method spec must be a string, got {type(spec).__name__}")
    spec = spec.strip()
    if not spec:
        raise LonglabError("empty method name in recipe")
    shown = shorten(spec)
    head, _, params = spec.partition(":")
    name, at, ratio = head.partition("@")
    name = name.strip()
    cls = get_method_class(name)
    kwargs: dict[str, Any] = {}
    if at:
        ratio = ratio.strip()
        if not ratio:
            raise LonglabError(
                f"in {shown}: the compression ratio after '@' is empty; write e.g. {name}@0.5 "
                "(the fraction of entries removed, in [0, 1))"
            )
        try:
            kwargs["compression_ratio"] = float(ratio)
        except ValueError:
            raise LonglabError(
                f"in {shown}: compression ratio after '@' must be a number in [0, 1), got {shorten(ratio)}"
            ) from None
    return build_method(cls, name, params, shown, kwargs)


def build_method(
    cls: type, name: str, params: str, shown: str, kwargs: dict[str, Any] | None = None, kind: str = ""
) -> Any:
    """``cls(**kwargs, k=v, ...)`` from the ``"k=v,k2=v2"`` text of a method spec, every value parsed as a
    literal (never evaluated) and checked against the dataclass field's type; a :class:`LonglabError`
    names the bad item (``shown``: the spec as the message quotes it; ``kind``: e.g. ``"reuse method "``).
    The one parameter parser of every registry: recipes, reuse methods, drafts and verifiers."""
    kwargs = dict(kwargs or {})
    if params:
        for item in params.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise LonglabError(f"in {shown}: expected key=value, got {shorten(item)}")
            if key in kwargs:
                raise LonglabError(f"in {shown}: parameter {shorten(key)} is given twice")
            kwargs[key] = _parse_value(value.strip(), f"{name}: {key}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(kwargs) - set(fields)
    if unknown:
        listed = ", ".join(u if len(u) <= 40 else shorten(u, 40) for u in sorted(unknown))
        raise LonglabError(
            f"{kind}{name} has no parameter {listed}; "
            f"parameters: {', '.join(sorted(fields)) or 'none'}"
        )
    hints = _field_types(cls)
    for key, value in kwargs.items():
        tp = hints.get(key)
        if tp is not None and not _matches(value, tp):
            raise LonglabError(f"{name}: {key} must be {_describe(tp)}, got {shorten(value)}")
    try:
        return cls(**kwargs)
    except LonglabError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise LonglabError(f"{shown}: {exc}") from None


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
                    f"in {shorten(text)}: parameter {shorten(item)} does not follow a method with parameters "
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
    context: Method | None = None  # shortens the prompt before prefill (longlab.compress)

    @property
    def is_empty(self) -> bool:
        return (
            self.prefill is None and self.decode is None and self.context is None
            and all(m.name == "full" for m in self.kv)
        )

    @property
    def methods(self) -> list[Method]:
        return [m for m in (self.context, self.prefill, *self.kv, self.decode) if m is not None]

    @property
    def name(self) -> str:
        return format_recipe(self)

    def __str__(self) -> str:
        return self.name


def parse_recipe(spec: str | Recipe | None) -> Recipe:
    """Parse ``"prism+snapkv@0.5+kivi2"``; ``None``/``""``/``"full"`` give the empty recipe."""
    if isinstance(spec, Recipe):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise LonglabTypeError(
            f"recipe must be a string such as 'snapkv@0.5', a Recipe or None, got {shorten(spec)}"
        )
    recipe = Recipe()
    if spec is None or not spec.strip():
        return recipe
    for part in spec.split("+"):
        method = parse_method(part)
        if method.kind == "prefill":
            if recipe.prefill is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two prefill policies")
            recipe.prefill = method
        elif method.kind == "decode":
            if recipe.decode is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two decode policies")
            recipe.decode = method
        elif method.kind == "context":
            if recipe.context is not None:
                raise LonglabError(f"recipe {shorten(spec)} names two context compressors")
            recipe.context = method
        else:
            recipe.kv.append(method)
    # Quantization always runs after eviction: stable sort keeps the user's order within a kind.
    recipe.kv.sort(key=lambda m: m.kind == "quant")
    return recipe


def format_recipe(recipe: Recipe) -> str:
    parts = [format_method(m) for m in recipe.methods if not (m.name == "full" and len(recipe.methods) > 1)]
    return "+".join(parts) if parts else "full"
