"""Pipeline: ratio 0 is exact, batches equal single runs, modes, bad input."""

from __future__ import annotations

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.generation import generate
from longlab.prompt import build_prompt
from longlab.recipe import LonglabError

POLICIES = ["snapkv", "streaming", "h2o", "tova", "pyramidkv", "adakv", "knorm", "random"]


@pytest.mark.parametrize("name", POLICIES)
def test_ratio_zero_is_token_identical_to_plain_generate(tiny_models, tokenizer, name):
    model, ref = tiny_models["tiny-llama"]
    ids = tokenizer("The boxes are stacked by the door of the shed.", return_tensors="pt")["input_ids"]
    plain = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    ours = model.generate(
        ids,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        cache=LonglabCache(f"{name}@0.0"),
    )
    assert torch.equal(plain, ours)


@pytest.mark.parametrize("recipe", ["full", "snapkv@0.5", "adakv@0.5", "h2o@0.5", "streaming@0.75"])
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma3"])
def test_batch_of_two_equals_two_single_runs(tiny_models, tokenizer, text, recipe, model_name):
    model, _ = tiny_models[model_name]
    contexts, questions = [text, text[:300]], ["Where is item 3?", "Which box?"]
    kwargs = dict(max_new_tokens=8, chunk_size=128, compress="end")
    batch = generate(model, tokenizer, contexts, questions, recipe, **kwargs)
    singles = [
        generate(model, tokenizer, c, q, recipe, **kwargs).token_ids[0] for c, q in zip(contexts, questions)
    ]
    assert batch.token_ids == singles


def test_chunked_compression_keeps_cache_within_budget_while_streaming(tiny_models, tokenizer, text):
    model, _ = tiny_models["tiny-llama"]
    result = generate(
        model, tokenizer, text * 3, "Where is item 3?", "snapkv:budget=200", chunk_size=128, max_new_tokens=8
    )
    _, question_text = build_prompt(tokenizer, text * 3, "Where is item 3?")
    n_question = len(tokenizer(question_text, add_special_tokens=False)["input_ids"])
    for lengths in result.cache.lengths():  # budget + question + decoded tokens fed back (all but the last)
        assert int(lengths.max()) == 200 + n_question + len(result.token_ids[0]) - 1
    assert result.kv_bytes_after < result.kv_bytes_before / 4


def test_query_aware_mode_compresses_with_the_question(tiny_models, tokenizer, text):
    model, _ = tiny_models["tiny-llama"]
    agnostic = generate(model, tokenizer, text, "Where is item 3?", "snapkv@0.5", max_new_tokens=4)
    aware = generate(
        model, tokenizer, text, "Where is item 3?", "snapkv@0.5", max_new_tokens=4, query_aware=True
    )
    _, question_text = build_prompt(tokenizer, text * 3, "Where is item 3?")
    n_question = len(tokenizer(question_text, add_special_tokens=False)["input_ids"])
    ctx = agnostic.context_tokens[0]
    # query-agnostic: half the context survives, then the whole question is appended
    assert int(agnostic.cache.lengths()[0].max()) == -(-ctx // 2) + n_question + 3
    # query-aware: half of context + question survives
    assert int(aware.cache.lengths()[0].max()) == -(-(ctx + n_question) // 2) + 3


def test_per_head_budgets_reduce_bytes(tiny_models, tokenizer, text):
    model, _ = tiny_models["tiny-llama"]
    full = generate(model, tokenizer, text, "Where?", "full", max_new_tokens=1, compress="end")
    ada = generate(model, tokenizer, text, "Where?", "adakv@0.75", max_new_tokens=1, compress="end")
    assert ada.kv_bytes_after < 0.5 * full.kv_bytes_after
    lengths = torch.cat([x.flatten() for x in ada.cache.lengths()])
    assert lengths.unique().numel() > 1  # heads hold different numbers of entries


def test_sampling_is_seeded(tiny_models, tokenizer, text):
    model, _ = tiny_models["tiny-llama"]
    a = generate(
        model, tokenizer, text, "Where?", "full", temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6
    )
    b = generate(
        model, tokenizer, text, "Where?", "full", temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6
    )
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(context=""), "context is empty"),
        (dict(context=[]), "context is empty"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer in [1, 1000000]"),
        (dict(chunk_size=0), "chunk_size must be an integer in [1, 1048576]"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(recipe="snapkv@2"), "compression_ratio must be in [0, 1)"),
    ],
)
def test_bad_input_raises_clear_errors(tiny_models, tokenizer, kwargs, fragment):
    model, _ = tiny_models["tiny-llama"]
    args = dict(context="some context", question="q?", recipe="full")
    args.update(kwargs)
    with pytest.raises(LonglabError) as info:
        generate(model, tokenizer, args.pop("context"), **args)
    assert fragment in str(info.value)


def test_context_beyond_max_positions_warns_or_errors(tokenizer):
    from longlab.models import build_tiny_model

    small = build_tiny_model("tiny-llama", max_position_embeddings=64)
    with pytest.warns(UserWarning, match="max_position_embeddings=64"):  # strict=False: it runs
        generate(small, tokenizer, "x" * 100, "q?", "full", max_new_tokens=2, strict=False)
    with pytest.raises(LonglabError, match="max_position_embeddings=64.*strict=False"):  # refused by default
        generate(small, tokenizer, "x" * 100, "q?", "full", max_new_tokens=2)
    with pytest.raises(LonglabError, match="max_position_embeddings=64"):
        generate(small, tokenizer, "x" * 100, "q?", "full", max_new_tokens=2, strict=True)
