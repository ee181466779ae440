"""Invariant 1: with the empty recipe the longlab hook reproduces transformers' SDPA path."""

from __future__ import annotations

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream

TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


@pytest.mark.parametrize("name", TINY)
def test_empty_recipe_matches_sdpa_without_cache(tiny_models, name):
    model, ref = tiny_models[name]
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("name", TINY)
def test_chunked_prefill_through_cache_matches_one_forward(tiny_models, name):
    # B1-T100: three prefill chunks + 5 single-token decode steps vs one forward without cache
    model, ref = tiny_models[name]
    ids = torch.randint(0, 256, (1, 105), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
        stream = Stream(model, LonglabCache("full"), 1)
        got = [stream.feed([ids[0, :100].tolist()], chunk_size=40)]
        for t in range(100, 105):
            got.append(stream.feed([[int(ids[0, t])]]))
    assert (got[0][0] - expected[99]).abs().max() <= 1e-4
    for i, logits in enumerate(got[1:]):
        assert (logits[0] - expected[100 + i]).abs().max() <= 1e-4


@pytest.mark.parametrize("name", TINY)
def test_left_padded_batch_matches_unpadded_rows(tiny_models, name):
    # B2: rows of 70 and 45 tokens, left-padded chunked prefill, then decode steps
    model, ref = tiny_models[name]
    g = torch.Generator().manual_seed(2)
    rows = [
        torch.randint(0, 256, (70,), generator=g).tolist(),
        torch.randint(0, 256, (45,), generator=g).tolist(),
    ]
    with torch.no_grad():
        stream = Stream(model, LonglabCache("full"), 2)
        last = stream.feed(rows, chunk_size=32)
        step = stream.feed([[5], [9]])
        for b, (row, nxt) in enumerate(zip(rows, (5, 9))):
            expected = ref(torch.tensor([row + [nxt]])).logits[0]
            assert (last[b] - expected[-2]).abs().max() <= 1e-4
            assert (step[b] - expected[-1]).abs().max() <= 1e-4


@pytest.mark.parametrize("cache_kwarg", ["cache", "past_key_values"])
def test_hf_generate_with_longlab_cache_and_padding(tiny_models, tokenizer, cache_kwarg):
    """``cache=`` is transformers' name since 5.24; the deprecated ``past_key_values=`` must keep working
    (and reach the LonglabCache: its recipe compresses) while transformers accepts it."""
    import warnings

    model, ref = tiny_models["tiny-llama"]
    batch = tokenizer(
        ["a longer prompt about boxes", "short"], return_tensors="pt", padding=True, padding_side="left"
    )
    plain = ref.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= is deprecated, not removed
        ours = model.generate(
            **batch,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            **{cache_kwarg: LonglabCache("full")},
        )
        assert torch.equal(plain, ours)
        cache = LonglabCache("streaming:budget=8")
        kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        model.generate(**batch, **kwargs, **{cache_kwarg: cache})
    # the 27-token prompt was cut to 8 entries per head; the two fed decode tokens come on top
    assert cache.hook_calls > 0 and max(int(n.max()) for n in cache.lengths()) <= 8 + 2
