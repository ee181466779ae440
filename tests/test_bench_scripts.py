"""bench/ is code (issue 30, item 4): at most MAX_SCRIPTS scripts, none using a private longlab name, every
script's ``--help`` (and every subcommand's) runs, the accuracy sweeps' TOML configs are valid
``longlab eval`` options, and the shared timing runner (``bench/common.py``) interleaves and takes medians."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MAX_SCRIPTS = 25
SCRIPTS = sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and p.is_file())
PY_SCRIPTS = [p for p in SCRIPTS if p.suffix == ".py"]


@functools.lru_cache(maxsize=1)
def _private_longlab_names() -> frozenset[str]:
    """Every ``_name`` (not dunder) that src/longlab defines: functions, classes, module or instance
    attributes and module-level variables."""
    names: set[str] = set()
    for path in (ROOT / "src" / "longlab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def private_uses(source: str, private: set[str] | frozenset[str]) -> list[str]:
    """What a script uses of longlab's private names: ``from longlab.x import _y`` (or ``y as _z``),
    ``import longlab.x._y``, and an attribute ``obj._y`` where ``_y`` is a private name longlab defines
    (``self._y`` of the script's own classes excepted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longlab"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
            found += [f"line {node.lineno}: {node.module}.{a.name}" + (f" as {a.asname}" if a.asname else "")
                      for a in node.names
                      if a.name.startswith("_") or (a.asname or "").startswith("_")]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("longlab") and any(p.startswith("_") for p in a.name.split("."))]
        elif (isinstance(node, ast.Attribute) and node.attr in private
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_use_check_catches_each_form():
    private = {"_eval_generator", "_lag_rows", "_compiled_flex"}
    src = ("from longlab.lab.evaluate import _eval_generator\n"
           "from longlab.engine.decode import stack_streams as _stack\n"
           "import longlab.sparse._impl\n"
           "rows = task._lag_rows(x)\n"
           "self._lag_rows = 1\n"
           "from longlab.engine.decode import stack_streams\n")
    found = private_uses(src, private)
    assert [f.split(":")[0] for f in found] == ["line 1", "line 2", "line 3", "line 4"], found


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_bench_script_uses_no_private_longlab_name(script):
    found = private_uses(script.read_text(encoding="utf-8"), _private_longlab_names())
    assert not found, f"{script.name} uses private longlab names (make them public in their module): {found}"


def test_at_most_25_bench_scripts():
    names = [str(p.relative_to(BENCH)) for p in SCRIPTS]
    assert len(names) <= MAX_SCRIPTS, f"{len(names)} scripts in bench/ (at most {MAX_SCRIPTS}): {names}"


def _subcommands(script: Path) -> list[str]:
    """The keys of a script's ``SUBCOMMANDS = {...}`` literal (empty for a single-command script)."""
    for node in ast.parse(script.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SUBCOMMANDS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return [k.value for k in node.value.keys]
    return []


HELP_CASES = [(p, sub) for p in PY_SCRIPTS if p.name != "common.py" for sub in (_subcommands(p) or [None])]


@pytest.mark.parametrize("script,sub", HELP_CASES,
                         ids=[f"{p.stem}{'-' + s if s else ''}" for p, s in HELP_CASES])
def test_bench_script_help_runs(script, sub, monkeypatch):
    """``python bench/X.py [SUB] --help`` prints a usage and exits 0 (run in this process: the imports are
    the slow part and are shared)."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(script), *([sub] if sub else []), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None), out.getvalue()[-2000:]
    assert "usage" in out.getvalue().lower(), out.getvalue()[-2000:]


def test_dispatcher_lists_subcommands_and_refuses_an_unknown_one():
    proc = subprocess.run([sys.executable, str(BENCH / "kv.py"), "no-such-sub"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert proc.returncode == 2
    assert "indexmem-pairs" in proc.stdout and "quant-speed" in proc.stdout


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.suffix == ".sh"], ids=lambda p: p.name)
def test_bench_shell_script_parses(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize("config", sorted((BENCH / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_bench_config_is_valid_for_longlab_eval(config):
    from longlab.cli import build_parser
    from longlab.cli.eval import config_argv

    flags = config_argv(config)
    args = build_parser().parse_args(["eval", *flags, *([] if "--out" in flags else ["--out", "x"])])
    assert args.model and args.threads == 1


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runner_interleaves_rotated_rounds_and_takes_medians():
    common = _common()
    calls: list[str] = []

    def variant(name):
        return lambda: calls.append(name) or name

    variants = {"a": variant("a"), "b": variant("b"), "c": variant("c")}
    timing = common.interleaved(variants, repeats=3, warmup=1)
    # one warm-up round in order, then rounds rotated by their index
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert timing["results"] == {"a": "a", "b": "b", "c": "c"}
    for v in timing["variants"].values():
        assert len(v["wall_s"]) == len(v["cpu_s"]) == 3
        assert v["min_s"] <= v["median_s"] <= v["max_s"]
    assert "load_before" in timing and "load_after" in timing


def test_rotated_is_the_runners_round_order():
    """``rotated`` (spec_decode.py orders its per-sample rounds with it) is the order ``interleaved`` uses."""
    common = _common()
    assert [common.rotated("abc", r) for r in range(4)] == [list(x) for x in ("abc", "bca", "cab", "abc")]
    assert common.rotated([], 3) == []
    calls: list[str] = []
    common.interleaved({n: (lambda n=n: calls.append(n)) for n in "abc"}, repeats=3, warmup=0)
    assert calls == [x for r in range(3) for x in common.rotated("abc", r)]


def test_write_json_is_compact_and_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    """bench results are written compact, through a temporary file renamed into place; a failed write
    leaves the previous file as it was and no temporary file behind (it removes only its own)."""
    import json

    common = _common()
    out = tmp_path / "r.json"
    common.write_json(out, {"a": [1, 2]})
    assert out.read_text() == '{"a":[1,2]}\n'
    neighbour = tmp_path / ".r.json.user"  # a user's file beside it is never touched
    neighbour.write_text("keep")
    with pytest.raises(TypeError):
        common.write_json(out, {"a": object()})  # not serialisable: nothing written
    real_replace = common.os.replace

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(common.os, "replace", fail)
    with pytest.raises(OSError):
        common.write_json(out, {"b": 3})
    monkeypatch.setattr(common.os, "replace", real_replace)
    assert json.loads(out.read_text()) == {"a": [1, 2]}
    assert sorted(x.name for x in tmp_path.iterdir()) == [".r.json.user", "r.json"]
    assert neighbour.read_text() == "keep"


def test_runner_medians_and_ratios_by_hand(monkeypatch):
    common = _common()
    ticks = iter([0.0, 1.0, 1.0, 5.0, 5.0, 6.0, 6.0, 7.0, 7.0, 8.0, 8.0, 11.0])  # start/stop pairs
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(ticks))
    timing = common.interleaved({"base": lambda: None, "new": lambda: None}, repeats=3, warmup=0)
    # rounds: (base 1, new 4), (new 1, base 1), (base 1, new 3)
    assert timing["variants"]["base"]["wall_s"] == [1.0, 1.0, 1.0]
    assert timing["variants"]["new"]["wall_s"] == [4.0, 1.0, 3.0]
    assert timing["variants"]["new"]["median_s"] == 3.0
    assert common.ratios(timing, "base") == {"base": 1.0, "new": 3.0}
    with pytest.raises(ValueError, match="no variant"):
        common.ratios(timing, "missing")


@pytest.mark.parametrize("repeats,warmup", [(0, 0), (10_001, 0), (1, -1)])
def test_runner_bounds_repeats_before_work(repeats, warmup):
    common = _common()
    called = []
    with pytest.raises(ValueError, match="repeats must be in"):
        common.interleaved({"a": lambda: called.append(1)}, repeats=repeats, warmup=warmup)
    assert not called


def _eval_argv(tmp_path, text: str, *cli: str) -> list[str]:
    from longlab.cli.eval import expand_config

    path = tmp_path / "run.toml"
    path.write_text(text)
    return expand_config(["eval", "--config", str(path), *cli])


def test_eval_config_flags_and_command_line_wins(tmp_path):
    from longlab.cli import build_parser

    text = ('tasks = ["passkey", "vt"]\nlengths = [1024]\nsamples = 3\nquery-aware = true\n'
            'batch_decode = false\nout = "runs/x"\n')
    argv = _eval_argv(tmp_path, text, "--samples", "5")
    args = build_parser().parse_args(argv)
    assert args.tasks == ["passkey", "vt"] and args.lengths == [1024] and args.query_aware
    assert args.samples == 5 and args.batch_decode is False and args.out == "runs/x"


@pytest.mark.parametrize("text,words", [
    ("sample = 3\n", "unknown key 'sample'"),
    ("samples = \"three\"\n", "samples"),
    ("query-aware = 1\n", "true or false"),
    ("compress = \"middle\"\n", "allowed: end, chunk"),
    ("lengths = [\"a\"]\n", "lengths"),
    ("tasks = []\n", "non-empty list"),
    ("[grid]\nsamples = 1\n", "unknown key 'grid'"),
    ("samples = \n", "not valid TOML"),
])
def test_eval_config_refuses_bad_files(tmp_path, capsys, text, words):
    from longlab.cli import main

    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["eval", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_eval_config_missing_file(tmp_path, capsys):
    from longlab.cli import main

    assert main(["eval", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a file" in capsys.readouterr().err


def _tracked_results() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.stdout.splitlines() if line]


def test_committed_result_data_is_small_and_only_data() -> None:
    """Issue 30, item 3: bench/results holds at most 5 MB of compact result data: no logs, weights,
    scripts or uncompressed SQLite stores."""
    files = [p for p in _tracked_results() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= 5 * 10**6, f"bench/results holds {total / 1e6:.2f} MB in git (at most 5 MB)"
    banned = (".log", ".sh", ".py", ".pt", ".pth", ".bin", ".safetensors", ".sqlite", ".pkl", ".gguf")
    bad = [str(p.relative_to(ROOT)) for p in files if p.suffix in banned]
    assert not bad, f"not compact result data: {bad}"
