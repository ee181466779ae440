"""Every parameter of every recipe, reuse, draft and verify method declares its valid range (issue 28: "every
argument acts or is refused"; "nothing hangs, everything is bounded").

For each registered method of those families: each numeric field declares a bounded range (``param``), each
true/false field declares ``true or false``, each other field is free text or an object listed below; a
value of 1e30 (and -1 where negative makes no sense, and 2**70 for an integer) is refused with a
:class:`LonglabError` naming the method, the field and the range, *before* the method's ``validate()`` does
any work; the defaults are accepted and survive ``parse(format(...))``; ``longlab methods`` shows each range.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import pytest

import longlab  # noqa: F401  (registers every family)
from longlab.cli import main as cli_main
from longlab.errors import LonglabError
from longlab.registry import FAMILIES as FAMILIES_ALL
from longlab.registry import REGISTRY, param_range

FAMILIES = ("recipe", "reuse", "draft", "verify", "position", "mixer")

# What a method needs besides its defaults to be built at all (it has no sensible default for it).
REQUIRED: dict[tuple[str, str], dict[str, typing.Any]] = {
    ("recipe", "decoding"): {"budget": 64},  # decode-time eviction keeps `budget` entries: no default size
    ("recipe", "h2o-stream"): {"budget": 64},
    ("recipe", "tova-stream"): {"budget": 64},
    ("recipe", "pmkvq"): {"budget_mb": 1.0},  # budget_mb or an allocation file
    ("draft", "model"): {"model_name": "tiny-llama"},  # a draft model (not loaded until a run starts)
}

# Numeric fields that are lists (or a number or a list): a declared range takes one number, so validate()
# checks them; each is still refused at 1e30 (test below). (family, method, field) -> a bad value.
LIST_FIELDS: dict[tuple[str, str, str], typing.Any] = {
    ("recipe", "hico-drop", "stages"): (0.5, 1e30),  # increasing layer fractions in (0, 1)
    ("recipe", "hico-forward", "stages"): (0.5, 1e30),
    ("recipe", "sale", "tau"): 1e30,  # a threshold in [0, 1], or one per query head
}

# Free text and objects: names, paths, templates and nested specs (each checked by validate or where used).
FREE_TEXT = {
    "scorer",  # "self" or a model name
    "marker", "instruction", "ask", "history", "restrict",  # prompt text
    "base", "view", "recipe",  # a nested method or recipe spec, parsed by validate
    "model_name", "fusion", "weights", "allocation", "heads", "factors",  # a model name or a file path
    "model", "tokenizer",  # API-only objects (a loaded draft model)
}


def _methods() -> list[tuple[str, str, type]]:
    return [(fam, name, cls) for fam, name, cls in REGISTRY.entries() if fam in FAMILIES]


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def _atoms(tp: typing.Any) -> set:
    """The scalar types a field annotation allows (``int | None`` -> {int, NoneType})."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return set().union(*(_atoms(a) for a in typing.get_args(tp)))
    if origin in (tuple, list):
        return {origin}
    return {tp}


def _numeric(tp: typing.Any) -> bool:
    return bool(_atoms(tp) & {int, float})


def _rng(f: dataclasses.Field) -> dict | None:
    return f.metadata.get("longlab_range")


def _names_range(message: str, f: dataclasses.Field) -> bool:
    """Does an error message state the field's declared range (its text, or each of its choices)?"""
    choices = _rng(f)["choices"]
    if param_range(f) in message or choices is None:
        return param_range(f) in message
    return all((repr(c) if isinstance(c, str) else str(c)) in message for c in choices)


def _build(fam: str, name: str, cls: type, **kwargs: typing.Any) -> typing.Any:
    return cls(**{**REQUIRED.get((fam, name), {}), **kwargs})


def _ids(cases: list) -> list[str]:
    return [f"{c[0]}:{c[1]}" + (f".{c[3].name}" if len(c) > 3 else "") for c in cases]


METHODS = _methods()
NUMERIC = [
    (fam, name, cls, f)
    for fam, name, cls in METHODS
    for f in _fields(cls)
    if _numeric(typing.get_type_hints(cls)[f.name]) and (fam, name, f.name) not in LIST_FIELDS
]


# ------------------------------------------------------------------------------------- every field declared
def test_the_families_are_all_here():
    fams = {fam for fam, _, _ in METHODS}
    assert fams == set(FAMILIES)
    assert len(METHODS) > 50 and len(NUMERIC) > 150


@pytest.mark.parametrize("fam, name, cls", METHODS, ids=_ids(METHODS))
def test_every_field_declares_its_range_or_is_listed(fam, name, cls):
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        tp, rng = hints[f.name], _rng(f)
        where = f"{fam}:{name}.{f.name}"
        if (fam, name, f.name) in LIST_FIELDS:
            assert rng is None, where  # listed as checked by validate(): keep the list true
        elif _numeric(tp):
            assert rng is not None, f"{where}: a numeric field without a declared range"
            if rng["choices"] is None:  # a range: bounded on both sides, so 1e30 is never accepted
                assert rng["low"] is not None and rng["high"] is not None, where
                assert math.isfinite(rng["high"]) and rng["high"] < 1e30, where
                assert rng["integer"] == (float not in _atoms(tp)), f"{where}: integer= must match the type"
        elif bool in _atoms(tp):
            assert rng is not None and param_range(f) == "true or false", where
        elif rng is None:
            assert f.name in FREE_TEXT, f"{where}: declare its choices (param(..., choices=...)) or list it"


# ------------------------------------------------------------------------------------- nonsense is refused
def _bad_values(f: dataclasses.Field, tp: typing.Any) -> list[typing.Any]:
    rng = _rng(f)
    out: list[typing.Any] = [1e30]
    if int in _atoms(tp):
        out.append(2**70)
    if rng["choices"] is None and rng["low"] is not None and rng["low"] > -1:
        out.append(-1)  # negative makes no sense here
    elif rng["choices"] is not None and -1 not in rng["choices"]:
        out.append(-1)
    return out


def _refused_before_validate(monkeypatch, fam, name, cls, **kwargs) -> str:
    """Build the method with ``kwargs``; it must raise LonglabError from the declared ranges, before its
    validate() (where work such as parsing a base spec or reading a file happens) runs."""

    def no_work(self):  # pragma: no cover - reached only when a declared range lets nonsense through
        raise AssertionError(f"{fam}:{name} ran validate() with {kwargs}")

    monkeypatch.setattr(cls, "validate", no_work)
    with pytest.raises(LonglabError) as err:
        _build(fam, name, cls, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("fam, name, cls, f", NUMERIC, ids=_ids(NUMERIC))
def test_nonsense_is_refused_naming_method_field_and_range(monkeypatch, fam, name, cls, f):
    tp = typing.get_type_hints(cls)[f.name]
    for value in _bad_values(f, tp):
        message = _refused_before_validate(monkeypatch, fam, name, cls, **{f.name: value})
        assert name in message and f.name in message and _names_range(message, f), (value, message)
        assert len(message) < 300


@pytest.mark.parametrize("fam, name, cls, f", NUMERIC, ids=_ids(NUMERIC))
def test_nonsense_in_a_method_string_is_refused_naming_the_range(fam, name, cls, f):
    """The same through the one parser (``name:field=value``), as the CLI and the API read a method."""
    if getattr(cls, "from_rest", None) is not None:
        pytest.skip(f"{name} reads its own text after '{name}:' (its fields are set from the API)")
    tp = typing.get_type_hints(cls)[f.name]
    required = ",".join(f"{k}={v}" for k, v in REQUIRED.get((fam, name), {}).items() if k != f.name)
    for value in _bad_values(f, tp):
        shown = "1e30" if value == 1e30 else str(value)
        spec = f"{name}:{required + ',' if required else ''}{f.name}={shown}"
        with pytest.raises(LonglabError) as err:
            REGISTRY.parse(fam, spec)
        message = str(err.value)
        assert name in message and f.name in message and _names_range(message, f), (spec, message)


@pytest.mark.parametrize("key, value", list(LIST_FIELDS.items()), ids=[k[1] for k in LIST_FIELDS])
def test_list_fields_refuse_nonsense_too(key, value):
    fam, name, field = key
    with pytest.raises(LonglabError) as err:
        _build(fam, name, REGISTRY.get(fam, name), **{field: value})
    assert name in str(err.value) and field in str(err.value) and "1" in str(err.value)


CHOICES = [(fam, name, cls, f) for fam, name, cls in METHODS for f in _fields(cls)
           if (_rng(f) or {}).get("choices") is not None and not isinstance(f.default, bool)]


@pytest.mark.parametrize("fam, name, cls, f", CHOICES, ids=_ids(CHOICES))
def test_a_value_outside_the_choices_is_refused(monkeypatch, fam, name, cls, f):
    message = _refused_before_validate(monkeypatch, fam, name, cls, **{f.name: "nonsense"})
    assert name in message and f.name in message and _names_range(message, f), message


# ----------------------------------------------------------------------------- the issue's cases, by the CLI
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--recipe", "pyramidkv:beta=-1"], "pyramidkv: beta must be in [1, 1048576], got -1"),
        (["--recipe", "restkv:tau=1e30"], "restkv: tau must be in (0, 10]"),
        (["--recipe", "comi@0.5:alpha=1e30"], "comi: alpha must be in [0, 100]"),
        (["--recipe", "flexprefill:tau=1e30"], "flexprefill: FlexPrefill.tau must be in [0, 1]"),
        (["--recipe", "sale:tau=1e30"], "sale: SALE.tau must be in [0, 1]"),
        (["--recipe", "inftythink:segment=999999999999"],
         "inftythink: segment must be an integer in [1, 1048576]"),
        (["--recipe", "inftythink:segment=100000,iterations=100"], "iterations x segment"),
        (["--recipe", "xattention:bq=999999999999"],
         "xattention: XAttention.bq must be an integer in [1, 16384]"),
        (["--recipe", "quest:page_size=999999999999"], "quest: page_size must be an integer in [1, 16384]"),
        (["--docs", "{doc}", "--reuse", "ape:temperature=1e30"], "ape: temperature must be in [0.01, 100]"),
        (["--docs", "{doc}", "--reuse", "cacheblend:gradual_factor=1e30"], "cacheblend: gradual_factor"),
        (["--speculative", "lookup", "--verify", "dustin:page_size=999999999999"],
         "dustin: page_size must be an integer in [1, 16384]"),
    ],
)
def test_the_issues_cases_fail_before_loading_with_one_line(capsys, tmp_path, args, fragment):
    doc = tmp_path / "doc.txt"
    doc.write_text("A document. " * 10)
    args = [str(doc) if a == "{doc}" else a for a in args]
    prompt = ["--question", "q?"] if "--docs" in args else ["--context", "x"]
    argv = ["generate", "--model", "no-such-model-is-loaded", *prompt, *args]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------- defaults and round trips
@pytest.mark.parametrize("fam, name, cls", METHODS, ids=_ids(METHODS))
def test_the_defaults_pass_and_round_trip(fam, name, cls):
    method = _build(fam, name, cls)
    text = REGISTRY.format(method)
    assert REGISTRY.parse(fam, text) == method, text


def test_the_methods_command_shows_every_declared_range(capsys):
    assert cli_main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    headers = {f"# {fam.what}s ({fam.where})": fam.name for fam in FAMILIES_ALL.values()}
    params: dict[tuple[str, str], str] = {}
    family = ""
    for line, nxt in zip(lines, lines[1:] + [""]):
        if line.startswith("# "):
            family = headers[line]
        elif line[:1].strip() and nxt.strip().startswith("params:"):
            params[(family, line.split()[0])] = nxt
    for fam, name, cls in METHODS:
        shown = params[(fam, name)]
        for f in _fields(cls):
            if _rng(f) is not None and f.default is not dataclasses.MISSING:
                assert f"{f.name}={f.default!r} ({param_range(f)})" in shown, (fam, name, f.name)
