"""Sparse-prefill selectors run as recipe prefill policies through the hook."""

from __future__ import annotations

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.generation import generate
from longlab.recipe import LonglabError, parse_recipe


def test_full_window_ashape_equals_dense_prefill(tiny_models):
    # A-shape whose local window covers the whole chunk selects every causal block: exact attention.
    model, _ = tiny_models["tiny-llama"]
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        dense = Stream(model, LonglabCache("full"), 1).feed(ids, chunk_size=256)
        sparse = Stream(model, LonglabCache("ashape:bq=64,bk=64,n_sink=64,n_local=256,backend=gather"), 1)
        got = sparse.feed(ids, chunk_size=256)
    assert (got - dense).abs().max() <= 1e-4


def test_sparse_prefill_composes_with_eviction(tiny_models, tokenizer, text):
    model, _ = tiny_models["tiny-llama"]
    recipe = "ashape:bq=64,bk=64,n_sink=64,n_local=128,backend=gather+snapkv@0.5"
    assert parse_recipe(recipe).prefill.name == "ashape"
    result = generate(model, tokenizer, text, "Where is item 3?", recipe, max_new_tokens=4, chunk_size=512)
    assert len(result.token_ids[0]) >= 1
    assert result.kv_bytes_after < 0.6 * result.kv_bytes_before


def test_bad_selector_parameter_is_a_clear_error():
    with pytest.raises(LonglabError, match="ashape"):
        parse_recipe("ashape:bq=0")
