"""The shared runner of the ``bench/`` scripts: the machine header every JSON result carries, the timing
of variants side by side (:func:`interleaved`: repeats interleaved with the order rotated per round, wall
and CPU time per call, medians, the load average before and after), ratios of medians to a baseline,
and the JSON writer. Scripts run as ``python bench/<name>.py``, so this module is imported as ``common``
(the script's directory is first on ``sys.path``). A script that times things uses :func:`interleaved`
(or :func:`timed` for one call, ordered by :func:`rotated` when the rounds are samples) rather than its own
loop; :func:`best_of` is kept for the figures that were reported as minima."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "hardware", "timed", "rotated", "interleaved", "ratios", "best_of", "write_json",
           "run_subcommand", "MAX_REPEATS"]

T = TypeVar("T")

MAX_REPEATS = 10_000  # timed calls per variant; a larger request is refused before any work


def run_subcommand(doc: str | None, subcommands: Mapping[str, Callable[[], Any]],
                   argv: list[str] | None = None) -> int:
    """``python bench/<name>.py SUB [ARGS...]``: run ``subcommands[SUB]`` with ``sys.argv`` set to its own
    arguments (so its parser's ``--help`` names it); no or an unknown SUB prints the script's ``doc`` and
    returns 2 (0 for ``-h``/``--help``). Returns the subcommand's int result, else 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in subcommands:
        print(doc)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    sys.argv = [f"{Path(sys.argv[0]).name} {argv[0]}", *argv[1:]]
    rc = subcommands[argv[0]]()
    return rc if isinstance(rc, int) else 0


def hardware() -> dict[str, Any]:
    """What produced a figure: CPU (model, family/model numbers, the vector extensions and the capability
    ATen's kernels run at: "AMD EPYC" alone names several generations), cores, torch threads, load
    average, git commit, date."""
    cpu = platform.processor() or platform.machine()
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, value = ln.partition(":")
                if not key.strip():
                    break  # the first processor's block only
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name", cpu)
    simd = [x for x in info.get("flags", "").split() if x in ("avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                              "avx512_vnni", "avx_vnni", "amx_tile")]
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
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "cpu_simd": simd,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_avg_1m": load_average(),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """One call of ``fn``: (wall seconds, CPU seconds of this process, all threads), result)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return wall, cpu, out


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` in round ``r``'s order: rotated left by ``r`` (modulo their count), as :func:`interleaved`
    orders its rounds; a benchmark whose rounds are samples (one call per variant) orders each with it."""
    items = list(items)
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Time every variant ``repeats`` times side by side: round ``r`` calls the variants in their order
    rotated by ``r`` (so a drift of the machine's load or clock falls on all of them alike), after
    ``warmup`` untimed rounds. Returns ``{"variants": {name: {"median_s", "min_s", "max_s",
    "cpu_median_s", "wall_s": [...], "cpu_s": [...]}}, "repeats", "warmup", "load_before",
    "load_after"}``; the last call's result of each variant is in ``"results"`` (not JSON: pop it)."""
    names = list(variants)
    if not names:
        raise ValueError("interleaved: no variants to time")
    if not 1 <= repeats <= MAX_REPEATS or not 0 <= warmup <= MAX_REPEATS:
        raise ValueError(f"interleaved: repeats must be in [1, {MAX_REPEATS}] and warmup in "
                         f"[0, {MAX_REPEATS}], got {repeats} and {warmup}")
    results: dict[str, Any] = {}
    for _ in range(warmup):
        for name in names:
            results[name] = variants[name]()
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    load_before = load_average()
    for r in range(repeats):
        for name in rotated(names, r):
            wall, cpu, results[name] = timed(variants[name])
            walls[name].append(wall)
            cpus[name].append(cpu)
    stats = {
        n: {"median_s": statistics.median(walls[n]), "min_s": min(walls[n]), "max_s": max(walls[n]),
            "cpu_median_s": statistics.median(cpus[n]), "wall_s": walls[n], "cpu_s": cpus[n]}
        for n in names
    }
    return {"variants": stats, "repeats": repeats, "warmup": warmup, "load_before": load_before,
            "load_after": load_average(), "results": results}


def ratios(timing: dict[str, Any], base: str) -> dict[str, float]:
    """Each variant's median wall time over ``base``'s, from one :func:`interleaved` run (the same rounds)."""
    variants = timing["variants"]
    if base not in variants:
        raise ValueError(f"ratios: no variant {base!r}; have {', '.join(variants)}")
    ref = variants[base]["median_s"]
    return {n: (v["median_s"] / ref if ref > 0 else math.nan) for n, v in variants.items()}


def best_of(fn: Callable[[], Any], repeats: int, warmup: bool = False) -> tuple[float, Any]:
    """Smallest wall time of ``repeats`` calls (after one untimed call when ``warmup``), and the last
    call's result."""
    out = fn() if warmup else None
    best = math.inf
    for _ in range(max(1, repeats)):
        wall, _cpu, out = timed(fn)
        best = min(best, wall)
    return best, out


def write_json(path: str | Path, result: Any) -> Path:
    """Write ``result`` as compact JSON (bench/results is held to a size budget), creating the parent
    directory, through a temporary file renamed into place (an interrupted write leaves the old file);
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, separators=(",", ":")) + "\n"  # serialise first: a failure writes nothing
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ours: a name no user file carries
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # only the temporary file this call created
        raise
    return path


def read_store(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and whole-model metrics (``layer = head = -1``: ``{run_key, name, value}``) of a ``longlab eval``
    store given as a results directory, its ``results.sqlite`` or the committed ``results.sqlite.gz``:
    :func:`longlab.eval.rows.load_rows` / :func:`~longlab.eval.rows.load_metrics` (read-only, checked)."""
    from longlab.eval.rows import load_metrics, load_rows

    path = Path(path)
    out_dir = path.parent if path.name in ("results.sqlite", "results.sqlite.gz") else path
    metrics = load_metrics(out_dir, what=str(path))
    return load_rows(out_dir, what=str(path)), [
        {"run_key": key, "name": name, "value": value} for key, named in metrics.items()
        for name, value in named.items()]
