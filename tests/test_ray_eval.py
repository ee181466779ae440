"""``longlab eval --backend ray --workers 2`` on a real local Ray cluster (loopback, tiny model): the CLI
sweep writes the same rows as the serial backend, from two worker processes. Marked ``ray`` (CI runs it:
``.ci/run``); skipped when Ray is not installed. The missing-extra path is tested in tests/test_runner.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from longlab.cli import main as cli_main
from longlab.eval.store import ResultStore


def _rows(out: Path) -> tuple[dict[str, tuple], list[dict]]:
    with ResultStore(out) as store:
        rows = store.rows()
    fields = ("recipe", "task", "sample_id", "prediction", "score")
    return {r["run_key"]: tuple(r[f] for f in fields) for r in rows}, [r["extra"] for r in rows]


@pytest.mark.ray
def test_cli_ray_sweep_on_two_workers_equals_serial(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    argv = ["eval", "--model", "tiny-llama", "--recipes", "full,snapkv@0.5,streaming@0.5", "--tasks",
            "niah_single_1,passkey", "--lengths", "512", "--samples", "2", "--max-new-tokens", "6",
            "--no-report", "--no-progress"]
    assert cli_main([*argv, "--out", str(tmp_path / "serial")]) == 0
    assert cli_main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    serial, _ = _rows(tmp_path / "serial")
    ray_rows, extras = _rows(tmp_path / "ray")
    assert len(serial) == 12 and ray_rows == serial  # 2 tasks x 2 samples x 3 recipes, the same rows
    assert {e["backend"] for e in extras} == {"ray"}
    assert len({e["worker_pid"] for e in extras}) == 2  # both workers evaluated samples
    # a re-run on the same --out finds every row done and starts no worker
    assert cli_main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    assert _rows(tmp_path / "ray")[0] == serial
