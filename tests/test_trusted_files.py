"""Lab checkpoints and PM-KVQ allocations are checked before they are trusted (issue 28): every damaged
or hand-edited file gives a LonglabError naming the file and what is wrong, never a traceback, and a
manifest naming a huge model allocates nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from longlab.lab.train import TrainConfig, load_checkpoint, train
from longlab.recipe import LonglabError
from longlab.safeio import file_record

# ------------------------------------------------------------------------------------ lab checkpoints


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    cfg = TrainConfig(mixer="softmax", task="mqar:queries=2", train_len=24, steps=2, dim=16, n_layers=1,
                      n_heads=2, batch=2, ckpt_every=2)
    out = tmp_path_factory.mktemp("lab") / "run"
    train(cfg, out, progress=False, log=None)
    return out


@pytest.fixture
def run(lab_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lab_run, out)
    return out


def _weights(run):
    manifest = json.loads((run / "manifest.json").read_text())
    return run / manifest["checkpoint"] / "model.safetensors"


def _edit(run, change):
    manifest = json.loads((run / "manifest.json").read_text())
    change(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))


def _rewrite(path, change):
    with safe_open(str(path), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors = change(tensors)
    save_file(tensors, str(path))
    return tensors


def test_a_good_checkpoint_loads(run):
    model, cfg, manifest = load_checkpoint(run)
    assert manifest["step"] == 2 and cfg.steps == 2 and not model.training


def test_truncated_checkpoint_is_refused(run):
    path = _weights(run)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(LonglabError, match=r"cannot read .*model\.safetensors \(SafetensorError"):
        load_checkpoint(run)


def test_partial_checkpoint_is_refused(run):
    _rewrite(_weights(run), lambda t: dict(list(sorted(t.items()))[:1]))
    with pytest.raises(LonglabError, match=r"does not hold this model's tensors \(\d+ of \d+ missing"):
        load_checkpoint(run)


def test_nan_checkpoint_is_refused(run):
    _rewrite(_weights(run), lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()})
    with pytest.raises(LonglabError, match=r"has non-finite values \(NaN or inf\)"):
        load_checkpoint(run)


def test_a_checkpoint_with_a_record_is_checked_against_it(run):
    """A manifest that records the file (``weights_file``) refuses a rescaled (x1000) file by its digest."""
    path = _weights(run)
    with safe_open(str(path), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    _edit(run, lambda m: m.update(weights_file=file_record(path, tensors)))
    load_checkpoint(run)  # the record matches: it loads
    _rewrite(path, lambda t: {k: v * 1000 for k, v in t.items()})
    with pytest.raises(LonglabError, match=r"does not match the SHA-256 in its manifest"):
        load_checkpoint(run)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.update(checkpoint="../../x"), r"checkpoint='\.\./\.\./x' is not checkpoint-2"),
        (lambda m: m.update(checkpoint="checkpoint-1"), r"checkpoint='checkpoint-1' is not checkpoint-2"),
        (lambda m: m.update(step="2"), r"step='2' is not a step count"),
        (lambda m: m["train"].update(surprise=1), r"holds settings longlab cannot use: .*surprise"),
        (lambda m: m["train"].update(steps=-1), r"holds settings longlab cannot use: --steps"),
        (lambda m: m["model"].update(dim=10**7, mlp_hidden=10**7), r"model settings are not the ones"),
        (lambda m: m.update(history=None), r"history is not a list"),
    ],
)
def test_an_edited_lab_manifest_is_refused(run, change, match):
    _edit(run, change)
    with pytest.raises(LonglabError, match=match):
        load_checkpoint(run)


def test_a_manifest_naming_a_huge_model_allocates_nothing(run):
    """Train and model settings agree on a 10^5-wide model: compared on the meta device, refused at once."""
    def huge(m):
        m["train"].update(dim=100_000)
        m["model"].update(dim=100_000)

    _edit(run, huge)
    with pytest.raises(LonglabError, match=r"tensor .* the model needs torch\.float32 \[.*100000"):
        load_checkpoint(run)


@pytest.mark.parametrize("text", ["{not json", '{"format": NaN}', "[]"])
def test_an_unreadable_lab_manifest_is_refused(run, text):
    (run / "manifest.json").write_text(text)
    with pytest.raises(LonglabError, match=r"cannot read .*manifest\.json|is not a longlab-lab-checkpoint"):
        load_checkpoint(run)


# ------------------------------------------------------------------------------------ PM-KVQ allocations

GOOD = {
    "format": "longlab.pmkvq.allocation",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "layers": [
        {"layer": 0, "bits": 8, "budget_bytes": 300_000, "smooth_scale": [[1.0] * 16, [2.0] * 16]},
        {"layer": 1, "bits": 2, "budget_bytes": 110_000, "smooth_scale": None},
    ],
    "settings": {"sink": 1, "window": 128, "group_size": 128},
}


def _alloc(tmp_path, text):
    from longlab.quant import load_allocation

    path = tmp_path / "alloc.json"
    path.write_text(text)
    return lambda: load_allocation(path)


def test_a_good_allocation_loads(tmp_path):
    assert _alloc(tmp_path, json.dumps(GOOD))()["num_layers"] == 2


def _with(layer=None, **top):
    data = json.loads(json.dumps(GOOD))
    data.update(top)
    if layer:
        data["layers"][0].update(layer)
    return json.dumps(data)


@pytest.mark.parametrize(
    "text, match",
    [
        (_with().replace("300000", "NaN"), r"is not JSON \(NaN is not a number JSON allows"),
        (_with().replace("300000", "Infinity"), r"is not JSON \(Infinity"),
        (_with().replace("300000", "1e400"), r"budget_bytes must be a positive number, got inf"),
        (_with().replace("300000", "1" + "0" * 400), r"budget_bytes must be a positive number"),
        (_with({"budget_bytes": "300000"}), r"budget_bytes must be a positive number, got '300000'"),
        (_with({"bits": 3}), r"bits must be 16, 8, 4 or 2, got 3"),
        (_with({"smooth_scale": "abc"}), r"smooth_scale must be null or a table"),
        (_with({"smooth_scale": [[1.0] * 16, [1.0] * 15]}), r"smooth_scale must be null or a table"),
        (_with({"smooth_scale": [[1.0] * 16, [-1.0] * 16]}), r"positive finite factors"),
        (_with({"smooth_scale": [[1.0] * 8, [1.0] * 8]}), r"is \[2\]\[8\], the file's model has \[2\]\[16\]"),
        (_with(num_layers=3), r"says num_layers=3 but lists 2 layers"),
        (_with(settings={"window": -1}), r"settings\.window must be an integer >= 1, got -1"),
        (_with(settings=[1]), r"settings must be an object"),
        ("[" * 100_000 + "]" * 100_000, r"is not JSON"),
    ],
)
def test_a_bad_allocation_is_refused(tmp_path, text, match):
    with pytest.raises(LonglabError, match=match):
        _alloc(tmp_path, text)()


def test_an_allocation_that_is_not_a_regular_file_is_refused(tmp_path):
    from longlab.quant import load_allocation

    with pytest.raises(LonglabError, match="is not a regular file"):
        load_allocation(tmp_path)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.json")
        with pytest.raises(LonglabError, match="is not a regular file"):  # refused without opening it
            load_allocation(tmp_path / "fifo.json")
