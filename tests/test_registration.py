"""Registration of the "longlab" attention is explicit and undoable; the cache reaches the hook through the
kwargs transformers forwards (no global lookup), so two caches in one process never see each other."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from longlab import LonglabCache, use_longlab_attention
from longlab.hook import ATTN_NAME, register_attention, unregister_attention
from longlab.models import build_tiny_model


def test_use_longlab_attention_restores_the_model_and_the_registry(one_thread):
    model = build_tiny_model("tiny-llama", attn="sdpa")
    unregister_attention()
    try:
        assert ATTN_NAME not in AttentionInterface._global_mapping
        ids = torch.arange(40)[None] % 200
        with use_longlab_attention(model):
            assert model.config._attn_implementation == ATTN_NAME
            cache = LonglabCache("streaming:budget=16,sink_size=4")
            model(ids, cache=cache, use_cache=True)
            assert cache.hook_calls == 1
            assert max(int(n.max()) for n in cache.lengths()) == 16  # the recipe acted
        assert model.config._attn_implementation == "sdpa"
        assert ATTN_NAME not in AttentionInterface._global_mapping
    finally:
        register_attention()  # other tests' models use the name


def test_use_longlab_attention_keeps_a_registration_made_before(one_thread):
    register_attention()
    model = build_tiny_model("tiny-llama", attn="sdpa")
    with use_longlab_attention(model):
        pass
    assert ATTN_NAME in AttentionInterface._global_mapping


def test_two_caches_interleaved_do_not_mix(llama, one_thread):
    """Each forward's hook acts on the cache that forward was given (formerly a thread-local lookup)."""
    ids_a = torch.arange(48)[None] % 200
    ids_b = (torch.arange(48)[None] * 7) % 200
    a, b = LonglabCache("streaming:budget=16,sink_size=4"), LonglabCache("full")
    la = llama(ids_a, cache=a, use_cache=True).logits
    lb = llama(ids_b, cache=b, use_cache=True).logits
    assert max(int(n.max()) for n in a.lengths()) == 16
    assert min(int(n.min()) for n in b.lengths()) == 48
    ref = llama(ids_b, cache=LonglabCache("full"), use_cache=True).logits
    torch.testing.assert_close(lb, ref)
    assert la.shape == lb.shape
