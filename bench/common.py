"""Helpers shared by the ``bench/`` scripts: the machine header every JSON result carries, best-of-n
timing, and the JSON writer. Scripts run as ``python bench/<name>.py``, so this module is imported
as ``common`` (the script's directory is first on ``sys.path``)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "hardware", "best_of", "write_json"]


def hardware() -> dict[str, Any]:
    """What produced a figure: CPU, cores, torch threads, load average, git commit, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=ROOT
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def best_of(fn: Callable[[], Any], repeats: int, warmup: bool = False) -> tuple[float, Any]:
    """Smallest wall time of ``repeats`` calls (after one untimed call when ``warmup``), and the last
    call's result."""
    out = fn() if warmup else None
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def write_json(path: str | Path, result: Any) -> Path:
    """Write ``result`` as indented JSON, creating the parent directory; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
