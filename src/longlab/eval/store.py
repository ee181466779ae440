"""Results store: one SQLite file (``results.sqlite``) per results directory.

Every evaluated sample is one row of the ``results`` table, identified by ``run_key`` (a hash of the
fields that make the row unique: model, recipe, task, length, sample, mode, seed and config hash).
Writes are transactional and idempotent (``INSERT OR IGNORE`` on ``run_key``), the database runs in
WAL mode with ``synchronous=FULL``, so a process killed mid-run loses at most the row it was writing
and a re-run simply skips ``done_keys()``.

Per-layer / per-head quality numbers (e.g. sparse-prefill density, recall, output error) go to the
``metrics`` table, keyed by ``(run_key, layer, head, name)``; ``head = -1`` means "all heads" and
``layer = -1`` means "all layers".
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import math
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMNS",
    "DB_NAME",
    "METRIC_COLUMNS",
    "RUN_KEY_FIELDS",
    "ResultStore",
    "config_hash",
    "git_commit",
    "make_run_key",
    "package_version",
    "peak_rss_mb",
    "run_key_of",
]

DB_NAME = "results.sqlite"
SCHEMA_VERSION = 1

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

#: Columns of the ``results`` table (besides ``id``), in order, with their SQLite types.
COLUMNS: dict[str, str] = {
    "run_key": "TEXT UNIQUE NOT NULL",
    "model": "TEXT",
    "recipe": "TEXT",
    "method": "TEXT",
    "compression_ratio": "REAL",
    "task": "TEXT",
    "length": "INTEGER",
    "sample_id": "TEXT",
    "depth": "REAL",
    "query_aware": "INTEGER",
    "seed": "INTEGER",
    "prediction": "TEXT",
    "answers": "TEXT",  # JSON list
    "score": "REAL",
    "prefill_s": "REAL",
    "compress_s": "REAL",
    "decode_s": "REAL",
    "kv_bytes_before": "INTEGER",
    "kv_bytes_after": "INTEGER",
    "peak_rss_mb": "REAL",
    "context_tokens": "INTEGER",
    "package_version": "TEXT",
    "git_commit": "TEXT",
    "config_hash": "TEXT",
    "recipe_repr": "TEXT",
    "created_at": "TEXT",
    "extra": "TEXT",  # JSON object
}

#: Columns of the ``metrics`` table (besides ``id``).
METRIC_COLUMNS: dict[str, str] = {
    "run_key": "TEXT NOT NULL",
    "layer": "INTEGER NOT NULL",
    "head": "INTEGER NOT NULL",
    "name": "TEXT NOT NULL",
    "value": "REAL",
}

_JSON_COLUMNS = ("answers", "extra")
_INT_COLUMNS = {c for c, t in COLUMNS.items() if t.startswith("INTEGER")}
_REAL_COLUMNS = {c for c, t in COLUMNS.items() if t.startswith("REAL")}


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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------
# the store


class ResultStore:
    """SQLite-backed store of evaluation results for one results directory.

    >>> with ResultStore("runs/demo") as store:          # doctest: +SKIP
    ...     if not store.has(key):
    ...         store.add({"model": "smollm2-135m", "recipe": "snapkv@0.5", ..., "score": 1.0})
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, timeout: float = 60.0) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / DB_NAME
        self._conn: sqlite3.Connection | None = sqlite3.connect(str(self.path), timeout=timeout)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = FULL")
        self._create_schema()
        self._provenance: dict[str, Any] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def conn(self) -> sqlite3.Connection:
        """The open connection (raises if the store was closed)."""
        if self._conn is None:
            raise RuntimeError(f"ResultStore({self.out_dir}) is closed")
        return self._conn

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else f"{len(self)} rows"
        return f"ResultStore({str(self.out_dir)!r}, {state})"

    def _create_schema(self) -> None:
        cols = ",\n  ".join(f"{name} {typ}" for name, typ in COLUMNS.items())
        mcols = ",\n  ".join(f"{name} {typ}" for name, typ in METRIC_COLUMNS.items())
        with self.conn:
            self.conn.execute(f"CREATE TABLE IF NOT EXISTS results (\n  id INTEGER PRIMARY KEY,\n  {cols}\n)")
            self.conn.execute(
                f"CREATE TABLE IF NOT EXISTS metrics (\n  id INTEGER PRIMARY KEY,\n  {mcols},\n"
                "  UNIQUE (run_key, layer, head, name)\n)"
            )
            # databases written by an older version: add the columns they lack
            have = {r[1] for r in self.conn.execute("PRAGMA table_info(results)")}
            for name, typ in COLUMNS.items():
                if name not in have:
                    try:
                        self.conn.execute(f"ALTER TABLE results ADD COLUMN {name} {typ}")
                    except sqlite3.OperationalError as err:  # added meanwhile by another process
                        if "duplicate column" not in str(err):
                            raise
            self.conn.execute(
                "CREATE INDEX IF NOT EXISTS results_group ON results (model, recipe, task, length)"
            )
            self.conn.execute("CREATE INDEX IF NOT EXISTS metrics_key ON metrics (run_key)")
            self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -- reading -------------------------------------------------------------------------------
    def has(self, run_key: str) -> bool:
        """Whether a row with this ``run_key`` is stored."""
        cur = self.conn.execute("SELECT 1 FROM results WHERE run_key = ? LIMIT 1", (run_key,))
        return cur.fetchone() is not None

    def done_keys(self, **filters: Any) -> set[str]:
        """All stored run keys (optionally only those of rows matching ``filters``)."""
        where, params = _where(filters)
        return {r[0] for r in self.conn.execute(f"SELECT run_key FROM results{where}", params)}

    def rows(self, **filters: Any) -> list[dict[str, Any]]:
        """Stored rows as dicts (JSON columns decoded), in insertion order.

        A filter value that is a list/tuple/set matches any of its members; ``None`` matches NULL.
        """
        where, params = _where(filters)
        cur = self.conn.execute(f"SELECT * FROM results{where} ORDER BY id", params)
        return [_decode(dict(r)) for r in cur]

    def iter_rows(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """Like :meth:`rows`, streaming."""
        where, params = _where(filters)
        for r in self.conn.execute(f"SELECT * FROM results{where} ORDER BY id", params):
            yield _decode(dict(r))

    def metrics(self, **filters: Any) -> list[dict[str, Any]]:
        """Rows of the ``metrics`` table (filter on run_key, layer, head, name)."""
        where, params = _where(filters, allowed=METRIC_COLUMNS)
        cur = self.conn.execute(f"SELECT * FROM metrics{where} ORDER BY id", params)
        return [dict(r) for r in cur]

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` result (``"ok"`` when healthy)."""
        return str(self.conn.execute("PRAGMA integrity_check").fetchone()[0])

    # -- writing -------------------------------------------------------------------------------
    def add(self, row: Mapping[str, Any], metrics: Iterable[Mapping[str, Any]] | None = None) -> bool:
        """Store one row (and optionally its metrics) in one transaction.

        ``run_key`` is computed from the identity fields when absent; keys that are not columns go
        into ``extra``. Returns ``False`` when a row with the same ``run_key`` was already stored
        (nothing is written then, metrics included).
        """
        record = self.prepare(row)
        with self.conn:
            inserted = self._insert(record)
            if inserted and metrics is not None:
                self._insert_metrics(record["run_key"], metrics)
        return inserted

    def add_many(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Store many rows in one transaction; returns how many were new."""
        records = [self.prepare(r) for r in rows]
        with self.conn:
            return sum(self._insert(rec) for rec in records)

    def add_metrics(self, run_key: str, items: Iterable[Mapping[str, Any]]) -> int:
        """Store metric items ``{layer, head, name, value}`` for ``run_key`` in one transaction.

        ``layer``/``head`` may be omitted or ``None`` (stored as -1: all layers / all heads). Existing
        ``(run_key, layer, head, name)`` entries are kept. Returns how many were new.
        """
        with self.conn:
            return self._insert_metrics(run_key, items)

    def prepare(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The column values that :meth:`add` would write for ``row`` (provenance filled in)."""
        if self._provenance is None:
            self._provenance = {"package_version": package_version(), "git_commit": git_commit()}
        rec: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in row.items():
            if key == "id":
                continue
            if key in COLUMNS:
                rec[key] = value
            else:
                extra[key] = value
        if extra:
            base = rec.get("extra") or {}
            if isinstance(base, str):
                base = json.loads(base)
            rec["extra"] = {**base, **extra}
        for key, value in self._provenance.items():
            if rec.get(key) is None:
                rec[key] = value
        if rec.get("created_at") is None:
            rec["created_at"] = _now()
        if not rec.get("run_key"):
            rec["run_key"] = run_key_of(rec)
        for key in _JSON_COLUMNS:
            if rec.get(key) is not None:
                rec[key] = _dumps(rec[key])
        for key in _INT_COLUMNS:
            if rec.get(key) is not None:
                rec[key] = int(rec[key])
        for key in _REAL_COLUMNS:
            if rec.get(key) is not None:
                rec[key] = float(rec[key])
        for key in ("recipe_repr", "sample_id", "prediction"):
            if rec.get(key) is not None and not isinstance(rec[key], str):
                rec[key] = str(rec[key])
        return rec

    def _insert(self, rec: Mapping[str, Any]) -> bool:
        names = list(rec)
        sql = (
            f"INSERT OR IGNORE INTO results ({', '.join(names)}) "
            f"VALUES ({', '.join('?' for _ in names)})"
        )
        return self.conn.execute(sql, [rec[n] for n in names]).rowcount == 1

    def _insert_metrics(self, run_key: str, items: Iterable[Mapping[str, Any]]) -> int:
        params = []
        for it in items:
            layer = it.get("layer")
            head = it.get("head")
            value = it.get("value")
            params.append(
                (
                    run_key,
                    -1 if layer is None else int(layer),
                    -1 if head is None else int(head),
                    str(it["name"]),
                    None if value is None else float(value),
                )
            )
        cur = self.conn.executemany(
            "INSERT OR IGNORE INTO metrics (run_key, layer, head, name, value) VALUES (?, ?, ?, ?, ?)",
            params,
        )
        return max(cur.rowcount, 0)


def _where(filters: Mapping[str, Any], allowed: Mapping[str, str] = COLUMNS) -> tuple[str, list[Any]]:
    """SQL ``WHERE`` clause (and parameters) for equality / membership filters."""
    parts: list[str] = []
    params: list[Any] = []
    for key, value in filters.items():
        if key not in allowed and key != "id":
            raise KeyError(f"unknown column {key!r}; columns: {', '.join(allowed)}")
        if value is None:
            parts.append(f"{key} IS NULL")
        elif isinstance(value, (list, tuple, set, frozenset)):
            values = [int(v) if isinstance(v, bool) else v for v in value]
            if not values:
                parts.append("0")
            else:
                parts.append(f"{key} IN ({', '.join('?' for _ in values)})")
                params.extend(values)
        else:
            parts.append(f"{key} = ?")
            params.append(int(value) if isinstance(value, bool) else value)
    return (" WHERE " + " AND ".join(parts) if parts else ""), params


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    for key in _JSON_COLUMNS:
        if isinstance(row.get(key), str):
            try:
                row[key] = json.loads(row[key])
            except ValueError:
                pass
    for key in _REAL_COLUMNS:
        value = row.get(key)
        if isinstance(value, float) and math.isnan(value):
            row[key] = None
    return row
