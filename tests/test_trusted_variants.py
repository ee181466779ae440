"""Trained position variants are checked before they are trusted (issue 28): the manifest records the
weights file's size, SHA-256 and tensor list, the file's metadata names what it was trained for, and a
corrupt, truncated, partial, rescaled, NaN-filled or relabelled variant, a directory without a manifest, a
manifest naming itself as base model and a format-1 variant (no digest) are refused with a LonglabError
naming the file and what is wrong. The ``forged`` cases rewrite the manifest's record to match the damaged
file (a stale or hand-made record), so each semantic check is tested on its own, not only the digest."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from longlab.models import load_model
from longlab.position.train import recalibrate, save_variant
from longlab.recipe import LonglabError
from longlab.safeio import file_record

TEXT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A DroPE variant of tiny-llama (train attn: 2 layers x q/k/v/o = 8 tensors), trained 1 step."""
    model, tok = load_model("tiny-llama", attn_implementation="sdpa", position="drope")
    stats = recalibrate(model, tok, steps=1, seq_len=16, eval_windows=1)
    out = tmp_path_factory.mktemp("v") / "drope"
    return save_variant(model, model.longlab_position, out, "tiny-llama", stats)


@pytest.fixture
def copy(variant, tmp_path):
    out = tmp_path / "variant"
    shutil.copytree(variant, out)
    return out


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d, manifest):
    (d / "manifest.json").write_text(json.dumps(manifest))


def _rewrite(d, change, forge: bool):
    """Rewrite model.safetensors with ``change(tensors)`` (metadata kept); ``forge``: update the record."""
    path = d / "model.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    tensors = change(tensors)
    save_file(tensors, str(path), metadata=meta)
    if forge:
        manifest = _manifest(d)
        manifest["weights_file"] = file_record(path, tensors)
        _write_manifest(d, manifest)


def test_a_good_variant_loads_and_its_manifest_records_the_weights(variant, tokenizer):
    manifest = _manifest(variant)
    record = manifest["weights_file"]
    assert manifest["longlab_variant"] == 2 and len(record["sha256"]) == 64
    assert record["bytes"] == (variant / "model.safetensors").stat().st_size
    assert len(record["tensors"]) == 8 and all(t["dtype"] == "float32" for t in record["tensors"].values())
    with safe_open(str(variant / "model.safetensors"), "pt") as fh:
        assert fh.metadata()["position"] == "drope" and fh.metadata()["train"] == "attn"
    model, _ = load_model(str(variant))
    ids = torch.tensor([tokenizer.encode(TEXT)])
    assert torch.isfinite(model(ids).logits).all()


def _refused(d, match, position=None):
    with pytest.raises(LonglabError, match=match) as err:
        if position is None:
            load_model(str(d))
        else:
            load_model("tiny-llama", position=f"{position}:weights={d}")
    return str(err.value)


def test_corrupt_weights_are_refused(copy):
    path = copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor
    path.write_bytes(bytes(data))
    message = _refused(copy, r"model\.safetensors does not match the SHA-256 in its manifest")
    assert f"weights='{copy}'" in message
    assert "train it again: longlab train drope --model tiny-llama --steps 1 --seq-len 16" in message
    _refused(copy, "does not match the SHA-256", position="drope")  # the same check through position=


def test_truncated_weights_are_refused(copy):
    path = copy / "model.safetensors"
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[: full // 2])
    _refused(copy, rf"has {full // 2:,} bytes, the manifest says {full:,} \(truncated or partial\)")


@pytest.mark.parametrize("forge", [False, True])
def test_partial_weights_one_of_eight_tensors_are_refused(copy, forge):
    _rewrite(copy, lambda t: dict(list(sorted(t.items()))[:1]), forge)
    if forge:  # the record matches the file: the tensor set --train attn trains is what refuses it
        _refused(copy, r"7 of the 8 tensors --train attn trains are missing")
    else:
        _refused(copy, r"truncated or partial")


@pytest.mark.parametrize("forge", [False, True])
def test_rescaled_weights_are_refused(copy, forge):
    _rewrite(copy, lambda t: {k: v * 1000 for k, v in t.items()}, forge)
    if forge:  # same size, a matching record: the scale against the base weights refuses it
        _refused(copy, r"is 1e\+03x the scale \(RMS\) of the base weights it replaces")
    else:
        _refused(copy, r"does not match the SHA-256")


@pytest.mark.parametrize("forge", [False, True])
def test_nan_filled_weights_are_refused(copy, forge):
    _rewrite(copy, lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()}, forge)
    _refused(copy, r"has non-finite values \(NaN or inf\)" if forge else r"does not match the SHA-256")


def test_a_relabelled_manifest_is_refused(copy):
    manifest = _manifest(copy)
    manifest["position"] = "ropeid"  # edited from drope; the weights and their record are untouched
    _write_manifest(copy, manifest)
    _refused(copy, r"manifest\.json says position='ropeid' but model\.safetensors was trained with "
                   r"position='drope' \(the manifest was edited after training\)")
    _refused(copy, "was trained with position='drope'", position="ropeid")


def test_a_manifest_listing_other_tensors_is_refused(copy):
    manifest = _manifest(copy)
    name = sorted(manifest["weights_file"]["tensors"])[0]
    manifest["weights_file"]["tensors"][name]["shape"] = [1, 2]
    _write_manifest(copy, manifest)
    _refused(copy, rf"tensor {name} in model\.safetensors is float32 \[\d+, \d+\], the manifest says "
                   r"float32 \[1, 2\]")


def test_a_directory_without_manifest_is_a_clear_error(copy, tmp_path):
    (copy / "manifest.json").unlink()
    _refused(copy, r"neither a longlab variant \(no manifest\.json\) nor a Hugging Face model directory.*"
                   r"holds model\.safetensors without manifest\.json")
    _refused(copy, r"not a longlab variant directory \(needs manifest\.json", position="drope")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("data")
    _refused(notes, r"neither a longlab variant.*\(it holds thesis\.tex\)")


def test_a_manifest_whose_base_model_is_itself_is_a_clear_error(copy, variant, monkeypatch):
    manifest = _manifest(copy)
    manifest["base_model"] = str(copy)
    _write_manifest(copy, manifest)
    _refused(copy, r"names the variant itself as base model")
    monkeypatch.chdir(copy)  # spelled '.' from inside it
    manifest["base_model"] = "."
    _write_manifest(copy, manifest)
    _refused(copy, r"names the variant itself as base model")
    manifest["base_model"] = str(variant)  # a chain: a variant of a variant
    _write_manifest(copy, manifest)
    _refused(copy, r"names another variant .* as base model")


def test_a_format_1_variant_without_digest_is_refused_with_the_retrain_command(copy):
    manifest = _manifest(copy)
    manifest["longlab_variant"] = 1
    del manifest["weights_file"]
    _write_manifest(copy, manifest)
    message = _refused(copy, r"written before variants recorded their weights' SHA-256 and tensor list")
    assert f"train it again: longlab train drope --model tiny-llama --steps 1 --seq-len 16 --batch 1 " \
           f"--lr 0.0001 --train attn --data essay --out {copy}" in message


@pytest.mark.parametrize("text", ["{not json", '{"longlab_variant": 2, "position": NaN}', "[1, 2]"])
def test_an_unreadable_manifest_is_a_clear_error(copy, text):
    (copy / "manifest.json").write_text(text)
    _refused(copy, r"cannot read manifest\.json|not a longlab variant manifest")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_weights_is_refused_without_hanging(copy):
    (copy / "model.safetensors").unlink()
    os.mkfifo(copy / "model.safetensors")
    _refused(copy, r"model\.safetensors is not a regular file, not a weights file")


def test_a_damaged_variant_as_draft_model_is_refused(copy, variant, llama, tokenizer):
    from longlab.generation import generate

    ctx = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(10))
    kw = dict(max_new_tokens=4, chat_template=False, gamma=2)
    good = generate(llama, tokenizer, ctx, "Where?", "full", speculative=f"model:{variant}", **kw)
    assert good.speculation is not None
    _rewrite(copy, lambda t: {k: v * 1000 for k, v in t.items()}, forge=False)
    with pytest.raises(LonglabError, match=r"does not match the SHA-256"):
        generate(llama, tokenizer, ctx, "Where?", "full", speculative=f"model:{copy}", **kw)
