"""``bench/kv.py eviction-pairs`` (the kv-eviction page's pairs.json) on a hand-made store: a method that
loses every sample to its baseline comes out negative with its sign test, and swapping them flips it."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("niah_single_1", "niah_multikey_1", "vt")


def _store(path: Path, better: str, worse: str) -> None:
    """A longlab results store: ``better`` scores 1 and ``worse`` 0 on 4 samples of each task."""
    from longlab.eval.store import ResultStore

    with ResultStore(path) as store:
        store.add_many([{"model": "m", "recipe": r, "method": r.split("@")[0], "task": t, "length": 2048,
                         "sample_id": f"{t}-{i}", "score": 1.0 if r == better else 0.0}
                        for r in (better, worse) for t in TASKS for i in range(4)])


@pytest.mark.parametrize(("better", "worse", "sign"), [("snapkv@0.5", "restkv@0.5", -1),
                                                        ("restkv@0.5", "snapkv@0.5", 1)])
def test_eviction_pairs_direction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  better: str, worse: str, sign: int) -> None:
    db, out = tmp_path / "store", tmp_path / "pairs.json"
    _store(db, better, worse)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "argv", ["kv.py"])
    kv = runpy.run_path(str(ROOT / "bench" / "kv.py"))
    kv["eviction_pairs_main"](str(db), str(out))
    data = json.loads(out.read_text())
    (d,) = [x for x in data["differences"] if (x["baseline"], x["method"]) == ("snapkv@0.5", "restkv@0.5")]
    assert d["n"] == 12 and sign * d["diff"][0] == pytest.approx(100.0)
    assert (d["better"], d["worse"]) == ((12, 0) if sign > 0 else (0, 12))
    assert d["sign_test_p"] == pytest.approx(2 / 2**12)
