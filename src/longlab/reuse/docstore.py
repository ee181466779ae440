"""A content-addressed store of per-document KV caches: safetensors files plus an SQLite index.

Layout of a store directory::

    index.sqlite                      one row per document entry (WAL mode, synchronous=FULL)
    objects/<id[:2]>/<id>.<sha>.safetensors   pre-RoPE keys k.<l>, values v.<l>, token ids; metadata

An entry's id is the hash of (model fingerprint, tokenizer fingerprint, prefix token ids, text): the same
text for the same model is stored once. The index row records model name and fingerprint, tokenizer
fingerprint, text hash, token count, dtype, bytes on disk, the file's BLAKE2 digest, created and last-used
times, and the text itself (so a bad entry can be recomputed). Never pickle: tensors go through safetensors.

Safety:
- a file is written to a temporary name in ``objects/``, fsynced, then, inside an ``IMMEDIATE`` SQLite
  transaction (one writer at a time across processes), renamed to its unique final name and indexed; a
  crash leaves at most an orphan file that :meth:`DocStore.gc` removes;
- every read checks the file's digest, metadata (model, tokenizer, dtype, token count, layers) and tensor
  shapes against the index: a corrupt, truncated or mismatched file is never used — :meth:`DocStore.fetch`
  recomputes it, :meth:`DocStore.get` without a model raises a :class:`~longlab.recipe.LonglabError`;
- ``max_bytes`` bounds the files' total size: the least recently used entries are evicted after a write.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..recipe import LonglabError, LonglabTypeError, shorten
from .modelio import DocKV, encode_document, model_fingerprint, tokenizer_fingerprint

__all__ = ["DocStore", "DocEntry", "MemoryStore", "doc_id_for", "FORMAT"]

FORMAT = "longlab-dockv-1"
INDEX = "index.sqlite"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COLUMNS = (
    "doc_id",
    "model_name",
    "model_hash",
    "tokenizer_hash",
    "text_sha",
    "prefix_sha",
    "n_tokens",
    "start",
    "layers",
    "dtype",
    "nbytes",
    "file_digest",
    "path",
    "created_at",
    "last_used",
    "text",
)


@dataclass
class DocEntry:
    """One index row (see the module docstring)."""

    doc_id: str
    model_name: str
    model_hash: str
    tokenizer_hash: str
    text_sha: str
    prefix_sha: str
    n_tokens: int
    start: int
    layers: int
    dtype: str
    nbytes: int
    file_digest: str
    path: str
    created_at: float
    last_used: float
    text: str


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _ids_sha(ids: list[int] | tuple) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def doc_id_for(model_hash: str, tokenizer_hash: str, text: str, prefix_ids: list[int] | tuple = ()) -> str:
    """The content address of ``text`` encoded by one model (and tokenizer) after ``prefix_ids``."""
    return hashlib.sha256(
        "\x1f".join((FORMAT, model_hash, tokenizer_hash, _ids_sha(prefix_ids), _sha(text))).encode()
    ).hexdigest()[:32]


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise LonglabError(f"store dtype must be one of {', '.join(_DTYPES)}, got {dtype}")


class _Fault(Exception):
    """An entry that must not be used (message says why)."""


class MemoryStore:
    """The same interface without a disk: documents are encoded on each fetch (and kept for this object's
    lifetime). ``generate(docs=...)`` without a store uses one."""

    def __init__(self) -> None:
        self._docs: dict[str, DocKV] = {}
        self.stats = {"hits": 0, "misses": 0, "recomputed": 0}

    def fetch(self, model: Any, tokenizer: Any, text: str, token_ids: list[int], prefix_ids=()) -> DocKV:
        key = doc_id_for(model_fingerprint(model), tokenizer_fingerprint(tokenizer), text, prefix_ids)
        if key not in self._docs:
            self.stats["misses"] += 1
            self._docs[key] = encode_document(model, token_ids, prefix_ids)
        else:
            self.stats["hits"] += 1
        return self._docs[key]


class DocStore:
    """Per-document KV store in directory ``root`` (created when missing).

    ``max_bytes``: bound on the entries' files (LRU eviction after each write; ``None``: unbounded).
    ``dtype``: storage dtype of new entries (``float32`` keeps reuse exact; ``bfloat16`` halves the bytes).
    ``readonly``: open an existing store for reading (``list``, ``get``); nothing is written, not even
    last-used times."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        dtype: str = "float32",
        readonly: bool = False,
        timeout: float = 60.0,
    ) -> None:
        if isinstance(root, bytes) or not isinstance(root, (str, os.PathLike)) or not os.fspath(root).strip():
            raise LonglabError(f"store: expected a directory path, got {shorten(root)}")
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise LonglabError(f"store: max_bytes must be an integer >= 0 or None, got {shorten(max_bytes)}")
        if dtype not in _DTYPES:
            raise LonglabError(f"store: dtype must be one of {', '.join(_DTYPES)}, got {shorten(dtype)}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.readonly = readonly
        self.stats = {"hits": 0, "misses": 0, "recomputed": 0, "evicted": 0}
        self.objects = self.root / "objects"
        self._conn: sqlite3.Connection | None = None
        created = []
        try:
            if readonly:
                if not (self.root / INDEX).is_file():
                    raise LonglabError(f"store: no document store at {self.root} (no {INDEX})")
                uri = "file:" + str((self.root / INDEX).resolve()) + "?mode=ro"
                self._conn = sqlite3.connect(uri, uri=True, timeout=timeout)
                try:
                    self._conn.execute("SELECT COUNT(*) FROM docs").fetchone()
                except sqlite3.OperationalError:  # read-only media: WAL's shared memory cannot be made
                    self._conn.close()
                    self._conn = sqlite3.connect(uri + "&immutable=1", uri=True, timeout=timeout)
            else:
                if self.root.exists() and not self.root.is_dir():
                    raise LonglabError(f"store: {self.root} is a file, not a directory")
                missing = [d for d in (*reversed(self.objects.parents), self.objects) if not d.exists()]
                for d in missing:
                    d.mkdir()
                    created.append(d)
                probe = tempfile.NamedTemporaryFile(dir=self.objects, prefix=".probe-", delete=True)
                probe.close()
                self._conn = sqlite3.connect(str(self.root / INDEX), timeout=timeout, isolation_level=None)
                self._conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = FULL")
                cols = ", ".join(
                    f"{c} {'TEXT PRIMARY KEY' if c == 'doc_id' else ''}".strip() for c in _COLUMNS
                )
                self._conn.execute(f"CREATE TABLE IF NOT EXISTS docs ({cols})")
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("SELECT COUNT(*) FROM docs").fetchone()
        except LonglabError:
            self._cleanup(created)
            raise
        except (sqlite3.Error, OSError) as err:
            self._cleanup(created)
            text = getattr(err, "strerror", None) or str(err)
            if isinstance(err, PermissionError) or "readonly" in str(err) or "unable to open" in str(err):
                raise LonglabError(
                    f"store: cannot write in {self.root} ({text}); it is read-only: choose a writable "
                    "directory (or open it with readonly=True to list it)"
                ) from None
            raise LonglabError(
                f"store: cannot open {self.root / INDEX} ({type(err).__name__}: {text})"
            ) from None

    def _cleanup(self, created: list[Path]) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for d in reversed(created):
            try:
                for f in (INDEX, INDEX + "-wal", INDEX + "-shm"):
                    (d / f).unlink(missing_ok=True)
                d.rmdir()
            except OSError:
                pass

    # ------------------------------------------------------------------------------------ lifecycle
    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LonglabError(f"store {self.root} is closed")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> DocStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0])

    def __contains__(self, doc_id: str) -> bool:
        return self._row(doc_id) is not None

    def total_bytes(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM docs").fetchone()[0])

    def entries(self) -> list[DocEntry]:
        """Every entry, most recently used first."""
        rows = self.conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM docs ORDER BY last_used DESC").fetchall()
        return [DocEntry(**dict(r)) for r in rows]

    def _row(self, doc_id: str) -> DocEntry | None:
        if not isinstance(doc_id, str):
            raise LonglabTypeError(f"doc_id must be a string, got {shorten(doc_id)}")
        row = self.conn.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM docs WHERE doc_id = ?", (doc_id,)
        ).fetchone()
        return DocEntry(**dict(row)) if row else None

    def _check_writable(self) -> None:
        if self.readonly:
            raise LonglabError(f"store {self.root} was opened read-only; it cannot be written")

    # ------------------------------------------------------------------------------------ writing
    def put(self, model: Any, tokenizer: Any, text: str, *, prefix_ids: list[int] | tuple = ()) -> str:
        """Encode ``text`` alone (after ``prefix_ids``) with ``model`` and store it; return its id. An entry
        already present and valid is kept (only its last-used time changes)."""
        if not isinstance(text, str) or not text.strip():
            raise LonglabError(f"store: a document must be a non-empty string, got {shorten(text)}")
        self._check_writable()
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        doc_id = doc_id_for(model_fingerprint(model), tokenizer_fingerprint(tokenizer), text, prefix_ids)
        row = self._row(doc_id)
        if row is not None:
            try:
                self._load(row, model, tokenizer)
                self._touch(doc_id)
                return doc_id
            except _Fault:
                self.stats["recomputed"] += 1
        self._write(model, tokenizer, text, ids, prefix_ids, encode_document(model, ids, prefix_ids))
        return doc_id

    def fetch(self, model: Any, tokenizer: Any, text: str, token_ids: list[int], prefix_ids=()) -> DocKV:
        """The stored KV of ``text`` for ``model``: read and checked, or (missing, corrupt, mismatched)
        encoded now and stored. ``token_ids`` must be ``text``'s tokens."""
        doc_id = doc_id_for(model_fingerprint(model), tokenizer_fingerprint(tokenizer), text, prefix_ids)
        row = self._row(doc_id)
        if row is not None:
            try:
                doc = self._load(row, model, tokenizer)
                if doc.token_ids.tolist() != list(token_ids):
                    raise _Fault("token ids differ from the text's")
                self.stats["hits"] += 1
                if not self.readonly:
                    self._touch(doc_id)
                return doc
            except _Fault:
                self.stats["recomputed"] += 1
        else:
            self.stats["misses"] += 1
        doc = encode_document(model, token_ids, prefix_ids)
        if not self.readonly:
            self._write(model, tokenizer, text, list(token_ids), prefix_ids, doc)
        return doc

    def _write(self, model: Any, tokenizer: Any, text: str, ids: list[int], prefix_ids, doc: DocKV) -> str:
        from ..safeio import new_file_mode, save_tensors

        self._check_writable()
        model_hash, tok_hash = model_fingerprint(model), tokenizer_fingerprint(tokenizer)
        doc_id = doc_id_for(model_hash, tok_hash, text, prefix_ids)
        dt = _DTYPES[self.dtype]
        tensors = {"ids": doc.token_ids.to(torch.int64).contiguous()}
        for i, (k, v) in enumerate(zip(doc.keys, doc.values)):
            tensors[f"k.{i}"] = k.to(dt).contiguous()
            tensors[f"v.{i}"] = v.to(dt).contiguous()
        meta = {
            "format": FORMAT,
            "doc_id": doc_id,
            "model_hash": model_hash,
            "tokenizer_hash": tok_hash,
            "text_sha": _sha(text),
            "prefix_sha": _ids_sha(prefix_ids),
            "n_tokens": str(doc.n_tokens),
            "start": str(doc.start),
            "layers": str(len(doc.keys)),
            "dtype": self.dtype,
        }
        folder = self.objects / doc_id[:2]
        tmp: Path | None = None
        final: Path | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=folder, prefix=f".{doc_id}-{os.getpid()}-", suffix=".tmp")
            tmp = Path(name)  # ours from here: removed below on any failure
            try:
                os.fchmod(fd, new_file_mode())  # an object reads like the store's other files, not 0o600
            finally:
                os.close(fd)
            try:
                save_tensors(tensors, str(tmp), metadata=meta)
            except Exception as exc:  # safetensors reports a full disk as its own error type
                if isinstance(exc, OSError):
                    raise
                full = "28" in str(exc) or "space" in str(exc).lower()
                raise OSError(28 if full else 5, str(exc)) from None
            with tmp.open("rb+") as fh:
                os.fsync(fh.fileno())
            digest = _file_digest(tmp)
            nbytes = tmp.stat().st_size
            final = folder / f"{doc_id}.{digest[:12]}.safetensors"
            now = time.time()
            old_paths: list[str] = []
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                old = self._row(doc_id)
                os.replace(tmp, final)
                tmp = None
                self.conn.execute(
                    f"INSERT OR REPLACE INTO docs ({', '.join(_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(_COLUMNS))})",
                    (
                        doc_id,
                        str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
                        model_hash,
                        tok_hash,
                        meta["text_sha"],
                        meta["prefix_sha"],
                        doc.n_tokens,
                        doc.start,
                        len(doc.keys),
                        self.dtype,
                        nbytes,
                        digest,
                        str(final.relative_to(self.root)),
                        old.created_at if old else now,
                        now,
                        text,
                    ),
                )
                if old is not None and old.path != str(final.relative_to(self.root)):
                    old_paths.append(old.path)
                old_paths += self._evict_locked(keep=doc_id)
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                if final is not None and tmp is None and self._row(doc_id) is None:
                    final.unlink(missing_ok=True)
                raise
        except OSError as err:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise LonglabError(
                f"store: cannot write {doc_id} in {self.root} ({err.strerror or err}); the store is "
                "read-only or full — nothing was added"
            ) from None
        except sqlite3.Error as err:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise LonglabError(f"store: cannot index {doc_id} in {self.root} (SQLite: {err})") from None
        except BaseException:  # an interrupt: our temporary file never outlives this call
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise
        for p in old_paths:
            (self.root / p).unlink(missing_ok=True)
        return doc_id

    def _evict_locked(self, keep: str | None = None) -> list[str]:
        """Delete least-recently-used rows until the total fits ``max_bytes`` (inside a write transaction);
        return the files to remove after commit."""
        if self.max_bytes is None:
            return []
        total = int(self.conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM docs").fetchone()[0])
        paths = []
        for row in self.conn.execute(
            "SELECT doc_id, nbytes, path FROM docs ORDER BY last_used ASC"
        ).fetchall():
            if total <= self.max_bytes:
                break
            if row["doc_id"] == keep:
                continue
            self.conn.execute("DELETE FROM docs WHERE doc_id = ?", (row["doc_id"],))
            total -= int(row["nbytes"])
            paths.append(row["path"])
            self.stats["evicted"] += 1
        return paths

    def _touch(self, doc_id: str) -> None:
        try:
            self.conn.execute("UPDATE docs SET last_used = ? WHERE doc_id = ?", (time.time(), doc_id))
        except sqlite3.Error:
            pass  # a busy or read-only index: the LRU order is advisory

    # ------------------------------------------------------------------------------------ reading
    def get(self, doc_id: str, model: Any = None, tokenizer: Any = None) -> DocKV:
        """The entry ``doc_id``, checked. With ``model`` and ``tokenizer`` a bad entry (corrupt, truncated,
        another model's) is recomputed from its stored text; without them it raises a LonglabError."""
        row = self._row(doc_id)
        if row is None:
            raise LonglabError(f"store: unknown document id {shorten(doc_id)} in {self.root}")
        try:
            doc = self._load(row, model, tokenizer)
            if not self.readonly:
                self._touch(doc_id)
            return doc
        except _Fault as fault:
            if model is None or tokenizer is None:
                raise LonglabError(
                    f"store: entry {doc_id} is unusable ({fault}); pass model= and tokenizer= to recompute it"
                ) from None
            if row.model_hash != model_fingerprint(model):
                raise LonglabError(
                    f"store: entry {doc_id} belongs to another model ({row.model_name})"
                ) from None
            self.stats["recomputed"] += 1
            ids = list(tokenizer(row.text, add_special_tokens=False)["input_ids"])
            prefix = []  # entries with a prefix are recomputed through fetch(), which knows it
            if row.prefix_sha != _ids_sha(prefix):
                raise LonglabError(
                    f"store: entry {doc_id} is unusable ({fault}); it was encoded after a "
                    "prefix: re-run the reuse prefill to recompute it"
                ) from None
            return self.fetch(model, tokenizer, row.text, ids)

    def _load(self, row: DocEntry, model: Any = None, tokenizer: Any = None) -> DocKV:
        from safetensors import safe_open

        path = self.root / row.path
        if model is not None and row.model_hash != model_fingerprint(model):
            raise _Fault(f"made by another model ({row.model_name})")
        if tokenizer is not None and row.tokenizer_hash != tokenizer_fingerprint(tokenizer):
            raise _Fault("made with another tokenizer")
        try:
            if path.stat().st_size != row.nbytes:
                raise _Fault(f"file size {path.stat().st_size} != indexed {row.nbytes} (truncated?)")
            if _file_digest(path) != row.file_digest:
                raise _Fault("file digest differs from the index (corrupt)")
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except FileNotFoundError:
            raise _Fault("file missing") from None
        except _Fault:
            raise
        except Exception as err:  # safetensors raises its own error types on a bad header
            raise _Fault(f"unreadable file ({type(err).__name__})") from None
        expect = {
            "format": FORMAT,
            "doc_id": row.doc_id,
            "model_hash": row.model_hash,
            "tokenizer_hash": row.tokenizer_hash,
            "n_tokens": str(row.n_tokens),
            "dtype": row.dtype,
            "layers": str(row.layers),
            "start": str(row.start),
        }
        bad = [k for k, v in expect.items() if meta.get(k) != v]
        if bad:
            raise _Fault(f"metadata {', '.join(bad)} differ from the index")
        L, n, dt = row.layers, row.n_tokens, _DTYPES.get(row.dtype)
        try:
            keys = [tensors[f"k.{i}"] for i in range(L)]
            values = [tensors[f"v.{i}"] for i in range(L)]
            ids = tensors["ids"]
        except KeyError as err:
            raise _Fault(f"tensor {err} missing") from None
        if ids.shape != (n,) or any(
            t.dim() != 3 or t.shape[1] != n or t.dtype != dt for t in (*keys, *values)
        ):
            raise _Fault("tensor shapes or dtype differ from the index")
        if model is not None:
            H_kv = int(getattr(model.config, "num_key_value_heads", model.config.num_attention_heads))
            if L != model.config.num_hidden_layers or keys[0].shape[0] != H_kv:
                raise _Fault("layer or head counts differ from the model's")
        return DocKV(keys, values, ids, row.start)

    # ------------------------------------------------------------------------------------ maintenance
    def remove(self, doc_id: str) -> bool:
        """Delete an entry; False when it was not there."""
        self._check_writable()
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            row = self._row(doc_id)
            if row is not None:
                self.conn.execute("DELETE FROM docs WHERE doc_id = ?", (doc_id,))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        if row is not None:
            (self.root / row.path).unlink(missing_ok=True)
        return row is not None

    def gc(self, *, max_bytes: int | None = None, older_than_s: float = 3600.0) -> dict[str, int]:
        """Drop index rows whose file is missing or bad, files no row names (temporary files older than
        ``older_than_s``), then evict LRU entries to ``max_bytes`` (default: the store's)."""
        self._check_writable()
        out = {"bad_rows": 0, "orphan_files": 0, "evicted": 0}
        for row in self.entries():
            try:
                self._load(row)
            except _Fault:
                if self.remove(row.doc_id):
                    out["bad_rows"] += 1
        named = {str(self.root / r.path) for r in self.entries()}
        now = time.time()
        for f in self.objects.rglob("*"):
            if not f.is_file() or str(f) in named:
                continue
            if f.name.endswith(".tmp") and _writer_alive(f) and now - f.stat().st_mtime < older_than_s:
                continue  # another process writing right now
            f.unlink(missing_ok=True)
            out["orphan_files"] += 1
        saved = self.max_bytes
        if max_bytes is not None:
            self.max_bytes = max_bytes
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                paths = self._evict_locked()
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
        finally:
            self.max_bytes = saved
        for p in paths:
            (self.root / p).unlink(missing_ok=True)
        out["evicted"] = len(paths)
        return out


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that is writing a temporary object (its pid is in the name:
    ``.<doc_id>-<pid>-<random>.tmp``) still runs; names without a pid count as alive."""
    parts = tmp.name.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return True
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
