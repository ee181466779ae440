"""Compression replayed on a forked uncompressed cache equals prefilling with the recipe itself."""

from __future__ import annotations

import pytest
import torch

from longlab.attention import StandIn
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.hook import ChunkRecorder, replay_compression
from longlab.recipe import Recipe, parse_recipe


class _ObserveOnly(StandIn):
    """Runs a policy's ``observe`` in the shared prefill, never its selection."""

    needs_observe = True

    def __init__(self, policy) -> None:
        self.policy = policy

    def observe(self, ctx) -> None:
        self.policy.observe(ctx)

    def select(self, ctx) -> None:
        return None


RECIPES = [
    "snapkv@0.5",
    "pyramidkv@0.75",
    "adakv@0.5",
    "tova@0.5",
    "knorm@0.5",
    "streaming@0.5",
    "h2o@0.5",
    "restkv@0.9",  # per query head (gqa=query) holds H/H_kv (up to 4) times the entries of one per KV head
    "snapkv-obcvk@0.5",
    "snapkv@0.5+kivi2",
]


@pytest.mark.parametrize("spec", RECIPES)
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma3"])
def test_replayed_compression_equals_prefill_with_the_recipe(tiny_models, spec, model_name):
    model, _ = tiny_models[model_name]
    ids = torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()

    own = Stream(model, LonglabCache(spec), 1)
    own_logits = own.feed([ids], chunk_size=128, compress="end")

    recipe = parse_recipe(spec)
    recorder = ChunkRecorder()
    observers = [_ObserveOnly(p) for p in recipe.kv if getattr(p, "needs_observe", False)]
    shared = Stream(model, LonglabCache(Recipe(kv=[*observers, recorder])), 1)
    shared_logits = shared.feed([ids], chunk_size=128, compress="end")
    shared.cache.recipe = Recipe(kv=observers)  # the records stay out of every fork
    fork = shared.fork(recipe)
    replay_compression(fork.cache, recorder.records)

    torch.testing.assert_close(shared_logits, own_logits, rtol=0, atol=0)
    assert fork.cache.nbytes() == own.cache.nbytes() < shared.cache.nbytes()
    for mine, ref in zip(fork.cache.layers, own.cache.layers):
        assert type(mine) is type(ref)
        assert torch.equal(mine.index, ref.index)
        if hasattr(ref, "dequantized_keys"):
            assert torch.equal(mine.dequantized_keys(), ref.dequantized_keys())
        else:
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    # the next token sees the same cache either way
    nxt = own_logits.argmax(-1)
    a = own.feed([[int(nxt)]], compress="none")
    b = fork.feed([[int(nxt)]], compress="none")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
