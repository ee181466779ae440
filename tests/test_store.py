"""Tests for the SQLite results store (longlab.eval.store)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from longlab.eval.identity import (
    RUN_KEY_FIELDS,
    config_hash,
    git_commit,
    make_run_key,
    package_version,
    peak_rss_mb,
    run_key_of,
)
from longlab.eval.store import COLUMNS, DB_NAME, ResultStore

SRC = Path(__file__).resolve().parents[1] / "src"


def _row(i: int, **over: object) -> dict:
    row = {
        "model": "tiny",
        "recipe": "snapkv@0.5",
        "method": "snapkv",
        "compression_ratio": 0.5,
        "task": "niah",
        "length": 1024,
        "sample_id": f"s{i}",
        "query_aware": False,
        "seed": 0,
        "config_hash": "abc",
        "prediction": f"pred {i}",
        "answers": [f"ans {i}", "other"],
        "score": 1.0,
        "kv_bytes_before": 1000,
        "kv_bytes_after": 500,
    }
    row.update(over)
    return row


def test_schema_and_pragmas(tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir"
    with ResultStore(out) as store:
        assert (out / DB_NAME).is_file()
        cols = [r[1] for r in store.conn.execute("PRAGMA table_info(results)")]
        assert cols == ["id", *COLUMNS]
        mcols = [r[1] for r in store.conn.execute("PRAGMA table_info(metrics)")]
        assert mcols == ["id", "run_key", "layer", "head", "name", "value"]
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert len(store) == 0 and store.done_keys() == set()
    with pytest.raises(RuntimeError):
        store.has("x")
    # re-opening an existing store keeps it
    with ResultStore(out) as store:
        assert store.integrity_check() == "ok"


def test_run_key_stable_and_normalised() -> None:
    a = make_run_key(model="m", recipe="full", length=1024, query_aware=True, sample_id=3)
    b = make_run_key(sample_id="3", query_aware=1, length=1024, recipe="full", model="m", seed=None)
    assert a == b and len(a) == 64
    assert a != make_run_key(model="m", recipe="full", length=2048, query_aware=True, sample_id=3)
    row = _row(1)
    assert run_key_of(row) == make_run_key(**{k: row[k] for k in RUN_KEY_FIELDS})
    assert run_key_of(row) != run_key_of(_row(1, seed=1))
    # non-identity fields do not change the key
    assert run_key_of(row) == run_key_of(_row(1, score=0.0, prediction="other"))


def test_add_is_idempotent_and_round_trips(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        row = _row(0, note="free metadata")
        assert store.add(row) is True
        assert store.add(dict(row, score=0.0)) is False  # same identity: ignored, not overwritten
        assert len(store) == 1
        (got,) = store.rows()
        key = run_key_of(row)
        assert got["run_key"] == key and store.has(key) and store.done_keys() == {key}
        assert got["answers"] == ["ans 0", "other"]
        assert got["extra"] == {"note": "free metadata"}
        assert got["score"] == 1.0 and got["query_aware"] == 0 and got["length"] == 1024
        assert got["package_version"] == package_version()
        assert got["created_at"] and "T" in got["created_at"]
        assert not store.has("nope")


def test_add_many_and_filters(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        variants = (("full", None), ("snapkv@0.5", 0.5))
        rows = [_row(i, recipe=r, depth=d) for i in range(3) for r, d in variants]
        assert store.add_many(rows) == 6
        assert store.add_many(rows + [_row(9)]) == 1
        assert len(store) == 7
        assert len(store.rows(recipe="full")) == 3
        assert len(store.rows(recipe=["full", "snapkv@0.5"], sample_id="s1")) == 2
        assert len(store.rows(depth=None)) == 4
        assert len(store.rows(recipe=[])) == 0
        assert store.done_keys(recipe="full") == {run_key_of(r) for r in rows if r["recipe"] == "full"}
        assert [r["sample_id"] for r in store.rows(recipe="snapkv@0.5")] == ["s0", "s1", "s2", "s9"]
        with pytest.raises(KeyError):
            store.rows(no_such_column=1)


def test_metrics(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as store:
        row = _row(0)
        items = [{"layer": 0, "head": h, "name": "density", "value": 0.1 * h} for h in range(3)]
        items.append({"name": "recall", "value": 0.9})  # all layers, all heads
        assert store.add(row, metrics=items)
        key = run_key_of(row)
        assert store.add_metrics(key, items) == 0  # duplicates ignored
        assert store.add_metrics(key, [{"layer": 1, "head": 0, "name": "density", "value": 0.5}]) == 1
        got = store.metrics(run_key=key, name="density")
        assert [(m["layer"], m["head"], m["value"]) for m in got] == [(0, 0, 0.0), (0, 1, 0.1), (0, 2, 0.2),
                                                                     (1, 0, 0.5)]
        (recall,) = store.metrics(name="recall")
        assert (recall["layer"], recall["head"]) == (-1, -1)
        # a row that is already stored does not get its metrics written again
        assert store.add(row, metrics=[{"name": "late", "value": 1.0}]) is False
        assert store.metrics(name="late") == []


def test_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert package_version() == "0+unknown" or package_version()[0].isdigit()
    assert git_commit(tmp_path) is None  # not a repository
    monkeypatch.setenv("PATH", str(tmp_path))  # git missing
    assert git_commit() is None
    monkeypatch.undo()

    @dataclasses.dataclass
    class Cfg:
        ratio: float
        layers: tuple[int, ...]

    h = config_hash({"b": 1, "a": [1, 2], "cfg": Cfg(0.5, (1, 2))})
    assert h == config_hash({"cfg": Cfg(0.5, (1, 2)), "a": (1, 2), "b": 1}) and len(h) == 16
    assert h != config_hash({"b": 2, "a": [1, 2], "cfg": Cfg(0.5, (1, 2))})
    rss = peak_rss_mb()
    assert rss is None or 1.0 < rss < 1e6


WRITER = textwrap.dedent(
    """
    import sys
    from longlab.eval.identity import run_key_of
    from longlab.eval.store import ResultStore

    N = 4000
    PAD = "x" * 1500  # a few KiB per row, so pages are in flight when the kill lands

    def make_row(i):
        return {"model": "tiny", "recipe": "snapkv@0.5", "method": "snapkv", "compression_ratio": 0.5,
                "task": "niah", "length": 1024, "sample_id": str(i), "query_aware": 0, "seed": 0,
                "prediction": f"{i}:" + PAD, "answers": [str(i)], "score": (i % 3) / 2,
                "kv_bytes_before": 2 * i, "kv_bytes_after": i, "extra": {"i": i, "pad": PAD}}

    if __name__ == "__main__":
        store = ResultStore(sys.argv[1])
        done = store.done_keys()
        for i in range(N):
            row = make_row(i)
            if run_key_of(row) in done:
                continue
            store.add(row)
            print(i, flush=True)
    """
)


def _load_writer(path: Path):
    spec = importlib.util.spec_from_file_location("_longlab_writer", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _check_consistent(out: Path, writer) -> set[str]:
    conn = sqlite3.connect(str(out / DB_NAME))
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        n, n_keys = conn.execute("SELECT COUNT(*), COUNT(DISTINCT run_key) FROM results").fetchone()
        assert n == n_keys
    finally:
        conn.close()
    with ResultStore(out) as store:
        rows = store.rows()
    for r in rows:  # no half rows: every stored row is exactly the row that was written
        want = writer.make_row(int(r["sample_id"]))
        assert r["prediction"] == want["prediction"] and r["extra"] == want["extra"]
        assert r["score"] == want["score"] and r["kv_bytes_after"] == want["kv_bytes_after"]
    return {r["run_key"] for r in rows}


def test_sigkill_mid_run_then_resume(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    writer = _load_writer(script)
    out = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    seen: set[str] = set()
    for _ in range(3):  # kill, resume, kill again, ...
        proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True,
                                env=env)
        assert proc.stdout is not None
        written = 0
        for _line in proc.stdout:
            written += 1
            if written >= 60:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        keys = _check_consistent(out, writer)
        assert seen <= keys  # committed rows survive
        assert len(keys) >= len(seen) + written and len(keys) < writer.N  # stopped mid-way
        seen = keys

    all_rows = [writer.make_row(i) for i in range(writer.N)]
    with ResultStore(out) as store:
        done = store.done_keys()
        assert store.add_many(r for r in all_rows if run_key_of(r) not in done) == writer.N - len(done)
        assert store.add_many(all_rows) == 0  # a full re-run adds nothing
    keys = _check_consistent(out, writer)
    assert keys == {run_key_of(r) for r in all_rows}


def test_readonly_store_reads_an_older_schema(tmp_path: Path) -> None:
    # a database from before the metrics table and most columns existed: read, nothing added
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("CREATE TABLE results (id INTEGER PRIMARY KEY, run_key TEXT UNIQUE NOT NULL, recipe TEXT, "
                 "score REAL)")
    conn.execute("INSERT INTO results (run_key, recipe, score) VALUES ('k', 'full', 1.0)")
    conn.commit()
    conn.close()
    before = (tmp_path / DB_NAME).read_bytes()
    with ResultStore(tmp_path, readonly=True) as store:
        assert [(r["recipe"], r["score"]) for r in store.rows()] == [("full", 1.0)]
        assert store.metrics() == [] and len(store) == 1
    assert (tmp_path / DB_NAME).read_bytes() == before
    # opened for writing it is upgraded in place (the columns it lacks are added)
    with ResultStore(tmp_path) as store:
        assert "config_hash" in store.rows()[0] and store.metrics() == []


def test_a_compressed_store_is_read_from_a_private_copy_and_never_written(tmp_path):
    # bench/results keeps stores as results.sqlite.gz: readers open them, writers are told to gunzip
    import gzip

    from longlab import LonglabError

    out = tmp_path / "r"
    with ResultStore(out) as store:
        store.add({"model": "m", "recipe": "full", "task": "t", "length": 1, "sample_id": "0", "score": 1.0})
    db = out / "results.sqlite"
    (out / "results.sqlite.gz").write_bytes(gzip.compress(db.read_bytes()))
    db.unlink()
    with ResultStore(out, readonly=True) as store:
        assert len(store) == 1
        copy = store.path
    assert not copy.exists() and sorted(p.name for p in out.iterdir()) == ["results.sqlite.gz"]
    with pytest.raises(LonglabError, match="gunzip -k"):
        ResultStore(out)
    (out / "results.sqlite.gz").write_bytes(b"not gzip")
    with pytest.raises(LonglabError, match="not a readable gzip file"):
        ResultStore(out, readonly=True)
