"""Faults of a results directory: each gives one LonglabError line naming the argument (no traceback),
and nothing is written.

Read-only directories: run as root, ``chmod`` does not stop a write (CAP_DAC_OVERRIDE), so those cases
run the real CLI in a subprocess without that capability (``setpriv --bounding-set=-dac_override``);
as another user plain ``chmod`` is enough; the test is skipped only when neither is possible.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from longlab.cli import main as cli_main
from longlab.eval.rows import load_rows
from longlab.eval.store import DB_NAME, ResultStore, check_results_dir
from longlab.recipe import LonglabError

SRC = Path(__file__).resolve().parents[1] / "src"
EVAL = ["eval", "--model", "tiny-llama", "--max-new-tokens", "2", "--no-progress", "--recipes", "full",
        "--tasks", "niah_single_1", "--lengths", "512", "--samples", "1"]


def _rows(n: int = 40) -> list[dict]:
    recipes = ("full", "snapkv@0.5")
    return [{"model": "m", "recipe": r, "task": "t", "length": 512, "sample_id": str(i),
             "score": float(i % 2), "prediction": "p" * 200} for i in range(n) for r in recipes]


def _good_store(out: Path) -> Path:
    with ResultStore(out) as store:
        store.add_many(_rows())
    return out / DB_NAME


def _make_fault(out: Path, kind: str) -> Path:
    """A results directory whose ``results.sqlite`` is broken in the way ``kind`` says."""
    db = out / DB_NAME
    if kind == "truncated":
        data = _good_store(out).read_bytes()
        db.write_bytes(data[: len(data) // 2])
    else:
        out.mkdir(parents=True, exist_ok=True)
        if kind == "random":
            db.write_bytes(random.Random(0).randbytes(8192))
        elif kind == "text":
            db.write_text("model,recipe,score\nsmollm2-135m,full,1.0\n" * 50)
        elif kind == "directory":
            db.mkdir()
        elif kind == "foreign":  # a real SQLite file, but not ours
            conn = sqlite3.connect(db)
            conn.execute("CREATE TABLE people (name TEXT)")
            conn.commit()
            conn.close()
        else:
            raise AssertionError(kind)
    return db


def _snapshot(out: Path) -> dict[str, bytes | None]:
    return {p.name: (p.read_bytes() if p.is_file() else None) for p in sorted(out.iterdir())}


FAULTS = ["random", "truncated", "text", "directory", "foreign"]
EXPECTED = {
    "random": "is not a readable SQLite database",
    "truncated": "is not a readable SQLite database",
    "text": "is not a readable SQLite database",
    "directory": "is not a file (a directory?)",
    "foreign": "not a longlab results database",
}


@pytest.mark.parametrize("kind", FAULTS)
def test_report_on_a_faulty_database(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    db = _make_fault(out, kind)
    before = _snapshot(out)
    assert cli_main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longlab: error: report DIR: ") and str(db) in err and EXPECTED[kind] in err
    assert "Traceback" not in err and err.count("\n") == 1  # one line
    assert _snapshot(out) == before  # no report.md, no -wal/-shm, the file untouched


@pytest.mark.parametrize("kind", FAULTS)
def test_store_for_writing_refuses_a_faulty_database(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "res"
    _make_fault(out, kind)
    before = _snapshot(out)
    with pytest.raises(LonglabError, match=r"^--out: .*" + re.escape(EXPECTED[kind])):
        ResultStore(out)
    with pytest.raises(LonglabError, match="^--out: "):
        check_results_dir(out)
    assert _snapshot(out) == before


@pytest.mark.slow  # loads a model before the store is opened (~5 s under load): ResultStore is tested above
def test_eval_cli_out_is_a_file_or_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    assert cli_main([*EVAL, "--out", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "--out: " in err and "is a file, not a directory" in err and "Traceback" not in err
    assert afile.read_text() == "not a directory"
    out = tmp_path / "res"
    _make_fault(out, "random")
    before = _snapshot(out)
    assert cli_main([*EVAL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out: " in err and "is not a readable SQLite database" in err and "Traceback" not in err
    assert _snapshot(out) == before


def test_report_out_dir_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main(["report", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "report DIR: " in err and "is a file, not a results directory" in err and "Traceback" not in err


def test_check_results_dir_creates_nothing(tmp_path: Path) -> None:
    check_results_dir(tmp_path / "new" / "deeper")  # fine: can be made
    assert not (tmp_path / "new").exists()
    _good_store(tmp_path / "good")
    check_results_dir(tmp_path / "good")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LonglabError, match="^--out: .* is a file"):
        check_results_dir(tmp_path / "afile")
    with pytest.raises(LonglabError, match="^--out: cannot create directory .*afile is a file"):
        check_results_dir(tmp_path / "afile" / "sub")
    with pytest.raises(LonglabError, match="^--out: empty path"):
        check_results_dir("")
    with pytest.raises(LonglabError, match="^--out: empty path"):
        ResultStore("  ")
    with pytest.raises(LonglabError, match="^--out: expected a directory path, got int"):
        ResultStore(123)  # type: ignore[arg-type]


def test_empty_database_file_is_an_empty_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / DB_NAME).write_bytes(b"")
    assert cli_main(["report", str(tmp_path)]) == 1
    assert "no results" in capsys.readouterr().out


def test_report_reads_without_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import longlab.eval.store as store_mod

    out = tmp_path / "odd ?#% name"  # the mode=ro URI quotes the path
    _good_store(out)
    before = _snapshot(out)
    for writable in (True, False):  # query_only where we may write, SQLite mode=ro where we may not
        monkeypatch.setattr(store_mod.os, "access", lambda *a, w=writable, **k: w)
        with ResultStore(out, readonly=True, what="report DIR") as store:
            assert len(store.rows()) == 80
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                store.conn.execute("DELETE FROM results")  # the connection cannot write
        assert len(load_rows(out)) == 80
        monkeypatch.undo()
    assert _snapshot(out).keys() >= before.keys() and _snapshot(out)[DB_NAME] == before[DB_NAME]
    with pytest.raises(LonglabError, match="^report DIR: results directory not found"):
        ResultStore(tmp_path / "missing", readonly=True, what="report DIR")
    with pytest.raises(LonglabError, match="^report DIR: no results database in"):
        ResultStore(tmp_path, readonly=True, what="report DIR")


def test_failed_open_removes_the_directory_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import longlab.eval.store as store_mod

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(store_mod.sqlite3, "connect", refuse)
    with pytest.raises(LonglabError, match="^--out: cannot write .*read-only"):
        ResultStore(tmp_path / "made")
    assert not (tmp_path / "made").exists()


# --------------------------------------------------------------------------------------------------
# read-only directory and database, for real


CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from longlab.cli import main
    from longlab.eval.store import ResultStore, check_results_dir
    from longlab.recipe import LonglabError

    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] in ("ResultStore", "check_results_dir"):  # what `longlab eval --out` opens
                try:
                    (ResultStore if argv[0] == "ResultStore" else check_results_dir)(argv[1])
                    code = 0
                except LonglabError as exc:
                    code, _ = 2, print(f"longlab: error: {exc}", file=sys.stderr)
            else:
                code = main(argv)
        results.append({"code": code, "err": err.getvalue()})
    print(json.dumps(results))
    """
)


def _unprivileged() -> list[str]:
    """Command prefix that makes permission bits bind (root drops CAP_DAC_OVERRIDE), or skip."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a chmod'ed directory would still be writable")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]


def _run_readonly(tmp_path: Path, cases: list[list[str]]) -> tuple[Path, Path, list[dict]]:
    """Run ``cases`` (CLI argv lists, or ``["ResultStore", dir]``) in a child that can write neither
    into ``tmp_path/ro`` (a read-only directory holding a read-only database) nor the read-only
    ``tmp_path/rofile/results.sqlite`` (in a writable directory); check ``ro`` is left as it was."""
    ro_dir, ro_file = tmp_path / "ro", tmp_path / "rofile"
    _good_store(ro_dir)
    _good_store(ro_file)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    for db in (ro_dir / DB_NAME, ro_file / DB_NAME):
        db.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    ro_dir.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    before = _snapshot(ro_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([*_unprivileged(), sys.executable, str(script), json.dumps(cases)],
                              capture_output=True, text=True, timeout=300, env=env)
    finally:
        ro_dir.chmod(stat.S_IRWXU)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in res:
        assert "Traceback" not in r["err"]
    assert _snapshot(ro_dir) == before  # nothing written into the read-only directory
    return ro_dir, ro_file, res


def test_readonly_results_dir_and_database(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    ro, rofile = tmp_path / "ro", tmp_path / "rofile"
    _, _, res = _run_readonly(tmp_path, [
        ["report", str(ro)],  # reads, but cannot write the report there
        ["report", str(ro), "--report-dir", str(target), "--no-html"],
        ["report", str(rofile), "--no-html"],  # a read-only database file is read
        ["ResultStore", str(ro)],  # what `longlab eval --out` opens
        ["ResultStore", str(ro / "sub")],
        ["check_results_dir", str(ro)],
    ])
    assert res[0]["code"] == 2
    assert "report DIR: cannot write the report into" in res[0]["err"] and "--report-dir" in res[0]["err"]
    assert res[1]["code"] == 0, res[1]["err"]
    assert "| snapkv@0.5 |" in (target / "report.md").read_text()
    assert res[2]["code"] == 0, res[2]["err"]
    assert "| full |" in (rofile / "report.md").read_text()
    assert res[3]["code"] == 2 and "--out: " in res[3]["err"] and "read-only" in res[3]["err"]
    assert res[4]["code"] == 2 and "--out: cannot create directory" in res[4]["err"]
    assert res[5]["code"] == 2 and "--out: cannot write in" in res[5]["err"]


@pytest.mark.slow  # two model loads in a fresh process
def test_eval_cli_into_a_readonly_dir(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    _, _, res = _run_readonly(tmp_path, [[*EVAL, "--out", str(ro)], [*EVAL, "--out", str(ro / "sub")]])
    assert res[0]["code"] == 2 and "--out: " in res[0]["err"] and "read-only" in res[0]["err"]
    assert res[1]["code"] == 2 and "--out: cannot create directory" in res[1]["err"]
