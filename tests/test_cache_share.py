"""A shared fork (``Stream.fork(share=True)``, copy on write) reads the parent's buffers without copying
them, and neither side sees the other's later writes: the same tokens as a deep fork."""

from __future__ import annotations

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.hook import ChunkRecorder, replay_compression
from longlab.models import build_tiny_model
from longlab.recipe import LonglabError, Recipe

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [30 + (i * 11) % 190 for i in range(120)]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-llama", num_hidden_layers=2)


def _greedy(stream, logits, n):
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[0].argmax()))
        logits = stream.feed([[tokens[-1]]], compress="none")
    return tokens


def _prefilled(model):
    stream = Stream(model, LonglabCache(None), 1)
    recorder = ChunkRecorder()
    stream.cache.recipe = Recipe(kv=[recorder])
    logits = stream.feed([PROMPT], chunk_size=64, compress="end")
    stream.cache.recipe = Recipe()
    return stream, recorder, logits


@pytest.mark.parametrize("recipe", ["snapkv@0.5", "streaming@0.5", "knorm@0.75", "full"])
def test_shared_fork_decodes_as_a_deep_fork(model, recipe):
    shared, recorder, logits = _prefilled(model)
    deep = shared.fork(recipe)
    cow = shared.fork(recipe, share=True)
    for stream in (deep, cow):
        replay_compression(stream.cache, recorder.records)
    assert torch.equal(cow.cache.layers[0].keys, deep.cache.layers[0].keys)
    before = [layer.keys.clone() for layer in shared.cache.layers]
    n_real = shared.cache.layers[0].n_real.clone()
    # decode the shared fork first: the parent's slots, positions and next position stay untouched
    cow_tokens = _greedy(cow, logits, 6)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, shared.cache.layers))
    assert torch.equal(shared.cache.layers[0].n_real, n_real) and int(shared.next_pos[0]) == len(PROMPT)
    assert cow_tokens == _greedy(deep, logits, 6)
    # and the parent's own appends do not reach a second shared fork made before them
    twin = shared.fork(recipe, share=True)
    _greedy(shared, logits, 3)
    assert twin.cache.layers[0].keys.shape[2] == len(PROMPT)
    assert torch.equal(twin.cache.layers[0].keys, before[0])


def test_shared_fork_reads_the_parent_buffers(model):
    shared, _, _ = _prefilled(model)
    cow = shared.fork("full", share=True)
    assert cow.cache.layers[0].keys.data_ptr() == shared.cache.layers[0].keys.data_ptr()
    assert cow.cache is not shared.cache and cow.cache.layers[0] is not shared.cache.layers[0]


def test_share_refuses_a_cache_with_outside_resources(model):
    shared, _, _ = _prefilled(model)

    class _Hooks:
        def release(self):
            pass

    shared.cache.resources["hooks"] = _Hooks()
    with pytest.raises(LonglabError, match="cannot share"):
        shared.cache.share()


def _layer(T, seed, positions=None):
    from longlab.cache import LonglabLayer

    gen = torch.Generator().manual_seed(seed)
    layer = LonglabLayer()
    layer.lazy_initialization(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
    layer.update(torch.randn(1, 2, T, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen))
    if positions is not None:  # an evicted layer: slots hold these positions of a longer stream
        layer.index = torch.tensor(positions, dtype=torch.int32).expand(1, 2, -1).contiguous()
        layer.n_real = torch.tensor([max(positions) + 1])
    return layer


@pytest.mark.parametrize("T_q", [1, 3])
def test_stacked_rows_attend_over_their_own_slots_only(T_q):
    """Rows of unequal length stacked with leading empty slots: attention per row over its own slots
    (``lead_pad``) equals one padded call, and both equal each row alone."""
    from longlab.attention import LayerContext, layer_attention
    from longlab.cache import LonglabLayer

    rows = [_layer(12, 0), _layer(4, 1, [0, 5, 9, 11]), _layer(6, 2, [0, 1, 2, 3, 10, 11])]
    layer = LonglabLayer.stacked(rows, reserve=5)
    assert layer.lead_pad.tolist() == [0, 8, 6] and layer.keys.shape[2] == 12
    assert layer.__dict__["_slots_keys"][0].shape[2] == 17  # reserved spare slots, owned
    new_k, new_v = torch.randn(3, 2, T_q, 8), torch.randn(3, 2, T_q, 8)
    layer.update(new_k, new_v)  # appends after each row's slots: rows stay contiguous
    assert layer.__dict__["_slots_keys"][0].shape[2] == 17 and layer.lead_pad is not None
    q = torch.randn(3, 4, T_q, 8)  # 2 query heads per KV head
    qidx = torch.arange(12, 12 + T_q)[None].expand(3, -1)

    def attend(lyr, rows_q=slice(None)):
        ctx = LayerContext(0, 1, None, "decode" if T_q == 1 else "prefill", q[rows_q], 8**-0.5,
                           qidx[rows_q], layer=lyr)
        return layer_attention(ctx, None)

    ragged = attend(layer)
    lead = layer.lead_pad
    layer.lead_pad = None
    padded = attend(layer)
    layer.lead_pad = lead
    torch.testing.assert_close(ragged, padded, atol=1e-6, rtol=1e-5)
    for b, row in enumerate(rows):
        row.update(new_k[b : b + 1], new_v[b : b + 1])
        torch.testing.assert_close(ragged[b : b + 1], attend(row, slice(b, b + 1)), atol=1e-6, rtol=1e-5)
    layer.batch_select_indices(torch.tensor([2, 0]))  # dropping finished rows keeps each row's lead
    assert layer.lead_pad.tolist() == [6, 0]
