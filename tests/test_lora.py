"""LoRA on EntropyLong data (issue 34 item 4): training lowers the loss, the saved adapter merged at load
reproduces the trained model, evaluation runs it, and a bad adapter directory is refused before it merges."""

from __future__ import annotations

import json

import pytest
import torch

from longlab.errors import LonglabError
from longlab.models import build_tiny_model, load_model

pytest.importorskip("peft")

SEQ = list(range(10, 90)) * 2  # a repeated sequence: learnable in a few steps


def _train(steps=12, lr=1e-2, **kw):
    from longlab.adapter_train import train_lora

    model = build_tiny_model("tiny-llama", attn="sdpa")
    tensors, stats = train_lora(model, [SEQ] * 3, steps=steps, lr=lr, heldout=1, progress=False, **kw)
    return model, tensors, stats


def _save(tmp_path, model, tensors, stats, name="ad", **kw):
    from longlab.adapter_train import save_adapter

    args = dict(base_model="tiny-llama", rank=8, alpha=16.0, targets="attn", data={"path": "x.jsonl"},
                training=stats)
    return save_adapter(tmp_path / name, tensors, model, **{**args, **kw})


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    return _train()


def test_a_few_lora_steps_lower_the_loss_and_leave_the_base_model_as_it_was(trained):
    model, tensors, stats = trained
    losses = stats["losses"]
    assert len(losses) == stats["steps_done"] == 12 and stats["stopped_by"] == "steps"
    assert losses[-1] < losses[0] - 1.0  # the repeated sequence is learned
    assert stats["heldout_loss_after"] < stats["heldout_loss_before"] - 1.0
    fresh = build_tiny_model("tiny-llama", attn="sdpa").state_dict()
    assert set(model.state_dict()) == set(fresh)  # peft's layers removed
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())  # base weights untouched
    assert len(tensors) == 2 * 2 * 4  # 2 layers x q/k/v/o x (A, B)
    a = tensors["model.layers.0.self_attn.q_proj.lora_A"]
    b = tensors["model.layers.0.self_attn.k_proj.lora_B"]
    assert a.shape == (8, 64) and b.shape == (32, 8)  # A [r, in]; k_proj: 2 KV heads x 16 = 32 outputs


def test_merged_adapter_reproduces_the_trained_model_and_changes_logits(trained, tmp_path):
    from longlab.adapter_train import sequence_loss

    model, tensors, stats = trained
    path = _save(tmp_path, model, tensors, stats)
    merged, _ = load_model(path)
    base, _ = load_model("tiny-llama")
    x = torch.tensor([SEQ])
    with torch.no_grad():
        diff = (merged(x).logits - base(x).logits).abs().max().item()
    assert diff > 0.1
    assert merged.longlab_adapter["modules"] == 8
    # the merge W + alpha/r B A is the trained model: its loss on the held-out sequence is the one training
    # recorded (a wrong scale, e.g. alpha instead of alpha/r, would not match)
    assert sequence_loss(merged, [SEQ]) == pytest.approx(stats["heldout_loss_after"], abs=2e-3)
    half = _save(tmp_path, model, tensors, stats, name="half", alpha=8.0)
    loss_half = sequence_loss(load_model(half)[0], [SEQ])
    assert abs(loss_half - stats["heldout_loss_after"]) > 0.05


def test_eval_runs_the_adapter_and_keys_rows_by_its_weights(trained, tmp_path):
    from longlab.eval.config import EvalConfig
    from longlab.eval.driver import run_eval
    from longlab.eval.store import ResultStore

    model, tensors, stats = trained
    path = _save(tmp_path, model, tensors, stats)
    cfg = dict(recipes=["full"], tasks=["passkey"], lengths=[400], samples=1, max_new_tokens=2, report=False,
               progress=False)
    run_eval(EvalConfig(out=str(tmp_path / "res"), model=str(path), **cfg), log=lambda m: None)
    assert EvalConfig(out="x", model=str(path), **cfg).identity()["adapter"] == json.loads(
        (path / "adapter.json").read_text())["weights_file"]["sha256"][:16]
    assert "adapter" not in EvalConfig(out="x", model="tiny-llama", **cfg).identity()
    store = ResultStore(str(tmp_path / "res"))
    try:
        rows = list(store.rows())
    finally:
        store.close()
    assert [r["model"] for r in rows] == [str(path)]


def _flip_byte(path, at=-20):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_adapter_directories_are_refused(trained, tmp_path):
    from safetensors.torch import save_file

    from longlab.adapter import apply_adapter
    from longlab.safeio import file_record

    model, tensors, stats = trained
    # the weights file is missing
    gone = _save(tmp_path, model, tensors, stats, name="gone")
    from longlab.safeio import new_file_mode  # not safetensors' owner-only 0o600
    assert {p.stat().st_mode & 0o777 for p in gone.iterdir()} == {new_file_mode()}
    (gone / "adapter.safetensors").unlink()
    with pytest.raises(LonglabError, match="not a longlab LoRA adapter .needs adapter.json and adapter"):
        load_model(gone)
    # corrupt weights: the SHA-256 of the manifest's record differs
    bad = _save(tmp_path, model, tensors, stats, name="corrupt")
    _flip_byte(bad / "adapter.safetensors")
    with pytest.raises(LonglabError, match="does not match the SHA-256 in its manifest"):
        load_model(bad)
    # a pickle named adapter.safetensors with a matching record is never unpickled
    pick = _save(tmp_path, model, tensors, stats, name="pickle")
    torch.save(tensors, pick / "adapter.safetensors")
    man = json.loads((pick / "adapter.json").read_text())
    man["weights_file"] = file_record(pick / "adapter.safetensors", tensors)
    (pick / "adapter.json").write_text(json.dumps(man))
    with pytest.raises(LonglabError, match="not a readable safetensors file"):
        load_model(pick)
    # shapes that do not fit the base model, recorded consistently
    wrong = {k: (v[:, :32].contiguous() if k.endswith("lora_A") else v) for k, v in tensors.items()}
    shape = _save(tmp_path, model, wrong, stats, name="shape")
    with pytest.raises(LonglabError, match=r"has lora_A \[8, 32\] .*; this model needs \[8, 64\]"):
        load_model(shape)
    # the manifest relabelled after training (rank), and other base weights
    rel = _save(tmp_path, model, tensors, stats, name="relabel")
    man = json.loads((rel / "adapter.json").read_text())
    man["rank"] = 4
    (rel / "adapter.json").write_text(json.dumps(man))
    with pytest.raises(LonglabError, match="says rank='4' but adapter.safetensors was trained with rank='8'"):
        load_model(rel)
    other = build_tiny_model("tiny-llama", seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(LonglabError, match="trained on other base weights"):
        apply_adapter(other, _save(tmp_path, model, tensors, stats, name="ok"))
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # nothing merged
    with pytest.raises(LonglabError, match="trained on base model 'tiny-llama', not 'tiny-qwen2'"):
        apply_adapter(other, tmp_path / "ok", base_model="tiny-qwen2")
    # a tensor that is not a LoRA pair, written with a matching record
    odd = _save(tmp_path, model, tensors, stats, name="odd")
    extra = {**tensors, "model.layers.0.mlp.up_proj.lora_A": torch.zeros(8, 64),
             "model.layers.0.mlp.up_proj.lora_B": torch.zeros(128, 8)}
    save_file(extra, str(odd / "adapter.safetensors"), metadata={"rank": "8", "targets": "attn",
              "base_fingerprint": man["base_fingerprint"]})
    man = json.loads((odd / "adapter.json").read_text())
    man["weights_file"] = file_record(odd / "adapter.safetensors", extra)
    (odd / "adapter.json").write_text(json.dumps(man))
    with pytest.raises(LonglabError, match="up_proj is not one of the --targets attn projections"):
        load_model(odd)


def test_cli_trains_on_an_entropylong_dataset_and_never_overwrites_a_foreign_dir(tmp_path, capsys):
    from longlab.cli import main

    data = tmp_path / "el.jsonl"
    assert main(["data", "entropylong", "--generate", "4", "--out", str(data), "--model", "tiny-llama",
                 "--retriever", "bm25", "--alpha", "0.5", "--chunk-tokens", "48", "--query-tokens", "16",
                 "--target-tokens", "512", "--max-doc-tokens", "384", "--no-progress", "--threads", "1"]) == 0
    out = tmp_path / "adapter"
    argv = ["train", "lora", "--model", "tiny-llama", "--data", str(data), "--steps", "3", "--seq-len", "256",
            "--heldout-windows", "1", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    man = json.loads((out / "adapter.json").read_text())
    assert man["training"]["steps_done"] == 3 and man["data"]["records"] == 4
    assert man["data"]["cut_to_seq_len"] == 4  # 512-token sequences, their last 256 tokens
    assert not (tmp_path / "adapter.checkpoint").exists()  # removed once every step is in the adapter
    assert main(argv) == 0  # its own adapter directory is replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert main(argv[:-1] + [str(foreign)]) == 2
    assert "longlab did not write" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    other = ["train", "lora", "--model", "tiny-qwen2", "--data", str(data), "--out", str(tmp_path / "q")]
    assert main(other) == 2
    assert "tokenizer (its scorer), not of --model 'tiny-qwen2'" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_train_lora_without_peft_names_the_extra(tmp_path, monkeypatch, capsys):
    import builtins

    from longlab.cli import main

    real = builtins.__import__

    def no_peft(name, *a, **kw):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("no peft")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    assert main(["train", "lora", "--model", "tiny-llama", "--data", str(tmp_path / "x.jsonl"), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'longlab[train]'" in err and "Traceback" not in err


def test_an_interrupted_run_resumes_to_the_uninterrupted_adapter(tmp_path, monkeypatch):
    from longlab.adapter_train import is_checkpoint_dir, train_lora

    torch.set_num_threads(1)
    seqs = [SEQ, SEQ[::-1], SEQ[5:], SEQ[:90]]
    kw = dict(steps=6, lr=1e-2, heldout=1, progress=False, checkpoint_every=2)
    _, full = train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, **kw)
    ref, _ = train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, **kw)
    ckpt = tmp_path / "ad.checkpoint"
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def failing_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # interrupted during step 4
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, checkpoint=ckpt, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert is_checkpoint_dir(ckpt)
    assert len(json.loads((ckpt / "checkpoint.json").read_text())["losses"]) == 3  # saved at the interrupt
    tensors, stats = train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, checkpoint=ckpt, **kw)
    assert stats["resumed_at_step"] == 3 and stats["steps_done"] == 6
    assert stats["losses"] == full["losses"]
    assert all(torch.allclose(tensors[k], ref[k], atol=1e-6) for k in ref)
    # another run's checkpoint is refused, not mixed in; restart ignores it
    with pytest.raises(LonglabError, match="other settings or data; rerun with those, or with --restart"):
        train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, checkpoint=ckpt, **{**kw, "lr": 5e-3})
    _, again = train_lora(build_tiny_model("tiny-llama", attn="sdpa"), seqs, checkpoint=ckpt, restart=True,
                          **{**kw, "lr": 5e-3})
    assert again["resumed_at_step"] == 0 and again["steps_done"] == 6


def test_gradient_checkpointing_trains_the_same_adapter():
    torch.set_num_threads(1)
    _, plain, stats = _train(steps=4)
    _, ckpt, stats_ckpt = _train(steps=4, grad_checkpointing=True)
    assert stats_ckpt["losses"] == stats["losses"]
    assert all(torch.allclose(ckpt[k], plain[k], atol=1e-6) for k in plain)


def test_checkpoint_removal_touches_only_our_two_files(tmp_path):
    """The end-of-training clean-up removes a checkpoint file by file; a directory with our manifest but
    anything else in it (a user's file) is left whole."""
    from longlab.adapter_train import CHECKPOINT_MANIFEST, CHECKPOINT_WEIGHTS, remove_checkpoint_dir

    ours = tmp_path / "a.checkpoint"
    ours.mkdir()
    (ours / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "longlab-lora-checkpoint"}))
    (ours / CHECKPOINT_WEIGHTS).write_bytes(b"x")
    assert remove_checkpoint_dir(ours) and not ours.exists()
    mixed = tmp_path / "b.checkpoint"
    mixed.mkdir()
    (mixed / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "longlab-lora-checkpoint"}))
    (mixed / "notes.txt").write_text("keep")
    assert not remove_checkpoint_dir(mixed)
    assert sorted(p.name for p in mixed.iterdir()) == [CHECKPOINT_MANIFEST, "notes.txt"]
    foreign = tmp_path / "c.checkpoint"
    foreign.mkdir()
    (foreign / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "something-else"}))
    assert not remove_checkpoint_dir(foreign) and (foreign / CHECKPOINT_MANIFEST).exists()
    # a weights "file" that is a link to a user's file, or a directory, is not ours: nothing is touched
    user_file = tmp_path / "user_weights.bin"
    user_file.write_bytes(b"user")
    linked = tmp_path / "d.checkpoint"
    linked.mkdir()
    (linked / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "longlab-lora-checkpoint"}))
    (linked / CHECKPOINT_WEIGHTS).symlink_to(user_file)
    assert not remove_checkpoint_dir(linked)
    assert (linked / CHECKPOINT_WEIGHTS).is_symlink() and user_file.read_bytes() == b"user"
    nested = tmp_path / "e.checkpoint"
    (nested / CHECKPOINT_WEIGHTS).mkdir(parents=True)
    (nested / CHECKPOINT_WEIGHTS / "keep.txt").write_text("keep")
    (nested / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "longlab-lora-checkpoint"}))
    assert not remove_checkpoint_dir(nested) and (nested / CHECKPOINT_WEIGHTS / "keep.txt").exists()
    # a link to a user's directory that looks like a checkpoint is not removed through the link
    target = tmp_path / "user_dir"
    target.mkdir()
    (target / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": "longlab-lora-checkpoint"}))
    via = tmp_path / "f.checkpoint"
    via.symlink_to(target, target_is_directory=True)
    assert not remove_checkpoint_dir(via) and (target / CHECKPOINT_MANIFEST).exists()


def test_cli_refuses_a_foreign_checkpoint_dir_beside_out(tmp_path, capsys):
    """A user's directory named OUT.checkpoint is refused before any training and left as it was."""
    from longlab.cli import main

    data = tmp_path / "el.jsonl"
    assert main(["data", "entropylong", "--generate", "2", "--out", str(data), "--model", "tiny-llama",
                 "--retriever", "bm25", "--alpha", "0.5", "--chunk-tokens", "48", "--query-tokens", "16",
                 "--target-tokens", "512", "--max-doc-tokens", "384", "--no-progress", "--threads", "1"]) == 0
    user = tmp_path / "adapter.checkpoint"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    argv = ["train", "lora", "--model", "tiny-llama", "--data", str(data), "--steps", "1", "--seq-len", "256",
            "--heldout-windows", "1", "--threads", "1", "--out", str(tmp_path / "adapter")]
    assert main(argv) == 2
    assert "longlab did not write" in capsys.readouterr().err
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "adapter").exists()


def test_sigterm_saves_the_checkpoint_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's stop, the end of a session) is handled as Ctrl-C: the steps done are saved
    in OUT.checkpoint, the command exits 143, and the same command resumes from there; the default
    SIGTERM handler is back afterwards."""
    import os
    import signal

    from longlab.cli import main

    data = tmp_path / "el.jsonl"
    assert main(["data", "entropylong", "--generate", "2", "--out", str(data), "--model", "tiny-llama",
                 "--retriever", "bm25", "--alpha", "0.5", "--chunk-tokens", "48", "--query-tokens", "16",
                 "--target-tokens", "512", "--max-doc-tokens", "384", "--no-progress", "--threads", "1"]) == 0
    argv = ["train", "lora", "--model", "tiny-llama", "--data", str(data), "--steps", "4", "--seq-len", "256",
            "--heldout-windows", "1", "--threads", "1", "--out", str(tmp_path / "adapter")]
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def terminated_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # during step 3
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", terminated_step)
    assert main(argv) == 143
    assert "longlab: terminated" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ckpt = json.loads((tmp_path / "adapter.checkpoint" / "checkpoint.json").read_text())
    assert len(ckpt["losses"]) == 2 and not (tmp_path / "adapter").exists()
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert main(argv) == 0
    man = json.loads((tmp_path / "adapter" / "adapter.json").read_text())
    assert man["training"]["resumed_at_step"] == 2 and man["training"]["steps_done"] == 4
