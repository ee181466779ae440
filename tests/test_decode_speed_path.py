"""The decode step's cost stays one attention call over the held keys (issue decode-speed).

A decode step through the hook must not build tensors whose size grows with the cache (visibility masks
over ``T``, copies of the whole layer on append): they are what made the hook ~1.2x slower than
transformers' SDPA path at 8k tokens. The allocation test records, with a ``TorchDispatchMode``, every
tensor an op returns in fresh storage during one decode step, at two context lengths: any allocation
that differs between the two grows with the cache.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from longlab.attention import LayerContext, dense_attention, layer_attention, visibility_mask
from longlab.cache import DECODE_RESERVE, LonglabCache, LonglabLayer
from longlab.engine.stream import Stream


class _Allocations(TorchDispatchMode):
    """Records ``(op, shape)`` of every op output that does not share storage with an input."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _decode_allocations(model, recipe: str, T: int, with_mask: bool) -> Counter:
    """Allocations of the second decode step after a ``T``-token prefill (the first step may grow the
    layers' buffers: that happens once per ``DECODE_RESERVE`` steps)."""
    V = model.config.vocab_size
    stream = Stream(model, LonglabCache(recipe), 1)
    stream.feed([[3 + (7 * i) % (V - 3) for i in range(T)]], chunk_size=128)
    token = torch.tensor([[5]])
    mode = _Allocations()
    with torch.inference_mode():
        for step in range(2):
            mask = torch.ones(1, T + step + 1, dtype=torch.long) if with_mask else None
            with mode if step == 1 else contextlib.nullcontext():
                model(input_ids=token, attention_mask=mask, cache=stream.cache, use_cache=True,
                      logits_to_keep=1)
    return Counter(mode.seen)


@pytest.mark.parametrize(
    "name,recipe",
    [("tiny-llama", "full"), ("tiny-qwen2", "full"), ("tiny-llama", "snapkv@0.5")],
)
def test_decode_step_allocates_nothing_that_grows_with_the_cache(tiny_models, one_thread, name, recipe):
    model, _ = tiny_models[name]
    short, long = (_decode_allocations(model, recipe, T, with_mask=False) for T in (200, 400))
    grows = sorted((short - long) + (long - short))
    assert not grows, f"decode allocations that depend on the cache length: {grows}"
    # with a 2-D padding mask, transformers converts it once per forward ([B, n_seen], one byte per token);
    # nothing per layer may depend on the length
    short, long = (_decode_allocations(model, recipe, T, with_mask=True) for T in (200, 400))
    grows = (short - long) + (long - short)
    assert all(len(shape) == 2 and shape[0] == 1 for _, shape in grows), sorted(grows)
    assert sum(grows.values()) <= 4, sorted(grows)  # at most two such tensors per forward


def _layer(B: int = 1, H_kv: int = 2, T: int = 10, D: int = 4, seed: int = 0) -> LonglabLayer:
    g = torch.Generator().manual_seed(seed)
    layer = LonglabLayer()
    layer.update(torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g))
    return layer


def test_short_appends_grow_the_buffers_once_per_reserve_and_hold_what_cat_would():
    layer = _layer(T=40)
    ref_k, ref_v = layer.keys.clone(), layer.values.clone()
    storages = set()
    g = torch.Generator().manual_seed(1)
    steps = DECODE_RESERVE + 20
    for _ in range(steps):
        k, v = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)
        keys, values = layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=-2), torch.cat([ref_v, v], dim=-2)
        storages.add(keys.untyped_storage().data_ptr())
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    assert len(storages) == 2  # one growth at the first step, one after DECODE_RESERVE steps
    assert layer.index[0, 0].tolist() == list(range(40 + steps))
    assert layer.keys.shape == (1, 2, 40 + steps, 4)
    spare = layer.spare_nbytes()
    per_slot = 2 * (2 * 4 * 4) + 2 * 4  # keys + values fp32, index int32, both heads
    assert 0 < spare <= DECODE_RESERVE * per_slot
    held = (layer.keys, layer.values, layer.index)
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held)


def test_prefill_chunks_allocate_exactly():
    layer = _layer(T=100)
    layer.update(torch.randn(1, 2, 64, 4), torch.randn(1, 2, 64, 4))
    assert layer.spare_nbytes() == 0
    assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()


def test_twins_never_write_into_each_others_spare_slots():
    layer = _layer(T=8)
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # now has spare slots
    for make_twin in (copy.copy, copy.deepcopy):
        twin, held = make_twin(layer), layer.keys.clone()
        twin.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
        layer.update(torch.full((1, 2, 1, 4), 2.0), torch.full((1, 2, 1, 4), 2.0))
        assert torch.equal(twin.keys[:, :, -1], torch.ones(1, 2, 4))
        assert torch.equal(layer.keys[:, :, :-1], held)
        assert torch.equal(layer.keys[:, :, -1], torch.full((1, 2, 4), 2.0))
        assert torch.equal(twin.keys[:, :, :-1], held)


def test_assigned_tensors_are_never_written_past_their_end():
    layer = _layer(T=6)
    buf = torch.zeros(1, 2, 10, 4)
    layer.keys, layer.values = buf[:, :, :6], buf[:, :, :6].clone()  # a view with room after it
    layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert torch.equal(buf, torch.zeros(1, 2, 10, 4))
    assert layer.keys.shape == (1, 2, 7, 4)


def test_slot_flags_follow_appends_padding_eviction_and_assignment():
    layer = _layer(B=2, H_kv=2, T=5)
    assert layer.all_valid and layer.heads_share_slots
    layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert layer.all_valid and layer.heads_share_slots
    layer.mark_padding(torch.tensor([[True], [True]]))  # nothing padded
    assert layer.all_valid
    layer.update(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))
    layer.mark_padding(torch.tensor([[False, True], [True, True]]))
    assert not layer.all_valid and layer.heads_share_slots
    layer = _layer(B=1, H_kv=2, T=6)
    keep = torch.tensor([[[True, False, True, True, False, True], [True, True, False, True, True, True]]])
    layer.keep(keep)  # head 0 keeps 4, head 1 keeps 5: head 0 gets an empty slot
    assert not layer.all_valid and not layer.heads_share_slots
    layer.keep(layer.valid & (layer.index != 1))  # head 1 drops position 1: both hold 4, no empty slot
    assert layer.all_valid and not layer.heads_share_slots
    layer.index = torch.arange(4, dtype=torch.int32).expand(1, 2, 4).clone()
    assert layer.heads_share_slots
    layer.index[0, 1, 0] = -1
    layer.index_changed()
    assert not layer.all_valid and not layer.heads_share_slots


def _ctx(layer: LonglabLayer, q: torch.Tensor) -> LayerContext:
    T_q = q.shape[-2]
    return LayerContext(0, 1, None, "decode" if T_q == 1 else "prefill", q, q.shape[-1] ** -0.5,
                        layer.index[:, 0, -T_q:], None, layer, None)


@pytest.mark.parametrize("case", ["all-valid", "left-padded", "per-head", "padding-query"])
def test_decode_attention_without_the_full_mask_equals_the_masked_reference(case):
    B, H_kv, g, T, D = 2, 2, 3, 12, 8
    layer = _layer(B=B, H_kv=H_kv, T=T, D=D, seed=3)
    if case in ("left-padded", "padding-query"):
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[0, :4] = False
        if case == "padding-query":
            valid[1] = False  # a row of padding only: its query sees no valid key
        layer.mark_padding(valid)
    elif case == "per-head":
        layer.keep(torch.rand(B, H_kv, T, generator=torch.Generator().manual_seed(4)) > 0.4)
    g_ = torch.Generator().manual_seed(5)
    # the decode step's own token
    layer.update(torch.randn(B, H_kv, 1, D, generator=g_), torch.randn(B, H_kv, 1, D, generator=g_))
    if case == "padding-query":
        layer.mark_padding(torch.tensor([[True], [False]]))
    q = torch.randn(B, H_kv * g, 1, D, generator=g_)
    ctx = _ctx(layer, q)
    out = layer_attention(ctx, None)
    mask = visibility_mask(layer.index, ctx.query_index)  # the general path: heads compared, causal test
    ref = dense_attention(q, layer.keys, layer.values, mask, ctx.scaling)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert layer.all_valid == (case == "all-valid")


def test_a_forward_over_every_held_slot_is_plain_causal():
    layer = _layer(B=1, H_kv=2, T=9, D=8, seed=6)
    q = torch.randn(1, 4, 9, 8, generator=torch.Generator().manual_seed(7))
    ctx = _ctx(layer, q)
    mask = visibility_mask(layer.index, ctx.query_index)
    ref = dense_attention(q, layer.keys, layer.values, mask, ctx.scaling)
    torch.testing.assert_close(layer_attention(ctx, None), ref, rtol=1e-5, atol=1e-6)
