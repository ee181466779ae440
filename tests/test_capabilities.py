"""Capabilities are declared on the classes; the harness reads them instead of checking concrete classes
or reading hyper-parameter fields (DESIGN: no ``isinstance`` special cases)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import longlab  # noqa: F401  (registers every method)
from longlab.cache import LonglabLayer
from longlab.kv.base import KVPolicy
from longlab.quant.storage import QuantizedLayer
from longlab.recipe import RECIPE_METHODS, Method, parse_recipe

SRC = Path(__file__).resolve().parents[1] / "src" / "longlab"
HARNESS = ["eval/config.py", "eval/driver.py", "eval/runner.py", "eval/ray_backend.py", "engine/planner.py",
           "engine/prefill.py", "engine/decode.py", "engine/core.py", "request.py", "generation.py"]
CAPABILITIES = ("needs_observe", "reads_attention", "acts_during_decode", "reports_prefill_metrics",
                "batch_select_safe")


def _instance(cls: type[Method]) -> Method | None:
    try:
        return cls()
    except Exception:  # e.g. a required budget: the class-level declarations are checked anyway
        return None


@pytest.mark.parametrize("name", HARNESS)
def test_the_harness_never_checks_classes_or_reads_method_fields(name):
    tree = ast.parse((SRC / name).read_text())
    imported = {  # names imported from longlab modules
        a.asname or a.name for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("longlab"))
        for a in node.names
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        where = f"{name}:{node.lineno}"
        assert node.func.id != "type", f"{where}: type(...) check"
        if node.func.id == "isinstance":
            classes = node.args[1]
            names = [e.id for e in getattr(classes, "elts", [classes]) if isinstance(e, ast.Name)]
            assert not set(names) & imported, f"{where}: isinstance on a longlab class {names}"
        if node.func.id in ("getattr", "hasattr") and len(node.args) > 1:
            field = node.args[1]
            assert not (isinstance(field, ast.Constant) and field.value in ("window_size", *CAPABILITIES)), (
                f"{where}: reads {field.value!r} by name; declare it as a capability"
            )


@pytest.mark.parametrize("name", sorted(RECIPE_METHODS))
def test_every_method_declares_its_capabilities(name):
    cls = RECIPE_METHODS[name]
    for cap in CAPABILITIES:
        assert isinstance(getattr(cls, cap), bool), (name, cap)
    if issubclass(cls, KVPolicy) and cls.select_decode is not KVPolicy.select_decode:
        assert cls.acts_during_decode, f"{name} overrides select_decode: declare acts_during_decode"
    if cls.kind in ("quant", "decode"):
        assert cls.acts_during_decode or cls.kind == "decode"
    method = _instance(cls)
    if method is not None:
        window = getattr(method, "window_size", 0) if cls.kind == "kv" else 0
        assert method.observation_window == window, name  # what the harness read by field name before


def test_observation_window_follows_the_configuration():
    assert parse_recipe("snapkv@0.5:window_size=200").kv[0].observation_window == 200
    assert parse_recipe("knorm@0.5").kv[0].observation_window == 0
    assert parse_recipe("kivi2").kv[0].observation_window == 0
    fields = {f.name for f in dataclasses.fields(parse_recipe("snapkv@0.5").kv[0])}
    assert "observation_window" not in fields  # a property, never a recipe parameter


def test_storage_layers_declare_whether_they_stack():
    assert LonglabLayer.batchable and not QuantizedLayer.batchable
