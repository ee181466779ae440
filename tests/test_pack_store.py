"""``bench/pack_store.py``: slimming a committed store drops only the named per-row detail (for the named
methods), keeps every row and its provenance, shortens run keys only when they stay unique, and refuses a
store with metrics rows."""

from __future__ import annotations

import gzip
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from longlab.errors import LonglabError
from longlab.eval.store import ResultStore

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pack(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "argv", ["pack_store.py"])
    return runpy.run_path(str(ROOT / "bench" / "pack_store.py"))["pack"]


def _rows():
    return [{"model": "m", "recipe": r, "method": r, "task": "t", "length": 8, "sample_id": str(i),
             "score": 1.0, "git_commit": "abc1234", "created_at": f"2026-12-0{i + 1}T00:00:00+00:00",
             "context": {"kept_spans": [[0, i + 1]], "kept_fraction": 0.5}, "checkpoint": "runs/x"}
            for r in ("hico", "tpp") for i in range(3)]


def test_pack_drops_only_the_named_detail_and_keeps_rows_and_provenance(tmp_path, pack):
    with ResultStore(tmp_path / "s") as st:
        st.add_many(_rows())
    with ResultStore(tmp_path / "s", readonly=True) as st:
        before = {r["run_key"]: r for r in st.rows()}
    out = pack(tmp_path / "s", ["context.kept_spans@hico", "checkpoint"], True)
    assert out["rows"] == 6 and out["dropped"] == 3 + 6
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["results.sqlite.gz"]
    with ResultStore(tmp_path / "s", readonly=True) as st:
        after = st.rows()
    assert len(after) == 6 and all(len(r["run_key"]) == 16 for r in after)
    for r in after:
        old = next(v for k, v in before.items() if k.startswith(r["run_key"]))
        assert (r["git_commit"], r["created_at"], r["score"]) == (old["git_commit"], old["created_at"], 1.0)
        ctx = r["extra"]["context"]
        assert "checkpoint" not in r["extra"] and ctx["kept_fraction"] == 0.5
        assert ("kept_spans" in ctx) == (r["method"] == "tpp")  # only hico's spans went
    pack(tmp_path / "s", [], False)  # a second pack changes no row
    with ResultStore(tmp_path / "s", readonly=True) as st:
        assert st.rows() == after
    raw = gzip.decompress((tmp_path / "s" / "results.sqlite.gz").read_bytes())
    assert raw.startswith(b"SQLite format 3")


def test_pack_refuses_metrics_and_colliding_short_keys(tmp_path, pack):
    with ResultStore(tmp_path / "m") as st:
        st.add_many(_rows()[:1])
        st.add_metrics(st.rows()[0]["run_key"], [{"name": "density", "value": 0.5}])
    with pytest.raises(LonglabError, match="metrics"):
        pack(tmp_path / "m", [], False)
    shutil.rmtree(tmp_path / "m")
    rows = _rows()[:2]
    rows[0]["run_key"], rows[1]["run_key"] = "a" * 16 + "1", "a" * 16 + "2"
    with ResultStore(tmp_path / "c") as st:
        st.add_many(rows)
    with pytest.raises(LonglabError, match="first 16 hex digits"):
        pack(tmp_path / "c", [], True)
    assert (tmp_path / "c" / "results.sqlite").is_file()  # the store it could not pack is left as it was
