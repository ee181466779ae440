"""Results store: one SQLite file (``results.sqlite``) per results directory.

Every evaluated sample is one row of the ``results`` table, identified by ``run_key`` (a hash of the
fields that make the row unique: model, recipe, task, length, sample, mode, seed and config hash).
Writes are transactional and idempotent (``INSERT OR IGNORE`` on ``run_key``), the database runs in
WAL mode with ``synchronous=FULL``, so a process killed mid-run loses at most the row it was writing
and a re-run simply skips ``done_keys()``.

Per-layer / per-head quality numbers (e.g. sparse-prefill density, recall, output error) go to the
``metrics`` table, keyed by ``(run_key, layer, head, name)``; ``head = -1`` means "all heads" and
``layer = -1`` means "all layers".

Opening checks the directory and the database before anything is written (``PRAGMA quick_check``
reads every page once): any fault of either is a :class:`~longlab.recipe.LonglabError` naming the
argument. ``ResultStore(dir, readonly=True)`` reads a database it may not write (SQLite ``mode=ro``).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..recipe import LonglabError
from .identity import (
    _dumps,
    git_commit,
    now_utc,
    package_version,
    run_key_of,
)

__all__ = [
    "COLUMNS",
    "DB_NAME",
    "METRIC_COLUMNS",
    "ResultStore",
    "check_results_dir",
]

DB_NAME = "results.sqlite"
SCHEMA_VERSION = 1


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
# the store


class ResultStore:
    """SQLite-backed store of evaluation results for one results directory.

    >>> with ResultStore("runs/demo") as store:          # doctest: +SKIP
    ...     if not store.has(key):
    ...         store.add({"model": "smollm2-135m", "recipe": "snapkv@0.5", ..., "score": 1.0})
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        timeout: float = 60.0,
        readonly: bool = False,
        what: str = "--out",
    ) -> None:
        """Open (for writing: create) ``out_dir/results.sqlite``.

        ``readonly``: open an existing database with SQLite's ``mode=ro`` (nothing is created or
        changed, so a read-only file or directory is fine). ``what`` names the argument the directory
        came from in error messages. Every fault of the directory or the database (a file where the
        directory should be, a directory or a corrupt/foreign file where the database should be, no
        write permission, a lock held too long) raises a :class:`~longlab.recipe.LonglabError` that
        says which, before anything is written.
        """
        self.what = what
        self.readonly = bool(readonly)
        self._conn: sqlite3.Connection | None = None
        self._provenance: dict[str, Any] | None = None
        self._tables: set[str] = set()
        self.out_dir, self.path, created = _results_dir(out_dir, what, create=not self.readonly)
        self._unpacked: tempfile.TemporaryDirectory | None = None  # a read copy of results.sqlite.gz
        packed = Path(f"{self.path}.gz")
        if not self.path.exists() and packed.is_file():
            if not self.readonly:
                raise LonglabError(
                    f"{what}: {self.out_dir} holds a compressed results store ({packed.name}); "
                    f"`gunzip -k {packed}` to add rows to it, or choose another directory"
                )
            self._unpacked = tempfile.TemporaryDirectory(prefix="longlab-store-")
            try:
                self.path = _gunzip(packed, Path(self._unpacked.name) / DB_NAME, what)
            except LonglabError:
                self._unpacked.cleanup()
                raise
        sidecars = [p for p in _sidecars(self.path) if not p.exists()]  # -wal/-shm this open may make
        new_db = not self.path.exists()  # made by this open: removed again if the open fails
        if new_db and len(sidecars) < 2 and not self.readonly:  # SQLite would adopt (or clobber) them
            orphan = next(p for p in _sidecars(self.path) if p not in sidecars)
            raise LonglabError(
                f"{what}: {orphan} exists without its database {self.path.name}: not longlab's (or a damaged "
                "store); longlab never replaces it: move it away or choose another directory"
            )
        try:
            if self.readonly:
                self._conn = _connect_readonly(self.path, timeout)
            else:
                self._conn = sqlite3.connect(str(self.path), timeout=timeout)
                self._conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            self._conn.row_factory = sqlite3.Row
            self._check_readable()
            self._tables = self._table_names()
            if "results" not in self._tables and (self.readonly or self._tables):  # never touch another's
                raise LonglabError(
                    f"{what}: {self.path} is an SQLite database but not a longlab results database "
                    "(it has no results table); move it away or choose another directory"
                )
            if not self.readonly:
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = FULL")
                self._create_schema()
                self._tables = self._table_names()
        except (sqlite3.Error, OSError, LonglabError) as err:
            self.close()
            _remove_sidecars(sidecars)  # SQLite leaves them behind when the open fails
            if created:  # leave no empty directory (or half-made database) behind
                _remove_new(self.path, self.out_dir)
            elif new_db:  # the directory was the user's: remove only the files this open made
                for p in (self.path, *sidecars):
                    p.unlink(missing_ok=True)
            if isinstance(err, LonglabError):
                raise
            raise _fault(err, self.path, what, self.readonly) from None

    def _table_names(self) -> set[str]:
        return {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def _check_readable(self) -> None:
        """``PRAGMA quick_check`` (reads every page once): a corrupt or truncated file fails here."""
        found = [str(r[0]) for r in self.conn.execute("PRAGMA quick_check(3)")]
        if found != ["ok"]:
            lines = [ln.strip() for f in found for ln in f.splitlines() if ln.strip() and "***" not in ln]
            detail = "; ".join(lines)
            detail = detail if len(detail) <= 160 else detail[:157] + "..."
            raise sqlite3.DatabaseError(f"database disk image is malformed ({detail})")

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
        if getattr(self, "_unpacked", None) is not None:
            self._unpacked.cleanup()  # the read copy longlab made
            self._unpacked = None

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
        if "metrics" not in self._tables:  # a database written before metrics existed, read-only
            return []
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
        try:
            with self.conn:
                inserted = self._insert(record)
                if inserted and metrics is not None:
                    self._insert_metrics(record["run_key"], metrics)
        except sqlite3.Error as err:  # the transaction rolled back: rows stored so far are kept
            raise self._write_fault(err) from None
        return inserted

    def _write_fault(self, err: sqlite3.Error) -> LonglabError:
        text = str(err)
        if "full" in text or "disk I/O" in text:
            return LonglabError(
                f"{self.what}: cannot write {self.path}: the disk is full (SQLite: {text}); the rows stored "
                "so far are kept — free some space and run the same command again to resume"
            )
        return _fault(err, self.path, self.what, self.readonly)

    def add_many(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Store many rows in one transaction; returns how many were new."""
        records = [self.prepare(r) for r in rows]
        try:
            with self.conn:
                return sum(self._insert(rec) for rec in records)
        except sqlite3.Error as err:
            raise self._write_fault(err) from None

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
            rec["created_at"] = now_utc()
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


# --------------------------------------------------------------------------------------------------
# opening a results directory


def _results_dir(
    out_dir: Any, what: str, *, create: bool, must_exist: bool = True
) -> tuple[Path, Path, bool]:
    """``(directory, database path, whether the directory was created here)``, or a LonglabError
    naming ``what`` when the path cannot be a results directory."""
    if isinstance(out_dir, bytes) or not isinstance(out_dir, (str, os.PathLike)):
        raise LonglabError(f"{what}: expected a directory path, got {type(out_dir).__name__}")
    if not os.fspath(out_dir).strip():
        raise LonglabError(f"{what}: empty path; give a results directory (it is created when missing)")
    out = Path(out_dir)
    path = out / DB_NAME
    created = False
    if out.exists() and not out.is_dir():
        raise LonglabError(f"{what}: {out} is a file, not a directory; give a results directory")
    if not out.exists():
        if not create:
            if not must_exist:
                return out, path, False
            raise LonglabError(f"{what}: results directory not found: {out}")
        try:
            out.mkdir(parents=True)
            created = True
        except FileExistsError:  # made meanwhile by another process, or a parent is a file
            if not out.is_dir():
                raise LonglabError(f"{what}: cannot create directory {out}: a parent is a file") from None
        except NotADirectoryError:
            raise LonglabError(f"{what}: cannot create directory {out}: a parent is a file") from None
        except OSError as err:
            raise LonglabError(f"{what}: cannot create directory {out}: {err.strerror or err}") from None
    if path.exists() and not path.is_file():
        raise LonglabError(
            f"{what}: {path} is not a file (a directory?), so it cannot be the results database; "
            "move it away or choose another directory"
        )
    if not path.exists() and not create and must_exist and not Path(f"{path}.gz").is_file():
        raise LonglabError(f"{what}: no results database in {out} (expected {path})")
    return out, path, created


MAX_UNPACKED_BYTES = 1 << 30  # a committed results store, decompressed for reading


def _gunzip(packed: Path, dest: Path, what: str) -> Path:
    """``packed`` (gzip) decompressed into ``dest``, at most :data:`MAX_UNPACKED_BYTES`; a damaged or
    oversized file is a LonglabError naming it."""
    import gzip

    try:
        with gzip.open(packed, "rb") as src, open(dest, "wb") as out:
            copied = 0
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > MAX_UNPACKED_BYTES:
                    raise LonglabError(f"{what}: {packed} unpacks to more than {MAX_UNPACKED_BYTES:,} bytes")
                out.write(chunk)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise LonglabError(f"{what}: {packed} is not a readable gzip file ({err})") from None
    return dest


def check_results_dir(out_dir: Any, what: str = "--out") -> None:
    """Check, creating and changing nothing, that ``out_dir`` can take results: it is a directory (or
    can be made as one), its ``results.sqlite`` (when present) is a readable longlab database, and
    it can be written. Raises a :class:`~longlab.recipe.LonglabError` naming ``what``; call it before
    loading a model so a bad ``--out`` fails in a second."""
    out, path, _ = _results_dir(out_dir, what, create=False, must_exist=False)
    if path.is_file() and path.stat().st_size > 0:
        ResultStore(out, readonly=True, what=what).close()
    probe_dir = out
    while not probe_dir.exists():  # the nearest ancestor that exists must be a writable directory
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise LonglabError(f"{what}: cannot create directory {out}: {probe_dir} is a file")
    try:
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".longlab-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise LonglabError(
            f"{what}: cannot write in {probe_dir}: {err.strerror or err}; choose a writable directory"
        ) from None


def _sidecars(path: Path) -> tuple[Path, Path]:
    return Path(f"{path}-wal"), Path(f"{path}-shm")


def _remove_sidecars(paths: Iterable[Path]) -> None:
    """Remove ``-wal``/``-shm`` files a failed open created (only while the ``-wal`` holds nothing)."""
    paths = list(paths)
    wal = [p for p in paths if p.name.endswith("-wal")]
    if any(p.is_file() and p.stat().st_size > 0 for p in wal):
        return
    for p in paths:
        try:
            p.unlink()
        except OSError:
            pass


def _connect_readonly(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection that cannot change the database.

    Where the file and its directory are writable: an ordinary connection with ``query_only`` (so the
    last reader to close removes SQLite's ``-wal``/``-shm`` files as usual). Otherwise SQLite's
    ``mode=ro``; a WAL database in a directory we cannot write (no ``-shm`` file can be made) is opened
    ``immutable`` instead, which is then safe: nobody can be writing it."""
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    attempts: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        (uri, {"uri": True}, ()),
        (uri + "&immutable=1", {"uri": True}, ()),
    ]
    if os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
        pragmas = (f"PRAGMA busy_timeout = {int(timeout * 1000)}", "PRAGMA query_only = ON")
        attempts.insert(0, (str(path), {}, pragmas))
    for i, (target, kwargs, pragmas) in enumerate(attempts):
        conn = sqlite3.connect(target, timeout=timeout, **kwargs)
        try:
            for pragma in pragmas:
                conn.execute(pragma)
            conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
            return conn
        except sqlite3.Error as err:
            conn.close()
            cannot_write = "readonly" in str(err) or "unable to open" in str(err)
            if not isinstance(err, sqlite3.OperationalError) or not cannot_write or i == len(attempts) - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _fault(err: BaseException, path: Path, what: str, readonly: bool) -> LonglabError:
    """A LonglabError naming ``what`` for an error SQLite (or the OS) raised on ``path``."""
    text = str(err)
    corrupt = isinstance(err, sqlite3.DatabaseError) and not isinstance(err, sqlite3.OperationalError)
    if corrupt or any(m in text for m in ("not a database", "malformed", "corrupt")):
        return LonglabError(
            f"{what}: {path} is not a readable SQLite database (SQLite: {text}); it is corrupt, truncated or "
            "another kind of file: move it away or choose another directory"
        )
    if "locked" in text or "busy" in text:
        return LonglabError(f"{what}: {path} is locked by another process (SQLite: {text}); try again later")
    denied = isinstance(err, PermissionError) or "unable to open" in text
    if denied or "readonly" in text or "read-only" in text:
        if readonly:
            return LonglabError(f"{what}: cannot read {path} (SQLite: {text})")
        return LonglabError(
            f"{what}: cannot write {path}: the directory or the database is read-only (SQLite: {text}); "
            "choose a writable directory (longlab report can still read this one)"
        )
    return LonglabError(f"{what}: cannot open {path} ({type(err).__name__}: {text})")


def _remove_new(path: Path, out_dir: Path) -> None:
    """Remove what opening a store created (an empty database and the directory), ignoring failures."""
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            if p.is_file() and p.stat().st_size == 0:
                p.unlink()
        except OSError:
            pass
    try:
        out_dir.rmdir()  # only when empty
    except OSError:
        pass


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
