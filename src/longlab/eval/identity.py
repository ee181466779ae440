"""The identity of a result row and the provenance recorded with it: ``run_key`` (the hash of the fields
that make a row unique, :data:`RUN_KEY_FIELDS`), the configuration hash, the git commit, the package
version and the peak memory of the process. :mod:`longlab.eval.store` stores rows under these keys."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "RUN_KEY_FIELDS",
    "config_hash",
    "git_commit",
    "make_run_key",
    "package_version",
    "peak_rss_mb",
    "run_key_of",
]

#: Fields whose values identify a result row; ``run_key`` is their hash.
RUN_KEY_FIELDS: tuple[str, ...] = (
    "model",
    "recipe",
    "task",
    "length",
    "sample_id",
    "query_aware",
    "seed",
    "config_hash",
)


# --------------------------------------------------------------------------------------------------
# hashing and provenance helpers


def _canonical(obj: Any) -> Any:
    """Turn ``obj`` into plain JSON data whose serialisation does not depend on memory addresses."""
    if obj is None or isinstance(obj, (str, int, float)):
        if isinstance(obj, bool):
            return int(obj)
        if isinstance(obj, float) and obj.is_integer():
            return int(obj)
        return obj
    if isinstance(obj, enum.Enum):
        return _canonical(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__type__": type(obj).__qualname__, **fields}
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return _canonical(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist") and callable(obj.tolist):  # small arrays
        return _canonical(obj.tolist())
    return str(obj)


def _dumps(obj: Any) -> str:
    return json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def make_run_key(**identity: Any) -> str:
    """Stable sha256 hex digest of the identity fields (sorted JSON).

    ``None`` values are dropped and booleans count as integers, so ``query_aware=True`` and
    ``query_aware=1`` give the same key, and so do a missing field and one set to ``None``.
    ``sample_id`` is compared as text (it is stored as TEXT), so ``3`` and ``"3"`` agree.
    """
    clean = {k: v for k, v in identity.items() if v is not None}
    if "sample_id" in clean:
        clean["sample_id"] = str(clean["sample_id"])
    return hashlib.sha256(_dumps(clean).encode("utf-8")).hexdigest()


def run_key_of(row: Mapping[str, Any]) -> str:
    """The ``run_key`` a row gets from its identity fields (``RUN_KEY_FIELDS``)."""
    return make_run_key(**{k: row.get(k) for k in RUN_KEY_FIELDS})


def config_hash(obj: Any) -> str:
    """Short (16 hex) sha256 of a configuration (dicts, dataclasses, lists, scalars)."""
    return hashlib.sha256(_dumps(obj).encode("utf-8")).hexdigest()[:16]


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """Short commit hash of the git repository at ``cwd`` (default: current dir), or ``None``."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.fspath(cwd) if cwd is not None else None,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out else None


def package_version() -> str:
    """Installed version of ``longlab`` (``importlib.metadata``), or ``"0+unknown"``."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return "0+unknown"
    try:
        return version("longlab")
    except PackageNotFoundError:
        return "0+unknown"


def peak_rss_mb() -> float | None:
    """Peak resident set size of this process in MiB (``None`` where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # bytes on macOS, KiB on Linux
        return peak / (1024.0 * 1024.0)
    return peak / 1024.0


def now_utc() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
