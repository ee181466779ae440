"""The one registry of longlab's methods: every family, one string syntax, one parser, one formatter.

Every method is a small dataclass registered by name (``@register("snapkv")``) in a *family*:

========== ========================================== ===============================================
family     what                                        where a user names it
========== ========================================== ===============================================
recipe     KV policy, quantizer, prefill / decode       ``recipe=``, ``--recipe(s)`` (``+`` chains parts)
           attention, context compressor
reuse      KV reuse over stored documents               ``reuse=``, ``--reuse``
draft      speculative-decoding draft                   ``speculative=``, ``--speculative``
verify     speculative-decoding verifier                ``verify=``, ``--verify``
position   position method (applied at model load)      ``position=``, ``--position(s)``
mixer      token mixer of the layers lab                ``longlab lab train --mixer``
========== ========================================== ===============================================

One syntax everywhere: ``name[@r][:key=value,key2=value2]``. ``@r`` always means the fraction *removed*
(the field ``compression_ratio``, the kvpress convention); a family whose methods have no such field
refuses ``@`` and names the parameter to use. Values are JSON scalars (numbers, ``true``/``false``,
``null``) or else plain strings — never evaluated — and each is checked against its field's declared type
and declared range (:func:`param`) before the method is built. A name known in another family gets an
error saying so ("'yarn' is a position method: use --positions / position=").

This module is a leaf: the families import it; the package face imports every family (``longlab.methods``)
so that every name is registered before any is looked up.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import LonglabError, LonglabTypeError, check_choice, check_range, range_text, shorten

__all__ = [
    "FAMILIES",
    "Family",
    "REGISTRY",
    "Registered",
    "Registry",
    "LiveView",
    "param",
    "param_range",
    "check_params",
    "MAX_TOKENS",
    "MAX_BLOCK",
    "MAX_LAYERS",
    "MAX_SEED",
]


@dataclass(frozen=True)
class Family:
    """One family of methods: what its members are called and where a user names one."""

    name: str
    what: str  # "position method"
    where: str  # "--positions / position="
    none: tuple[str, ...] = ()  # names that mean "no method" (parse returns None)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("recipe", "recipe method", "--recipes / recipe="),
        Family("reuse", "reuse method", "--reuse / reuse="),
        Family("draft", "draft", "--speculative / speculative="),
        Family("verify", "verifier", "--verify / verify="),
        Family("position", "position method", "--positions / position=", none=("none", "rope")),
        Family("mixer", "mixer", "longlab lab train --mixer"),
    )
}


# ------------------------------------------------------------------------------------------ parameters
_RANGE = "longlab_range"

# The shared upper bounds of declared ranges (each method's fields use them, so one number is one meaning):
MAX_TOKENS = 1 << 20  # a count of tokens (budget, window, segment, sink): no context longlab runs is longer
MAX_BLOCK = 1 << 14  # a block, page or group of tokens: executors pad to whole blocks, so a block is memory
MAX_LAYERS = 1 << 10  # a layer index or count: no model has more layers
MAX_SEED = 2**63 - 1  # a seed: a non-negative int64
MAX_FACTOR = 1024.0  # a context-extension factor L'/L (no RoPE rescaling is tested beyond 1024x)


def param(
    default: Any = dataclasses.MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    integer: bool = False,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with a declared valid range (checked when the method is built, shown by
    ``longlab methods``): ``budget: int | None = param(None, low=1, integer=True)``. ``None`` is always
    accepted where the field's type allows it; ``choices`` lists the allowed values instead of a range."""
    rng = {"low": low, "high": high, "integer": integer, "low_open": low_open, "high_open": high_open,
           "choices": choices}
    kw: dict[str, Any] = {"metadata": {_RANGE: rng}}
    if default_factory is not dataclasses.MISSING:
        kw["default_factory"] = default_factory
    else:
        kw["default"] = default
    return dataclasses.field(**kw)


def param_range(f: dataclasses.Field) -> str:
    """The declared range of a field as text (``"in [0, 1)"``, ``"an integer >= 1"``), or ``""``."""
    rng = f.metadata.get(_RANGE)
    if not rng:
        return ""
    if rng["choices"] is not None:
        if all(isinstance(c, bool) for c in rng["choices"]) and set(rng["choices"]) == {True, False}:
            return "true or false"
        return "one of " + ", ".join(json.dumps(c) if not isinstance(c, str) else c for c in rng["choices"])
    return range_text(rng["low"], rng["high"], rng["integer"], rng["low_open"], rng["high_open"])


def check_params(obj: Any, label: Callable[[str], str] | None = None) -> None:
    """Check every field of ``obj`` that declares a range (:func:`param`); ``None`` passes."""
    label = label or (lambda name: f"{getattr(obj, 'name', '') or type(obj).__name__}: {name}")
    for f in dataclasses.fields(obj):
        rng = f.metadata.get(_RANGE)
        value = getattr(obj, f.name)
        if not rng or value is None:
            continue
        if rng["choices"] is not None:
            check_choice(label(f.name), value, tuple(rng["choices"]))
        else:
            check_range(label(f.name), value, rng["low"], rng["high"], integer=rng["integer"],
                        low_open=rng["low_open"], high_open=rng["high_open"])


@dataclass
class Registered:
    """Base of every registered method: its name, paper and family (set by registration), declared
    parameter ranges checked on construction, then the method's own :meth:`validate`."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    family: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_params(self, self.field_label)
        self.validate()

    def validate(self) -> None:  # overridden by methods with constraints beyond their declared ranges
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

    @property
    def spec(self) -> str:
        """The method as its string: ``REGISTRY.parse(family, method.spec)`` rebuilds it."""
        return REGISTRY.format(self)


# ---------------------------------------------------------------------------------------- value parsing
def _parse_value(text: str, label: str = "value") -> Any:
    """A JSON scalar or list (``0.5``, ``true``, ``null``, ``[1, 2]``), else the text itself. Only ASCII
    digits are numbers: ``٠.٥`` stays a string (and is then refused by the field's type)."""
    if not text.isascii():
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    except (ValueError, RecursionError):  # > 4300 digits (Python's conversion limit), or nested too deeply
        raise LonglabError(f"{label} must be a number of at most 4300 digits, got {shorten(text)}") from None
    if isinstance(value, dict):
        return text  # an object is not a parameter value: keep the text (a string field may take it)
    return value


_INT64 = (-(2**63), 2**63 - 1)


def _matches(value: Any, tp: Any) -> bool:
    """Does ``value`` (a JSON scalar or list from a method string) fit the declared field type ``tp``?

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


def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: leave checking to validate()
        return {}


def build_method(
    cls: type, name: str, params: str, shown: str, kwargs: dict[str, Any] | None = None, kind: str = ""
) -> Any:
    """``cls(**kwargs, k=v, ...)`` from the ``"k=v,k2=v2"`` text of a method spec, every value parsed as a
    literal (never evaluated) and checked against the dataclass field's type; a :class:`LonglabError`
    names the bad item (``shown``: the spec as the message quotes it; ``kind``: e.g. ``"reuse method "``)."""
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
            rng = param_range(fields[key])  # the declared range says more than the type's own
            must = _describe(tp) if not rng else f"{_describe(tp)} {rng}" if rng.startswith("in ") else rng
            raise LonglabError(f"{name}: {key} must be {must}, got {shorten(value)}")
    try:
        return cls(**kwargs)
    except LonglabError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise LonglabError(f"{shown}: {exc}") from None


def _format_value(value: Any) -> str:
    """A field value as :meth:`Registry.parse` reads it back: strings as they are (quoted as JSON only
    where the bare text would read as another type, e.g. ``"12"``), everything else as JSON."""
    if isinstance(value, str):
        return value if _parse_value(value) == value else json.dumps(value)
    return json.dumps(value)


# ------------------------------------------------------------------------------------------ the registry
class LiveView(Mapping):
    """Read-only, live view ``name -> value`` computed on each access, so an entry registered later
    appears too (a family of the registry, ``SELECTORS``, ``TASKS``)."""

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


class Registry:
    """``family -> name -> class`` for every registered method, with the one parser and formatter."""

    def __init__(self) -> None:
        self._classes: dict[str, dict[str, type]] = {f: {} for f in FAMILIES}

    # -- registration ------------------------------------------------------------------------------
    def register(self, name: str, family: str | None = None) -> Callable[[type], type]:
        """Class decorator: ``@REGISTRY.register("snapkv")`` (the family from the class's ``family``)."""

        def wrap(cls: type) -> type:
            fam = family or getattr(cls, "family", "")
            if fam not in self._classes:
                raise TypeError(f"{cls.__name__}: family must be one of {list(FAMILIES)}, got {fam!r}")
            table = self._classes[fam]
            if name in table and table[name] is not cls:
                raise TypeError(f"{FAMILIES[fam].what} {name!r} registered twice")
            cls.name = name
            cls.family = fam
            table[name] = cls
            return cls

        return wrap

    # -- lookup -------------------------------------------------------------------------------------
    def view(self, family: str) -> LiveView:
        """A live read-only mapping ``name -> class`` of one family."""
        return LiveView(f"{family} methods", lambda: dict(self._classes[family]))

    def names(self, family: str) -> list[str]:
        return sorted(self._classes[family])

    def entries(self) -> list[tuple[str, str, type]]:
        """``(family, name, class)`` of every method, family by family (in :data:`FAMILIES` order)."""
        return [(fam, n, table[n]) for fam, table in self._classes.items() for n in sorted(table)]

    def get(self, family: str, name: str) -> type:
        """The class registered as ``name`` in ``family``; an unknown name raises a :class:`LonglabError`
        that names the family it belongs to, if any, or the valid names and the closest one."""
        table = self._classes[family]
        if name in table:
            return table[name]
        fam = FAMILIES[family]
        elsewhere = [f for f, t in self._classes.items() if name in t and f != family]
        if elsewhere:
            other = FAMILIES[elsewhere[0]]
            raise LonglabError(
                f"{shorten(name)} is a {other.what}, not a {fam.what}: use {other.where}"
            )
        valid = [*fam.none, *sorted(table)]
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LonglabError(f"unknown {fam.what} {shorten(name)}{hint}; valid names: {', '.join(valid)}")

    # -- the one parser and formatter ---------------------------------------------------------------
    def parse(self, family: str, spec: Any) -> Any:
        """``"snapkv@0.5"`` -> ``SnapKV(compression_ratio=0.5)``; ``"name:k=v,k2=v2"`` sets fields. A
        method instance of the family is returned as is; ``None``/a *none* name (``"none"`` for positions)
        gives None where the family has one. A class may take the text after ``name:`` itself
        (``from_rest``: ``self:streaming:budget=256``, ``model:NAME``)."""
        fam = FAMILIES[family]
        if not isinstance(spec, str) and spec is not None and getattr(spec, "family", None) == family:
            return spec  # already a method of this family
        if spec is None and fam.none:
            return None
        if not isinstance(spec, str):
            raise LonglabTypeError(
                f"{fam.name} must be a string naming a {fam.what} ('name:key=value'), got {shorten(spec)}"
            )
        text = spec.strip()
        if fam.none and text in ("", *fam.none):
            return None
        if not text:
            raise LonglabError(f"empty {fam.what} name; valid: {', '.join(self.names(family))}")
        shown = shorten(text)
        head, _, params = text.partition(":")
        name, at, ratio = head.partition("@")
        name = name.strip()
        cls = self.get(family, name)
        from_rest = getattr(cls, "from_rest", None)
        if from_rest is not None and not at:
            return from_rest(params)
        kwargs: dict[str, Any] = {}
        if at:
            ratio = ratio.strip()
            if "compression_ratio" not in {f.name for f in dataclasses.fields(cls)}:
                alt = getattr(cls, "at_hint", "")
                raise LonglabError(
                    f"in {shown}: '@' means the fraction removed (compression_ratio), which {name} does not "
                    f"have{'; ' + alt if alt else ''}"
                )
            if not ratio:
                raise LonglabError(
                    f"in {shown}: the compression ratio after '@' is empty; write e.g. {name}@0.5 "
                    "(the fraction of entries removed, in [0, 1))"
                )
            try:
                if not ratio.isascii():
                    raise ValueError
                kwargs["compression_ratio"] = float(ratio)
            except ValueError:
                raise LonglabError(
                    f"in {shown}: compression ratio after '@' must be a number in [0, 1), "
                    f"got {shorten(ratio)}"
                ) from None
        return build_method(cls, name, params, shown, kwargs, kind=f"{fam.what} ")

    def format(self, method: Any) -> str:
        """Inverse of :meth:`parse`: the name, ``@r`` for a non-default ``compression_ratio``, then the
        other non-default fields as ``:k=v,...`` (``"none"`` for no position method)."""
        if method is None:
            return "none"
        custom = getattr(method, "format_spec", None)
        if custom is not None:
            return custom()
        out = method.name
        extras = []
        for f in dataclasses.fields(method):
            if not f.init:
                continue
            value = getattr(method, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                default = dataclasses.MISSING
            if value == default:
                continue
            if f.name == "compression_ratio":
                out += f"@{value:g}"
            else:
                extras.append(f"{f.name}={_format_value(value)}")
        return out + (":" + ",".join(extras) if extras else "")


REGISTRY = Registry()
