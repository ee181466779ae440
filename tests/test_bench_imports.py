"""Every ``longlab`` name a bench/ script imports exists (a renamed or moved module breaks the bench
script at once, not months later when someone reruns it). Static: the scripts are parsed, not run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _longlab_imports(path: Path) -> list[tuple[int, str, str | None]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longlab"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("longlab")]
    return found


def _exists(module: str, name: str | None) -> bool:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    if name is None or name == "*" or hasattr(mod, name):
        return True
    return hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None


@pytest.mark.parametrize("script", sorted(BENCH.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCH)))
def test_bench_script_imports_exist(script):
    missing = [f"line {line}: {mod}" + (f".{name}" if name else "")
               for line, mod, name in _longlab_imports(script) if not _exists(mod, name)]
    assert not missing, f"{script.name} imports what longlab no longer has: {missing}"
