"""What the server caches never crosses recipes (issue #29: a compressed prefix is never served to a request
with another recipe). The engine's two caches hold only uncompressed KV, so neither needs the recipe in its
key: a prompt shared by concurrent requests is prefilled once, uncompressed, and each branch compresses for
itself (:mod:`longlab.engine.planner`); the document store keys entries by model, tokenizer, prefix tokens
and text and stores each document's KV before any recipe runs (:mod:`longlab.reuse.docstore`). These tests
fail if either cache kept a recipe's compressed KV and served it to a request of another recipe (the same
bug as keying a compressed cache without its recipe): the later request would hold fewer bytes than an
uncompressed cache, or answer differently from the request served alone."""

from __future__ import annotations

import pytest

from longlab import Engine, Request
from longlab.reuse.docstore import MemoryStore

DOCS = ["The archive code is 4417. It opens the west door. " * 3,
        "Marta keeps the ledger in the blue cabinet. The key hangs by the stove. " * 3]
CTX = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(60))


def _alone(model, tokenizer, **fields):
    (result,) = Engine(model, tokenizer, store=MemoryStore()).run([Request(**fields)])
    return result


@pytest.mark.parametrize("order", [("snapkv@0.5", "full"), ("full", "snapkv@0.5"),
                                   ("snapkv@0.5", "streaming@0.5")])
def test_document_store_never_serves_one_recipes_kv_to_another(llama, tokenizer, order) -> None:
    engine = Engine(llama, tokenizer, store=MemoryStore())
    results = []
    for recipe in order:  # one after another: the second finds the documents in the store
        fields = dict(documents=DOCS, question="What is the code?", reuse="cacheblend:recompute=0.5",
                      recipe=recipe, max_new_tokens=6)
        (res,) = engine.run([Request(**fields)])
        alone = _alone(llama, tokenizer, **fields)
        assert (res.text, res.token_ids) == (alone.text, alone.token_ids), recipe
        assert res.kv_bytes_after == alone.kv_bytes_after, recipe
        results.append(res)
    assert results[1].reuse.store_stats.get("hits", 0) > 0, results[1].reuse.store_stats  # from the store
    for res in results:
        if res.request.recipe == "full":
            assert res.kv_bytes_after >= res.kv_bytes_before  # nothing evicted: no compressed KV reused
        else:
            assert res.kv_bytes_after < 0.75 * res.kv_bytes_before


def test_a_shared_prompt_prefill_is_compressed_per_branch(llama, tokenizer) -> None:
    msgs = [{"role": "user", "content": CTX + " Where is item 7?"}]
    recipes = ["snapkv@0.5", "full", "h2o@0.5", "streaming@0.5"]
    engine = Engine(llama, tokenizer)
    # submitted together, the four share one prefill group (same tokens) and branch into their recipes
    together = engine.run([Request(messages=msgs, recipe=r, max_new_tokens=6) for r in recipes])
    full = together[1]
    assert full.kv_bytes_after >= full.kv_bytes_before  # (after: slot positions too) nothing evicted
    for r, res in zip(recipes, together):
        alone = _alone(llama, tokenizer, messages=msgs, recipe=r, max_new_tokens=6)
        assert res.token_ids == alone.token_ids and res.kv_bytes_after == alone.kv_bytes_after, r
        if r != "full":
            assert res.kv_bytes_after < 0.75 * full.kv_bytes_after, r
    # and after them, on the same engine, the same prompt under `full` again holds the full cache
    (again,) = engine.run([Request(messages=msgs, recipe="full", max_new_tokens=6)])
    assert again.kv_bytes_after == full.kv_bytes_after and again.token_ids == full.token_ids
