"""LonglabCache: true positions after eviction (invariant 2), honest bytes (invariant 3), repacking."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from longlab.cache import LonglabCache, LonglabLayer
from longlab.engine.stream import Stream


def test_next_position_is_tokens_seen_not_cache_length(tiny_models):
    # StreamingLLM keeps positions {0..3} U {44..59} in every layer and head; the reference is
    # transformers' own DynamicCache sliced to those entries, with the next token at position 60.
    model, ref = tiny_models["tiny-llama"]
    ids = torch.randint(0, 256, (1, 61), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stream = Stream(model, LonglabCache("streaming:budget=20"), 1)
        stream.feed([ids[0, :60].tolist()], chunk_size=64)
        cache = stream.cache
        assert cache.get_seq_length() == 60
        assert cache.layers[0].keys.shape[-2] == 20
        ours = stream.feed([[int(ids[0, 60])]])

        dc = DynamicCache()
        ref(ids[:, :60], cache=dc, use_cache=True)
        kept = torch.tensor(list(range(4)) + list(range(44, 60)))
        for layer in dc.layers:
            layer.keys, layer.values = layer.keys[:, :, kept], layer.values[:, :, kept]
        expected = ref(
            ids[:, 60:],
            cache=dc,
            position_ids=torch.tensor([[60]]),
            attention_mask=torch.ones(1, 21, dtype=torch.long),
        ).logits[:, -1]
    assert (ours - expected).abs().max() <= 1e-4
    assert cache.layers[0].index[0, 0].tolist() == list(range(4)) + list(range(44, 61))


def _layer(B=1, H_kv=2, T=10, D=4):
    layer = LonglabLayer()
    layer.update(torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D))
    return layer


def test_keep_repacks_per_head_and_preserves_order():
    layer = _layer()
    keys = layer.keys.clone()
    mask = torch.zeros(1, 2, 10, dtype=torch.bool)
    mask[0, 0, [1, 4, 8]] = True
    mask[0, 1, [0, 9]] = True
    layer.keep(mask)
    assert layer.keys.shape == (1, 2, 3, 4)  # padded to the longest head
    assert layer.index[0, 0].tolist() == [1, 4, 8]
    assert layer.index[0, 1].tolist() == [0, 9, -1]  # empty slot
    assert torch.equal(layer.keys[0, 0], keys[0, 0, [1, 4, 8]])
    assert torch.equal(layer.keys[0, 1, :2], keys[0, 1, [0, 9]])
    assert layer.lengths().tolist() == [[3, 2]]


def test_nbytes_equals_bytes_of_held_tensors():
    layer = _layer(B=2, H_kv=3, T=17, D=8)
    layer.extras["state"] = torch.zeros(2, 3, 17)
    held = [layer.keys, layer.values, layer.index, layer.extras["state"]]
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)
    layer.keep(torch.rand(2, 3, 17) > 0.5)
    held = [layer.keys, layer.values, layer.index, layer.extras["state"]]
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)


def test_mark_padding_assigns_true_positions():
    layer = _layer(B=2, H_kv=1, T=5)
    layer.mark_padding(torch.tensor([[False, False, True, True, True], [True] * 5]))
    assert layer.index[0, 0].tolist() == [-1, -1, 0, 1, 2]
    assert layer.index[1, 0].tolist() == [0, 1, 2, 3, 4]
    assert layer.n_real.tolist() == [3, 5]
    layer.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    assert layer.index[:, 0, -1].tolist() == [3, 5]


def test_sliding_window_layers_hold_only_the_window(tiny_models):
    model, _ = tiny_models["tiny-gemma3"]  # layers 0-2 slide over 32 tokens, layer 3 is global
    with torch.no_grad():
        stream = Stream(model, LonglabCache("full"), 1)
        stream.feed([list(range(200))], chunk_size=50)
    lengths = [int(n) for n in (layer.lengths().max() for layer in stream.cache.layers)]
    assert lengths[3] == 200
    assert all(n <= 32 + 64 for n in lengths[:3])  # window + trimming slack
    # the uncompressed reference holds a sliding layer's window too (as transformers' sliding cache)
    full = stream.cache.full_nbytes()
    layer = stream.cache.layers[0]
    per_token = 2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size()
    assert full == per_token * (200 + 3 * 32)
