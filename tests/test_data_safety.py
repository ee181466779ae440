"""Never lose a user's files: every ``--out`` refuses what longlab did not write, before any work starts,
and a failed write (a full disk) leaves the target as it was and no temporary behind."""

from __future__ import annotations

import errno
import json
import os

import pytest

from longlab.cli import main
from longlab.recipe import LonglabError
from longlab.safeio import check_output_dir, check_output_file, publish_dir, write_file_atomic

TRAIN = ["train", "drope", "--model", "tiny-llama", "--steps", "1", "--seq-len", "16"]


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_train_out_refuses_a_users_directory_before_training(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("data")
    assert main([*TRAIN, "--out", str(precious)]) == 2
    printed = capsys.readouterr()
    assert "--out" in printed.err and "longlab did not write" in printed.err
    assert "longlab train drope:" not in printed.out  # refused before the model loads and the plan prints
    assert (precious / "thesis.tex").read_text() == "data"
    assert _tree(tmp_path) == ["precious", "precious/thesis.tex"]


def test_train_out_dot_refuses_a_non_empty_working_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    assert main([*TRAIN, "--out", "."]) == 2
    assert "longlab did not write" in capsys.readouterr().err
    assert _tree(tmp_path) == ["notes.txt"]


def test_train_out_a_file_or_under_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main([*TRAIN, "--out", str(blocker)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main([*TRAIN, "--out", str(blocker / "variant")]) == 2
    assert "which is a file" in capsys.readouterr().err
    assert blocker.read_text() == "x" and _tree(tmp_path) == ["file.txt"]


def test_train_out_writes_new_and_empty_dirs_and_replaces_its_own_variant(tmp_path, capsys):
    out = tmp_path / "v"
    assert main([*TRAIN, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["manifest.json", "model.safetensors"]
    first = json.loads((out / "manifest.json").read_text())
    assert main([*TRAIN, "--out", str(out), "--seed", "1"]) == 0  # its own earlier variant: replaced
    assert sorted(os.listdir(out)) == ["manifest.json", "model.safetensors"]
    assert json.loads((out / "manifest.json").read_text()) != first
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*TRAIN, "--out", str(empty)]) == 0
    assert sorted(os.listdir(empty)) == ["manifest.json", "model.safetensors"]
    (out / "README.md").write_text("my notes")  # a user's file inside a variant: no longer longlab's alone
    assert main([*TRAIN, "--out", str(out)]) == 2
    assert (out / "README.md").read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_lab_train_refuses_a_users_directory_and_keeps_non_checkpoint_files(tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "data.csv").write_text("1,2")
    argv = ["lab", "train", "--mixer", "softmax", "--task", "copy", "--train-len", "16", "--steps", "2",
            "--batch", "2", "--dim", "16", "--layers", "1", "--heads", "2", "--no-progress",
            "--ckpt-every", "1"]
    assert main([*argv, "--out", str(user)]) == 2
    assert "longlab did not write" in capsys.readouterr().err
    assert _tree(user) == ["data.csv"]
    run = tmp_path / "run"
    assert main([*argv, "--out", str(run)]) == 0
    assert (run / "checkpoint-2").is_dir() and not (run / "checkpoint-1").exists()  # only the latest kept


def test_calibrate_out_never_overwrites_a_users_file(tmp_path, capsys):
    user = tmp_path / "thesis.json"
    user.write_text('{"chapter": 1}')
    argv = ["calibrate", "pmkvq", "--model", "no-such-model-is-loaded", "--budget-mb", "1",
            "--out", str(user)]
    assert main(argv) == 2
    assert "longlab did not write it" in capsys.readouterr().err
    assert user.read_text() == '{"chapter": 1}'


def test_publish_dir_failure_leaves_the_target_as_it_was(tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / "manifest.json").write_text("{}")

    def owned(path):
        return True

    def failing(tmp):
        (tmp / "manifest.json").write_text('{"new": 1}')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(LonglabError, match=r"--out: cannot write .*the disk is full; nothing was written"):
        publish_dir(out, failing, "--out", owned=owned)
    assert (out / "manifest.json").read_text() == "{}"
    assert _tree(tmp_path) == ["v", "v/manifest.json"]


def test_publish_dir_moves_the_manifest_last(tmp_path, monkeypatch):
    out = tmp_path / "v"
    out.mkdir()
    moved = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real(a, b)))

    def write(tmp):
        for name in ("manifest.json", "a.bin", "z.bin"):
            (tmp / name).write_text(name)

    publish_dir(out, write, "--out", owned=lambda p: True, last="manifest.json")
    assert moved == ["a.bin", "z.bin", "manifest.json"]


def test_write_file_atomic_on_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "alloc.json"
    path.write_text("old")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(LonglabError, match="the disk is full"):
        write_file_atomic(path, "new", "--out")
    assert path.read_text() == "old" and _tree(tmp_path) == ["alloc.json"]


def test_check_output_helpers_name_the_flag(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(LonglabError, match=r"^--save: .* is a file, not a directory"):
        check_output_dir(f, "--save", owned=lambda p: False)
    with pytest.raises(LonglabError, match=r"^--save: .* is a directory; give a file name"):
        check_output_file(tmp_path, "--save", owned=lambda p: False)
    assert check_output_file(tmp_path / "new.json", "--save", owned=lambda p: False) == tmp_path / "new.json"
    assert check_output_dir(tmp_path / "a" / "b", "--save", owned=lambda p: False) == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # a check creates nothing


def test_store_rm_and_gc_on_a_missing_store_create_nothing(tmp_path, capsys):
    missing = tmp_path / "nostore"
    for argv in (["store", "rm", "--store", str(missing), "abc"], ["store", "gc", "--store", str(missing)]):
        assert main(argv) == 2
        assert "no document store at" in capsys.readouterr().err
    assert not missing.exists()


def test_a_refused_docs_run_does_not_create_the_store(tmp_path, capsys):
    from longlab.models import build_tiny_model, tiny_tokenizer
    from longlab.reuse import reuse_prefill

    model = build_tiny_model("tiny-llama", max_position_embeddings=64)
    store = tmp_path / "s"
    with pytest.raises(LonglabError, match="max_position_embeddings"):
        reuse_prefill(model, tiny_tokenizer(), ["x" * 200], "q?", "no-recompute", store=store)
    assert not store.exists()


def test_gc_removes_the_temporary_object_of_a_dead_writer_at_once(tmp_path):
    import subprocess
    import sys

    from longlab.reuse import DocStore

    store = DocStore(tmp_path / "s")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    folder = store.objects / "ab"
    folder.mkdir(parents=True)
    orphan = folder / f".abcdef-{dead}-x1y2.tmp"  # written by a process that no longer runs
    orphan.write_bytes(b"half")
    live = folder / f".abcdef-{os.getpid()}-z9.tmp"  # a writer that is running (this test)
    live.write_bytes(b"half")
    out = store.gc()
    assert not orphan.exists() and live.exists() and out["orphan_files"] == 1


def test_a_full_disk_while_eval_writes_keeps_earlier_rows_and_resumes(tmp_path):
    """SQLite's page limit stands in for a full disk: the failing row is a clear error, the rows already
    stored stay, and the same store takes rows again once there is room."""
    from longlab.eval.store import ResultStore

    row = dict(model="m", recipe="full", task="t", length=1, query_aware=False, seed=0, config_hash="h",
               score=1.0, prediction="x" * 4000)
    with ResultStore(tmp_path) as store:
        assert store.add({**row, "sample_id": "0"})
        pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
        store.conn.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(LonglabError, match=r"the disk is full .*rows stored so far are kept"):
            for i in range(1, 50):
                store.add({**row, "sample_id": str(i)})
        kept = len(store.rows())
        assert kept >= 1
        store.conn.execute("PRAGMA max_page_count = 1073741823")  # space freed
        assert store.add({**row, "sample_id": "resumed"})
        assert len(store.rows()) == kept + 1


def test_a_store_that_cannot_be_made_leaves_no_empty_database_in_a_users_directory(tmp_path, monkeypatch):
    import sqlite3

    from longlab.eval.store import ResultStore

    users = tmp_path / "results"
    users.mkdir()
    (users / "notes.txt").write_text("mine")

    def full(self):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ResultStore, "_create_schema", full)
    with pytest.raises(LonglabError, match="--out"):
        ResultStore(users)
    assert _tree(users) == ["notes.txt"]


# ---------------------------------------------------------------- train: every option acts or is refused
@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "indexmem", "--steps", "5"], "--steps: an option of drope, ropeid, repo, comi and lora"),
        (["train", "indexmem", "--params", "cycles=2"], "--params: an option of drope, ropeid and repo"),
        (["train", "indexmem", "--data", "pydoc"], "--data: an option of drope, ropeid, repo and lora"),
        (["train", "drope", "--inner-steps", "2"], "--inner-steps: an option of indexmem, not of train"),
        (["train", "repo", "--lr-memory", "0.1"], "--lr-memory: an option of indexmem"),
        (["train", "drope", "--max-steps", "3"], "--max-steps: an option of indexmem"),  # drope: --steps
        (["train", "drope", "--seed", str(2**70)], "--seed must be an integer in [0, 4294967295]"),
        (["train", "indexmem", "--seed", str(2**70)], "--seed must be an integer in [0, 4294967295]"),
        (["train", "drope", "--seq-len", str(10**9)], "--seq-len must be an integer in [8, 131072]"),
        (["train", "indexmem", "--seq-len", str(10**9)], "--seq-len must be an integer in [128, 131072]"),
        (["train", "ropeid", "--steps", "1000000", "--batch", "1000"], "training tokens, more than"),
        (["train", "drope", "--minutes", "1e30"], "--minutes must be"),
        (["train", "drope", "--data", "x.jsonl"], "--data must be 'essay' or 'pydoc'"),
        (["train", "lora", "--batch", "2"], "--batch: an option of drope, ropeid and repo, not of train"),
        (["train", "drope", "--rank", "4"], "--rank: an option of lora, not of train drope"),
        (["train", "lora"], "--data: train lora needs an EntropyLong dataset"),
        (["train", "lora", "--data", "x.jsonl", "--rank", "0"], "--rank must be an integer in [1, 1024]"),
        (["train", "lora", "--data", "x.jsonl", "--targets", "mlp"], "--targets must be 'attn' or 'all'"),
        (["train", "lora", "--data", "x", "--steps", "100000", "--seq-len", "100000"], "training tokens"),
        (["train", "lora", "--data", "no-such.jsonl"], "--data: no such file"),
    ],
)
def test_train_refuses_other_methods_options_and_unbounded_sizes(argv, words, tmp_path, capsys):
    from longlab.cli import main

    out = tmp_path / "out"
    assert main(argv + ["--model", "no-such-model-is-loaded", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not out.exists()


def test_train_cli_knows_every_trainable_position_method():
    from longlab.cli.train import POSITION_METHODS
    from longlab.position.train import TRAINABLE

    assert POSITION_METHODS == TRAINABLE


# ---------------------------------------------------------------- files longlab deletes are its own
def test_the_eval_writer_lock_never_replaces_or_removes_a_users_file(tmp_path):
    from longlab.eval.driver import _writer_lock

    notes = tmp_path / ".longlab-eval.lock"
    notes.write_text("my notes, not a pid\n")
    with pytest.raises(LonglabError, match="is not longlab's writer lock"):
        _writer_lock(tmp_path)
    assert notes.read_text() == "my notes, not a pid\n"
    notes.unlink()
    target = tmp_path / "target.txt"
    target.write_text("data")
    notes.symlink_to(target)  # a link by that name is not a lock either: neither it nor its target is touched
    with pytest.raises(LonglabError, match="is not longlab's writer lock"):
        _writer_lock(tmp_path)
    assert notes.is_symlink() and target.read_text() == "data"


def test_the_eval_writer_lock_removes_only_the_lock_it_opened(tmp_path):
    from longlab.eval.driver import _writer_lock

    (tmp_path / ".longlab-eval.lock").write_text("12345")  # a dead run's lock: reused, then removed
    lock = _writer_lock(tmp_path)
    lock.close()
    assert not (tmp_path / ".longlab-eval.lock").exists()
    lock = _writer_lock(tmp_path)
    replaced = tmp_path / "replacement"
    replaced.write_text("someone else's file")
    replaced.replace(tmp_path / ".longlab-eval.lock")  # the lock file was replaced while the run held it
    lock.close()
    assert (tmp_path / ".longlab-eval.lock").read_text() == "someone else's file"


def test_a_results_store_never_adopts_or_removes_a_users_orphan_sqlite_sidecar(tmp_path):
    from longlab.eval.store import ResultStore

    wal = tmp_path / "results.sqlite-wal"
    wal.write_bytes(b"the user's bytes")
    with pytest.raises(LonglabError, match="exists without its database"):
        ResultStore(tmp_path)
    assert wal.read_bytes() == b"the user's bytes" and not (tmp_path / "results.sqlite").exists()


def test_a_failed_open_removes_only_the_files_it_made_in_a_users_directory(tmp_path, monkeypatch):
    import sqlite3

    from longlab.eval.store import ResultStore

    (tmp_path / "thesis.tex").write_text("data")

    def broken(self):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(ResultStore, "_create_schema", broken)
    with pytest.raises(LonglabError):
        ResultStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]
    assert (tmp_path / "thesis.tex").read_text() == "data"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_atomic_writes_give_a_new_files_usual_mode_not_mkstemps_private_one(tmp_path, umask):
    """A file renamed into place from a temporary has the mode ``open()`` would give it (0o666 less the
    umask), not mkstemp's owner-only 0o600: an output a user shares must be readable like their others."""
    from longlab.safeio import new_file_mode, temp_path_beside

    old = os.umask(umask)
    try:
        assert new_file_mode() == 0o666 & ~umask
        out = write_file_atomic(tmp_path / "a.json", "{}", "--out")
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        tmp = temp_path_beside(tmp_path / "b.safetensors")
        assert tmp.stat().st_mode & 0o777 == 0o666 & ~umask and tmp.name.startswith(".b.safetensors.")
        # a replaced output keeps the mode its owner gave it, tighter or looser
        for mode in (0o600, 0o664):
            out.chmod(mode)
            write_file_atomic(out, "[]", "--out")
            assert out.stat().st_mode & 0o777 == mode and out.read_text() == "[]"
        import torch

        from longlab.safeio import save_tensors

        weights = tmp_path / "w.safetensors"
        save_tensors({"a": torch.zeros(2)}, weights)
        assert weights.stat().st_mode & 0o777 == 0o666 & ~umask
        weights.chmod(0o640)
        save_tensors({"a": torch.ones(2)}, weights)
        assert weights.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_a_failed_chmod_removes_only_the_temporary_it_made(tmp_path, monkeypatch):
    """temp_file_beside deletes one file on failure: the one mkstemp just created for it. The user's
    target, its neighbours and the folder stay exactly as they were, and write_file_atomic reports the
    failure against its flag."""
    from longlab.safeio import temp_file_beside

    target, neighbour = tmp_path / "report.json", tmp_path / ".report.json.keep"
    target.write_text("theirs")
    target.chmod(0o640)
    neighbour.write_text("also theirs")  # a name like our temporaries' prefix
    before = {p.name: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.iterdir()}

    def refuse(fd, mode):
        raise PermissionError(errno.EPERM, "fchmod refused")

    monkeypatch.setattr(os, "fchmod", refuse)
    with pytest.raises(PermissionError):
        temp_file_beside(target)
    with pytest.raises(LonglabError, match="--out"):
        write_file_atomic(target, "ours", "--out")
    assert {p.name: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.iterdir()} == before


def test_a_failed_chmod_beside_a_user_directory_leaves_the_directory_whole(tmp_path, monkeypatch):
    """The one unlink in temp_file_beside is of mkstemp's new file: when ``out`` names a user's directory,
    a failure removes neither that directory nor anything in it or beside it."""
    from longlab.safeio import temp_file_beside

    theirs = tmp_path / "results"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "notes.txt").write_text("theirs")
    (theirs / "sub" / "data.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".results.x").write_text("a look-alike neighbour")

    def snapshot():
        return {str(p.relative_to(tmp_path)): (p.is_dir(), p.read_bytes() if p.is_file() else b"")
                for p in tmp_path.rglob("*")}

    before = snapshot()

    def refuse(fd, mode):
        raise PermissionError(errno.EPERM, "fchmod refused")

    monkeypatch.setattr(os, "fchmod", refuse)
    with pytest.raises(PermissionError):
        temp_file_beside(theirs)
    assert snapshot() == before


def test_process_umask_reads_without_changing_it(monkeypatch):
    """The umask is read from /proc where it is shown; elsewhere (no /proc) by set-and-restore. Both give
    the real value and leave it in place."""
    import builtins

    from longlab.safeio import process_umask

    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        real_open = builtins.open

        def no_proc(path, *a, **k):
            if str(path).startswith("/proc/"):
                raise FileNotFoundError(path)
            return real_open(path, *a, **k)

        monkeypatch.setattr(builtins, "open", no_proc)
        assert process_umask() == 0o027
        monkeypatch.undo()
        assert os.umask(0o027) == 0o027  # still in place after both reads
    finally:
        os.umask(old)
