"""HiCo token dropping inside the prefill forward (longlab.compress.hico_forward)."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.compress.hico_forward import HiCoForward, decoder_layers
from longlab.pipeline import Stream, encode_prompts
from longlab.recipe import LonglabError

CTX = " ".join(f"Record {i} says the shelf {i * 5 % 11} holds item {i * 3 % 17}." for i in range(30))
QUESTION = "Which shelf holds item 7?"


def _prompt(tokenizer) -> list[int]:
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    return ctx + q, len(q)


def _stream(model, recipe: str = "full") -> Stream:
    return Stream(model, LonglabCache(recipe), 1)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model6(request):
    from longlab.models import build_tiny_model

    return build_tiny_model(request.param, num_hidden_layers=6)


def test_keep_ratio_one_is_a_plain_prefill(model6, tokenizer, one_thread):
    ids, nq = _prompt(tokenizer)
    plain = _stream(model6)
    a = plain.feed([ids], chunk_size=len(ids), compress="end")
    hico = _stream(model6)
    b = HiCoForward(0.0, protect=nq).prefill(hico, [ids])
    assert torch.equal(a, b)
    for la, lb in zip(plain.cache.layers, hico.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.index, lb.index)
    assert plain.decode(a, 5, set()) == hico.decode(b, 5, set())


def test_dropping_equals_running_the_later_layers_on_the_kept_rows(model6, tokenizer, one_thread):
    """One stage boundary b: layers >= b run only on the kept rows of the plain forward's hidden states
    (at their true RoPE positions); the logits equal that hand-run reference."""
    ids, nq = _prompt(tokenizer)
    method = HiCoForward(0.6, stages=(0.5,), protect=nq)
    stream = _stream(model6)
    logits = method.prefill(stream, [ids])
    b = method.info["layers"][0]
    (kept,) = method.info["kept_positions"][0]
    n = len(ids)
    assert len(kept) == math.ceil(0.4 * (n - nq) - 1e-9) + nq and kept == sorted(kept)
    assert kept[-nq:] == list(range(n - nq, n))
    inner = model6.get_decoder()
    with torch.inference_mode():
        x = torch.tensor([ids])
        hs = model6(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        pos = torch.tensor([kept])
        h = hs[b][:, kept]
        pe = inner.rotary_emb(h, pos)
        for layer in decoder_layers(model6)[b:]:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        ref = model6.lm_head(inner.norm(h[:, -1]))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    for i, layer in enumerate(stream.cache.layers):  # the cache holds true positions
        held = layer.index[0, 0].tolist()
        assert held == (list(range(n)) if i < b else kept)
        assert int(layer.n_real[0]) == n and layer.n_seen == n
    # decoding continues at position n in every layer (a decode step appends index n)
    stream.feed([[int(logits.argmax())]], compress="none")
    assert all(int(layer.index[0, 0, -1]) == n for layer in stream.cache.layers)


def test_stages_drop_cumulatively_and_save_rows(model6, tokenizer, one_thread):
    ids, nq = _prompt(tokenizer)
    method = HiCoForward(0.75, protect=nq)
    stream = _stream(model6, "snapkv@0.5")  # composes: the cache's own policy compresses at the end
    method.prefill(stream, [ids])
    n = len(ids) - nq
    counts = method.info["tokens_per_stage"]
    assert counts == [len(ids), math.ceil(0.5 * n - 1e-9) + nq, math.ceil(0.25 * n - 1e-9) + nq]
    (s1,), (s2,) = method.info["kept_positions"]
    assert set(s2) <= set(s1) and len(s1) == counts[1] and len(s2) == counts[2]
    sizes = [int(layer.valid[0, 0].sum()) for layer in stream.cache.layers]
    half = math.ceil(0.5 * len(ids))  # snapkv@0.5 keeps half of the stream's tokens, of what a layer holds
    assert sizes == [min(half, c) for c in (counts[0],) * 2 + (counts[1],) * 2 + (counts[2],) * 2]
    assert stream.cache.recipe.kv[0].name == "snapkv"  # the stand-in is gone after the forward


def test_bad_settings_are_refused(model6, tokenizer):
    with pytest.raises(LonglabError, match="compression_ratio"):
        HiCoForward(1.0)
    with pytest.raises(LonglabError, match="stages"):
        HiCoForward(0.5, stages=(0.6, 0.3))
    with pytest.raises(LonglabError, match="protect"):
        HiCoForward(0.5, protect=0)
    with pytest.raises(LonglabError, match="equal length"):
        HiCoForward(0.5).prefill(_stream(model6), [[1, 2, 3], [1, 2]])
    with pytest.raises(LonglabError, match="layers"):
        HiCoForward(0.5, stages=(0.01,)).prefill(_stream(model6), [list(range(5, 40))])


def test_sliding_window_models_are_refused(tiny_models):
    gemma = tiny_models["tiny-gemma3"][0]  # 4 layers, three of them sliding-window
    with pytest.raises(LonglabError, match="sliding-window"):
        HiCoForward(0.5, stages=(0.5,)).prefill(_stream(gemma), [list(range(5, 60))])
