"""Stacked batch rows (the harness's batched decode): per-row validity flags and row dropping."""

from __future__ import annotations

import torch

from longlab.attention import LayerContext, _ragged_rows, layer_attention
from longlab.cache import LonglabLayer


def _layer(positions: list[int], seed: int) -> LonglabLayer:
    gen = torch.Generator().manual_seed(seed)
    T = len(positions)
    layer = LonglabLayer()
    layer.lazy_initialization(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
    layer.update(torch.randn(1, 2, T, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen))
    layer.index = torch.tensor(positions, dtype=torch.int32).expand(1, 2, -1).contiguous()
    layer.n_real = torch.tensor([max(positions) + 1])
    return layer


def _stacked() -> tuple[LonglabLayer, list[LonglabLayer]]:
    # a full row, an evicted row, and a row holding an empty slot (position -1)
    rows = [_layer(list(range(12)), 0), _layer([0, 5, 9, 11], 1), _layer([0, 1, -1, 3, 10, 11], 2)]
    return LonglabLayer.stacked(rows, reserve=4), rows


def test_row_valid_flags_follow_the_rows():
    layer, _ = _stacked()
    assert layer.row_valid == [True, True, False]
    layer.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))  # a decode step keeps them
    assert layer.row_valid == [True, True, False]
    ctxs = _ragged_rows(LayerContext(0, 1, None, "decode", torch.randn(3, 4, 1, 8), 8**-0.5,
                                     torch.full((3, 1), 12), layer=layer))
    assert [c.valid_hint for c in ctxs] == [True, True, False]
    assert [c.all_valid for c in ctxs] == [bool((c.key_index >= 0).all()) for c in ctxs]
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert layer.row_valid == [False, True] and layer.lead_pad.tolist() == [6, 0]
    layer.index = layer.index.clone()  # a new layout forgets them
    assert layer.row_valid is None and layer.lead_pad is None


def test_dropping_a_row_keeps_the_spare_slots_and_the_answers():
    layer, rows = _stacked()
    layer.batch_select_indices(torch.tensor([0, 2]))
    buf = layer.__dict__["_slots_keys"][0]
    assert buf.shape[2] == 16  # the 4 reserved slots survive the selection
    new_k, new_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    layer.update(new_k, new_v)
    assert layer.__dict__["_slots_keys"][0].data_ptr() == buf.data_ptr()  # written in place
    q = torch.randn(2, 4, 1, 8)
    out = layer_attention(LayerContext(0, 1, None, "decode", q, 8**-0.5, torch.full((2, 1), 12), layer=layer),
                          None)
    for i, b in enumerate((0, 2)):
        rows[b].update(new_k[i : i + 1], new_v[i : i + 1])
        alone = layer_attention(LayerContext(0, 1, None, "decode", q[i : i + 1], 8**-0.5,
                                             torch.full((1, 1), 12), layer=rows[b]), None)
        torch.testing.assert_close(out[i : i + 1], alone, atol=1e-6, rtol=1e-5)
