"""IndexMem (issue 4 item 5): learned indexer + latent memory of evicted tokens.

The readout formula is checked against brute-force full attention with an exact feature map (a test
double: one-hot key features over the evicted set); the policy's budget and memory write on a
hand-built layer; training, loading and generation end to end on a tiny model built in code."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabLayer
from longlab.cli import main as cli_main
from longlab.engine.stream import Stream
from longlab.generation import generate
from longlab.kv.indexmem import (
    IndexMem,
    indexer_logits,
    init_layer,
    load_weights,
    log_features,
    manifest_path,
    memory_write,
    model_key,
    residual_attention,
)
from longlab.recipe import LonglabError, parse_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


def _full_attention(q, k, v, scaling):
    # q [B, H, t, D], k/v [B, H_kv, T, D] -> [B, H, t, D], every key visible
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.softmax((q @ k.transpose(-1, -2)) * scaling, -1) @ v


# ------------------------------------------------------------------------------------- (a) exact phi
@pytest.mark.parametrize("shift", [0.0, 30.0], ids=["logits-small", "logits-large"])
def test_exact_feature_map_readout_equals_full_attention(shift):
    """B2-H4-Hkv2-t3-T20-D8: with phi(q).phi(k_j) = exp(s q.k_j) for the evicted keys (one-hot key
    features over the slots, query features the exact logits), the residual readout over the kept keys
    is full attention over kept + evicted; the memory is written in two evictions (stabilised)."""
    B, H, H_kv, t, T, D = 2, 4, 2, 3, 20, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, t, D, generator=g)
    k = torch.randn(B, H_kv, T, D, generator=g)
    v = torch.randn(B, H_kv, T, D, generator=g)
    k[:, :, 5] += shift / 8 * q[:, ::2].mean(2)  # one very large logit: exercises the shared max
    s = D**-0.5
    evict = torch.rand(B, H_kv, T, generator=g) < 0.6  # per-head evicted sets
    first = evict & (torch.arange(T) < T // 2)
    # test double: log phi(k_j) = one-hot over the T slots; log phi(q)_j = s q.k_j (query head's KV head)
    eye = torch.full((T, T), float("-inf")).fill_diagonal_(0.0)
    logf_k = eye.expand(B, H_kv, T, T)  # [B, H_kv, T, d_f = T]
    logf_q = (q @ k.repeat_interleave(H // H_kv, 1).transpose(-1, -2)) * s  # [B, H, t, T]
    M, n = torch.zeros(B, H_kv, T, D), torch.zeros(B, H_kv, T)
    c = torch.full((B, H_kv), float("-inf"))
    M, n, c = memory_write(M, n, c, logf_k, v, first)
    M, n, c = memory_write(M, n, c, logf_k, v, evict & ~first)
    kept = (~evict)[:, :, None, :].expand(B, H_kv, t, T)  # [B, H_kv, t, T]
    out = residual_attention(q, k, v, kept, s, logf_q, (M, n, c))
    torch.testing.assert_close(out, _full_attention(q, k, v, s), rtol=1e-5, atol=1e-5)


def test_indexer_formula_brute_force():
    """B1-H4-Hkv2-t3-T7-D8: I(t, j) = sum_m w_{t,m} ReLU(q^I_{t,m} . k^I_j), term by term."""
    H, H_kv, t, T, D = 4, 2, 3, 7, 8
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, H, t, D, generator=g), torch.randn(1, H_kv, T, D, generator=g)
    wq, wk = torch.randn(H * D, 4 * 5, generator=g), torch.randn(H_kv * D, 5, generator=g)
    ww, wb = torch.randn(H * D, 4, generator=g), torch.randn(4, generator=g)
    got = indexer_logits(q, k, wq, wk, ww, wb)[0]
    for i in range(t):
        x = q[0, :, i].reshape(-1)  # concat over query heads
        w = x @ ww + wb
        for j in range(T):
            kI = k[0, :, j].reshape(-1) @ wk
            want = sum(w[m] * torch.relu((x @ wq[:, 5 * m : 5 * m + 5]) @ kI) for m in range(4))
            torch.testing.assert_close(got[i, j], want, rtol=1e-4, atol=1e-4)


def test_empty_memory_is_attention_over_kept_keys():
    B, H, H_kv, t, T, D = 1, 4, 2, 2, 16, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, H, t, D, generator=g), *torch.randn(2, B, H_kv, T, D, generator=g)
    mask = torch.rand(B, H_kv, t, T, generator=g) < 0.7
    empty = (torch.zeros(B, H_kv, 64, D), torch.zeros(B, H_kv, 64), torch.full((B, H_kv), float("-inf")))
    p = init_layer(H, H_kv, D, D**-0.5, g)
    logf_q = log_features(q, p["fq_w"], p["fq_b"], p["fq_a"])
    out = residual_attention(q, k, v, mask, D**-0.5, logf_q, empty)
    torch.testing.assert_close(out, residual_attention(q, k, v, mask, D**-0.5))
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- weights for tiny models
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(d) `longlab train indexmem` on tiny-llama for 2 texts, into a private longlab cache."""
    root = tmp_path_factory.mktemp("llcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("LONGLAB_CACHE", str(root))
    try:
        code = cli_main(
            ["train", "indexmem", "--model", "tiny-llama", "--max-steps", "2", "--seq-len", "160"]
        )
    finally:
        mp.undo()
    assert code == 0
    files = sorted((root / "indexmem").glob("*.safetensors"))
    assert len(files) == 1
    return root, files[0]


def test_training_writes_safetensors_and_manifest(trained, llama):
    _, path = trained
    w = load_weights(path)
    man = w.manifest
    assert path.stem == model_key(llama.config)
    assert manifest_path(path).is_file()
    from longlab.safeio import new_file_mode  # a new file's usual mode, not mkstemp's 0o600
    assert path.stat().st_mode & 0o777 == manifest_path(path).stat().st_mode & 0o777 == new_file_mode()
    assert man["model"] == "tiny-llama" and man["num_layers"] == llama.config.num_hidden_layers
    assert (man["num_heads"], man["num_kv_heads"], man["head_dim"]) == (4, 2, 16)
    assert man["training"]["forwards"] == 2 and man["training"]["optimizer_steps"] == 8
    assert {"indexer_kl", "memory_mse_ratio"} <= set(man["loss"]) and man["longlab_version"]
    assert w.layers[0]["wq"].shape == (4 * 16, 4 * 64)


def test_default_weights_load_and_generate(trained, llama, tokenizer, text, monkeypatch):
    root, path = trained
    monkeypatch.setenv("LONGLAB_CACHE", str(root))
    for recipe in ("indexmem@0.5", f"indexmem@0.75:weights={path}", "indexmem:budget=60,memory=false"):
        result = generate(
            llama, tokenizer, text, "Which box holds item 3?", recipe, max_new_tokens=6, chunk_size=128
        )
        assert isinstance(result.text, str) and result.kv_bytes_after < result.kv_bytes_before, recipe


def test_memory_changes_decode_and_stays_finite(trained, llama, tokenizer, text):
    _, path = trained
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:300]
    logits = {}
    for memory in (True, False):
        stream = Stream(llama, _cache(f"indexmem@0.8:weights={path},memory={str(memory).lower()}"), 1)
        stream.feed([ids], chunk_size=100, compress="chunk")
        layer = stream.cache.layers[0]
        assert int(layer.lengths().max()) <= 61  # ceil(0.2 * 300) = 60 entries per head
        assert ("indexmem_M" in layer.state) == memory
        logits[memory] = stream.feed([ids[:5]], compress="none")
    assert torch.isfinite(logits[True]).all()
    assert not torch.allclose(logits[True], logits[False])


def _cache(recipe):
    from longlab.cache import LonglabCache

    return LonglabCache(recipe)


# ----------------------------------------------------------------------------------- (b) empty memory
def test_empty_memory_equals_dense_model(trained, tiny_models, tokenizer, text):
    """No eviction yet, so the memory is empty: the policy's own attention equals the sdpa model."""
    _, path = trained
    model, ref = tiny_models["tiny-llama"]
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:200]])
    stream = Stream(model, _cache(f"indexmem@0.5:weights={path}"), 1)
    got = stream.feed(ids.tolist(), chunk_size=512, compress="none")
    with torch.no_grad():
        want = ref(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------- (c) budget, write
@dataclasses.dataclass
class _FixedImportance(IndexMem):
    """Test double: importance r given by the test, feature maps from ``init_layer``."""

    r: torch.Tensor | None = None

    def _layer_weights(self, ctx):
        return init_layer(2, 1, 4, 0.5, torch.Generator().manual_seed(3))

    def _importance(self, ctx, w, rows):
        return self.r


def test_keeps_sinks_window_and_top_by_importance():
    """B1-H2-Hkv1-T60-D4, budget 20, window 8, 4 sinks: keeps 0..3, 52..59 and the 8 best others;
    the memory holds exactly phi(k_j) v_j summed over the other 40."""
    T, D = 60, 4
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    layer = LonglabLayer()
    layer.update(k, v)
    r = torch.rand(1, T, generator=g)
    policy = _FixedImportance(budget=20, window_size=8, r=r)
    q = torch.randn(1, 2, 8, D, generator=g)
    ctx = LayerContext(0, 1, None, "prefill", q, 0.5, layer.index[:, 0, -8:], layer=layer)
    keep = policy.select(ctx)[0, 0]
    expected = set(range(4)) | set(range(52, 60))
    expected |= set(r[0, 4:52].topk(8).indices.add(4).tolist())
    assert set(keep.nonzero().flatten().tolist()) == expected and int(keep.sum()) == 20
    w = policy._layer_weights(ctx)
    lf = log_features(k, w["fk_w"], w["fk_b"], w["fk_a"])[0, 0][~keep]  # [40, d_f]
    scale = torch.exp(layer.state["indexmem_c"])[0, 0]
    torch.testing.assert_close(layer.state["indexmem_n"][0, 0] * scale, lf.exp().sum(0))
    torch.testing.assert_close(layer.state["indexmem_M"][0, 0] * scale, lf.exp().T @ v[0, 0][~keep])


# --------------------------------------------------------------------------------- (e), (f) errors
def test_missing_weights_name_the_train_command(llama, tokenizer, text, tmp_path, monkeypatch):
    monkeypatch.setenv("LONGLAB_CACHE", str(tmp_path))
    with pytest.raises(LonglabError, match="longlab train indexmem --model"):
        generate(llama, tokenizer, text, "Which box?", "indexmem@0.5", max_new_tokens=2)
    with pytest.raises(LonglabError, match="weights not found"):
        generate(llama, tokenizer, text, "Which box?", f"indexmem@0.5:weights={tmp_path}/x.safetensors")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("indexmem@1.5", ("compression_ratio", "[0, 1)")),
        ("indexmem:gamma=0", ("gamma", "(0, 1]")),
        ("indexmem:window_size=0", ("window_size", "[1, 1048576]")),
        ("indexmem:sink_size=-1", ("sink_size", "[0, 1048576]")),
        ("indexmem:memory=3", ("memory", "true or false")),
        ("indexmem:budget=0", ("budget", "[1, 1048576]")),
    ],
)
def test_bad_parameters(spec, words):
    with pytest.raises(LonglabError) as err:
        parse_recipe(spec)
    for word in words:
        assert word in str(err.value)


def test_bad_train_arguments(capsys):
    assert cli_main(["train", "indexmem", "--model", "tiny-llama", "--minutes", "0"]) == 2
    assert "minutes" in capsys.readouterr().err


# ------------------------------------------------------------- issue 10 item 11: training and weights
@pytest.mark.parametrize("lr", ["nan", "0", "-0.001", "inf"])
def test_train_refuses_a_non_finite_or_non_positive_lr_before_loading(lr, tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    for flag in ("--lr", "--lr-memory"):
        assert cli_main(["train", "indexmem", "--model", "tiny-llama", flag, lr, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{flag} must be " in err and "in (0, 1], got" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def _train(llama, tokenizer, out, **kw):
    from longlab.kv.indexmem_train import train_indexmem

    return train_indexmem(llama, tokenizer, model_name="tiny-llama", max_steps=1, seq_len=160,
                          inner_steps=1, out=out, progress=False, **kw)


def test_a_non_finite_loss_stops_training_and_writes_nothing(llama, tokenizer, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    import longlab.kv.indexmem_train as train

    out = tmp_path / "w.safetensors"  # an earlier IndexMem output: a failed run leaves it as it was
    save_file({"x": torch.zeros(2)}, str(out), metadata={"format": train.FORMAT})
    before = out.read_bytes()
    monkeypatch.setattr(train, "_layer_losses", lambda *a: (torch.tensor(float("nan")), torch.tensor(0.0)))
    with pytest.raises(LonglabError, match=r"loss became nan at optimizer step 1 .*nothing was written"):
        _train(llama, tokenizer, out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_train_indexmem_never_overwrites_a_users_file(llama, tokenizer, tmp_path):
    user = tmp_path / "w.safetensors"
    user.write_bytes(b"previous weights")  # not written by longlab
    with pytest.raises(LonglabError, match=r"--out: .*longlab did not write it"):
        _train(llama, tokenizer, user)
    assert user.read_bytes() == b"previous weights"
    notes = tmp_path / "notes.json"  # the manifest beside weights named notes.safetensors
    notes.write_text("{}")
    with pytest.raises(LonglabError, match=r"--out: .*notes.json.*longlab did not write it"):
        _train(llama, tokenizer, tmp_path / "notes.safetensors")
    assert notes.read_text() == "{}"
    with pytest.raises(LonglabError, match=r"--out: .*not a .safetensors name"):
        _train(llama, tokenizer, tmp_path / "thesis.tex")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "w.safetensors"]
    assert llama.config._attn_implementation == "longlab"  # the capture is undone


def test_non_finite_weights_are_never_saved(llama, tokenizer, tmp_path, monkeypatch):
    import longlab.kv.indexmem_train as train

    real = train._layer_losses

    def poisoning(p, *args):  # a finite loss, then a weight overflows (as a huge lr would make it)
        losses = real(p, *args)
        with torch.no_grad():
            p["gate_b"].fill_(float("inf"))
        return losses

    monkeypatch.setattr(train, "_layer_losses", poisoning)
    with pytest.raises(LonglabError, match=r"weights layers\.0\.gate_b.* not finite; nothing was written"):
        _train(llama, tokenizer, tmp_path / "w.safetensors")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "damage",
    ["random", "truncated", "nan", "nan-forged", "rescaled", "partial-forged", "manifest", "no-record"],
)
def test_an_unusable_weights_file_is_a_clear_error(trained, damage, llama, tokenizer, text, tmp_path):
    """Every damage is refused: the manifest's record (size, SHA-256, tensor list) catches a changed file;
    ``-forged`` rewrites the record to match the damaged file, so the check behind the digest (finite
    values, the tensors every layer needs) is what refuses it."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from longlab.safeio import file_record

    _, good = trained
    path = tmp_path / "w.safetensors"
    shutil.copy(good, path)
    shutil.copy(manifest_path(good), manifest_path(path))
    flat = load_file(str(good))
    if damage == "random":
        path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                         .to(torch.uint8).numpy().tobytes())
    elif damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif damage.startswith("nan"):
        flat["layers.1.wq"][0, 0] = float("nan")
    elif damage.startswith("rescaled"):
        flat = {k: v * 1000 for k, v in flat.items()}
    elif damage == "partial-forged":
        flat = {k: v for k, v in flat.items() if not k.startswith("layers.1.")}
    elif damage == "manifest":
        manifest_path(path).write_text("{not json", encoding="utf-8")
    if damage.startswith(("nan", "rescaled", "partial")):
        with safe_open(str(good), "pt") as fh:
            save_file(flat, str(path), metadata=fh.metadata())  # same header: same size
    if damage.endswith("forged") or damage == "no-record":
        manifest = json.loads(manifest_path(path).read_text())
        manifest["weights_file"] = file_record(path, flat)
        if damage == "no-record":  # a manifest from before records existed
            del manifest["weights_file"]
        manifest_path(path).write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(LonglabError) as err:
        generate(llama, tokenizer, text, "Which box?", f"indexmem@0.5:weights={path}", max_new_tokens=2)
    message = str(err.value)
    assert f"cannot use the weights {path}" in message
    model = "MODEL" if damage == "manifest" else "tiny-llama"  # an unreadable manifest hides the model
    assert f"train them again: longlab train indexmem --model {model} --out {path}" in message
    expected = {
        "random": r"has 4,096 bytes, the manifest says [\d,]+ \(truncated or partial\)",
        "truncated": r"truncated or partial",
        "nan": r"does not match the SHA-256 in its manifest",
        "nan-forged": r"tensor layers\.1\.wq in w\.safetensors has non-finite values",
        "rescaled": r"does not match the SHA-256 in its manifest",
        "partial-forged": r"it lacks tensor layers\.1\.",
        "manifest": r"not readable JSON",
        "no-record": r"written before IndexMem manifests recorded the weights' SHA-256",
    }[damage]
    assert re.search(expected, message), message
    assert json.loads(manifest_path(good).read_text())["format"]  # the fixture is untouched
