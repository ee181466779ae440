"""bench/memory_docs.py's slim copy of HGMem rows keeps what the memory pages report (the plan decisions,
the point count, failed JSON calls and dropped instruction echoes) and drops the per-question dumps."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def slim_extra(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # memory_docs imports its neighbour pack_store
    return runpy.run_path(str(ROOT / "bench" / "memory_docs.py"))["slim_extra"]


def test_slim_extra_keeps_the_reported_trace_fields_and_drops_dumps(slim_extra) -> None:
    extra = {
        "memory": "(empty)",
        "chunks": 7,
        "stored": ["a", "b"],
        "trace": {
            "rounds": [{"decision": "global", "chunks": [4, 0], "subquery": "q"}, {"decision": "stop"}],
            "points": 0,
            "json_failures": 1,
            "instruction_copies": 2,
            "answer_chunks": 0,
        },
    }
    slim = slim_extra(extra)
    assert slim["chunks"] == 7 and "memory" not in slim and "stored" not in slim
    assert slim["trace"] == {
        "rounds": [{"decision": "global"}, {"decision": "stop"}],
        "points": 0,
        "json_failures": 1,
        "instruction_copies": 2,
    }
