"""The per-document KV store (longlab.reuse.DocStore): content addressing, round trip, LRU eviction, faults
(corrupt, truncated, mismatched, missing files; read-only or full directory), two writers."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from longlab import LonglabError
from longlab.reuse import DocStore, encode_document, model_fingerprint
from longlab.reuse.docstore import INDEX

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [f"Document {i}: " + " ".join(f"fact {i}-{j} is {j * i % 17}." for j in range(12)) for i in range(4)]


@pytest.fixture
def model(tiny_models):
    return tiny_models["tiny-llama"][0]


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*") if p.is_file())


def test_put_get_round_trip_content_addressed(model, tokenizer, tmp_path):
    store = DocStore(tmp_path / "s")
    a = store.put(model, tokenizer, TEXTS[0])
    assert store.put(model, tokenizer, TEXTS[0]) == a  # same text: stored once
    b = store.put(model, tokenizer, TEXTS[1])
    assert a != b and len(store) == 2 and len(_files(tmp_path / "s")) == 2
    doc = store.get(a, model, tokenizer)
    fresh = encode_document(model, _ids(tokenizer, TEXTS[0]))
    assert doc.token_ids.tolist() == fresh.token_ids.tolist()
    for x, y in zip(doc.keys + doc.values, fresh.keys + fresh.values):
        assert torch.equal(x, y)
    entry = {e.doc_id: e for e in store.entries()}[a]
    assert entry.n_tokens == len(_ids(tokenizer, TEXTS[0])) and entry.dtype == "float32"
    assert (
        entry.model_hash == model_fingerprint(model)
        and entry.nbytes == (tmp_path / "s" / entry.path).stat().st_size
    )
    assert store.total_bytes() == sum(e.nbytes for e in store.entries())


def test_bfloat16_store_halves_bytes(model, tokenizer, tmp_path):
    s32, s16 = DocStore(tmp_path / "a"), DocStore(tmp_path / "b", dtype="bfloat16")
    s32.put(model, tokenizer, TEXTS[0])
    s16.put(model, tokenizer, TEXTS[0])
    assert s16.total_bytes() < 0.6 * s32.total_bytes()


def test_lru_eviction_to_byte_limit(model, tokenizer, tmp_path):
    probe = DocStore(tmp_path / "probe")
    probe.put(model, tokenizer, TEXTS[0])
    one = probe.total_bytes()
    store = DocStore(tmp_path / "s", max_bytes=int(2.5 * one))
    ids = [store.put(model, tokenizer, t) for t in TEXTS[:2]]
    store.get(ids[0])  # 0 is now more recently used than 1
    third = store.put(model, tokenizer, TEXTS[2])
    assert set(e.doc_id for e in store.entries()) == {ids[0], third}
    assert store.total_bytes() <= store.max_bytes and len(_files(tmp_path / "s")) == 2
    assert store.stats["evicted"] == 1


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete", "foreign"])
def test_bad_entry_is_detected_and_recomputed(model, tokenizer, tmp_path, tiny_models, fault):
    store = DocStore(tmp_path / "s")
    doc_id = store.put(model, tokenizer, TEXTS[0])
    path = tmp_path / "s" / store.entries()[0].path
    if fault == "flip":
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    elif fault == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif fault == "delete":
        path.unlink()
    else:  # another model's file, with the index patched to match its size and digest: metadata catches it
        other = DocStore(tmp_path / "o")
        oid = other.put(tiny_models["tiny-qwen2"][0], tokenizer, TEXTS[0])
        foreign = tmp_path / "o" / other.entries()[0].path
        path.write_bytes(foreign.read_bytes())
        e = {x.doc_id: x for x in other.entries()}[oid]
        store.conn.execute("UPDATE docs SET nbytes = ?, file_digest = ?", (e.nbytes, e.file_digest))
    with pytest.raises(LonglabError, match="unusable"):
        store.get(doc_id)  # without a model: refused, never used
    doc = store.fetch(model, tokenizer, TEXTS[0], _ids(tokenizer, TEXTS[0]))
    assert store.stats["recomputed"] == 1
    fresh = encode_document(model, _ids(tokenizer, TEXTS[0]))
    assert all(torch.equal(x, y) for x, y in zip(doc.keys, fresh.keys))
    assert store.get(doc_id, model, tokenizer).n_tokens == fresh.n_tokens  # the rewritten entry is good


def test_another_model_never_reads_the_entry(model, tokenizer, tmp_path, tiny_models):
    store = DocStore(tmp_path / "s")
    doc_id = store.put(model, tokenizer, TEXTS[0])
    other = tiny_models["tiny-qwen2"][0]
    with pytest.raises(LonglabError, match="another model"):
        store.get(doc_id, other, tokenizer)
    store.fetch(other, tokenizer, TEXTS[0], _ids(tokenizer, TEXTS[0]))  # its own entry (another id)
    assert len(store) == 2


def test_unknown_id_rm_and_gc(model, tokenizer, tmp_path):
    store = DocStore(tmp_path / "s")
    with pytest.raises(LonglabError, match="unknown document id"):
        store.get("0" * 32)
    a = store.put(model, tokenizer, TEXTS[0])
    b = store.put(model, tokenizer, TEXTS[1])
    assert store.remove(a) and not store.remove(a)
    (tmp_path / "s" / "objects" / "zz").mkdir()
    (tmp_path / "s" / "objects" / "zz" / "orphan.safetensors").write_bytes(b"x")
    (tmp_path / "s" / store.entries()[0].path).write_bytes(b"broken")
    out = store.gc()
    assert out == {"bad_rows": 1, "orphan_files": 1, "evicted": 0}
    assert b not in store and len(store) == 0 and _files(tmp_path / "s") == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs POSIX permissions, not root")
def test_read_only_directory(model, tokenizer, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(LonglabError, match="read-only"):
            DocStore(ro / "store")
        with pytest.raises(LonglabError, match="read-only"):
            DocStore(ro)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)
    store = DocStore(tmp_path / "s")
    store.put(model, tokenizer, TEXTS[0])
    store.close()
    (tmp_path / "s" / "objects").chmod(0o555)
    try:
        reader = DocStore(tmp_path / "s", readonly=True)
        assert len(reader) == 1
        with pytest.raises(LonglabError, match="read-only"):
            reader.put(model, tokenizer, TEXTS[1])
    finally:
        (tmp_path / "s" / "objects").chmod(0o755)


def test_full_disk_leaves_nothing_half_written(model, tokenizer, tmp_path, monkeypatch):
    import safetensors.torch

    store = DocStore(tmp_path / "s")

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(LonglabError, match="nothing was added"):
        store.put(model, tokenizer, TEXTS[0])
    assert len(store) == 0 and _files(tmp_path / "s") == []


def test_bad_store_arguments(tmp_path):
    (tmp_path / "f").write_text("x")
    for kwargs in (
        {"root": tmp_path / "f"},
        {"root": ""},
        {"root": tmp_path / "d", "max_bytes": -1},
        {"root": tmp_path / "d", "dtype": "int8"},
    ):
        with pytest.raises(LonglabError):
            DocStore(**kwargs)
    with pytest.raises(LonglabError, match="no document store"):
        DocStore(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "d").exists()


def test_two_writers_threads(model, tokenizer, tmp_path):
    """Two store objects (two SQLite connections) writing at once, overlapping texts: every entry indexed
    once, every file named by exactly one row, everything readable."""
    root = tmp_path / "s"
    DocStore(root).close()
    errors: list[BaseException] = []

    def work(texts):
        try:
            s = DocStore(root)
            for t in texts:
                s.put(model, tokenizer, t)
            s.close()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=(TEXTS[:3],)),
        threading.Thread(target=work, args=(TEXTS[1:],)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = DocStore(root)
    assert len(store) == 4
    assert sorted(str(root / e.path) for e in store.entries()) == [str(p) for p in _files(root)]
    for e in store.entries():
        store.get(e.doc_id, model, tokenizer)
    conn = sqlite3.connect(root / INDEX)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.slow
def test_two_writer_processes(tmp_path):
    root = tmp_path / "s"
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from longlab.models import build_tiny_model, tiny_tokenizer\n"
        "from longlab.reuse import DocStore\n"
        "m, t = build_tiny_model('tiny-llama'), tiny_tokenizer()\n"
        "s = DocStore(sys.argv[1])\n"
        "for i in range(6): s.put(m, t, f'shared text {i} ' * 20)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)]) for _ in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    store = DocStore(root)
    assert len(store) == 6 and len(_files(root)) == 6


def test_unwritable_directory_simulated(tmp_path, monkeypatch):
    """As root chmod does not stop writes, so the OS refusal is simulated: the store reports a read-only
    directory and removes what it created."""
    import longlab.reuse.docstore as store_mod

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store_mod.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(LonglabError, match="read-only"):
        DocStore(tmp_path / "new" / "store")
    assert not (tmp_path / "new").exists()


def test_readonly_store_reads_and_refuses_writes(model, tokenizer, tmp_path):
    store = DocStore(tmp_path / "s")
    doc_id = store.put(model, tokenizer, TEXTS[0])
    store.close()
    reader = DocStore(tmp_path / "s", readonly=True)
    assert reader.get(doc_id, model, tokenizer).n_tokens > 0 and len(reader) == 1
    with pytest.raises(LonglabError, match="read-only"):
        reader.put(model, tokenizer, TEXTS[1])
    with pytest.raises(LonglabError, match="read-only"):
        reader.remove(doc_id)
    assert len(reader) == 1


def test_a_failed_put_removes_only_its_own_temporary_file(model, tokenizer, tmp_path, monkeypatch):
    # another writer's temporary object (or anything else in the folder) is not this call's: it stays
    import safetensors.torch

    store = DocStore(tmp_path / "s")
    store.put(model, tokenizer, TEXTS[1])
    folders = {p.parent for p in _files(tmp_path / "s") if p.suffix == ".safetensors"}
    other = next(iter(folders)) / ".other-writer-123-abc.tmp"
    other.write_bytes(b"another writer's bytes")

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    before = set(_files(tmp_path / "s"))
    with pytest.raises(LonglabError, match="nothing was added"):
        store.put(model, tokenizer, TEXTS[0])
    assert set(_files(tmp_path / "s")) == before and other.read_bytes() == b"another writer's bytes"
