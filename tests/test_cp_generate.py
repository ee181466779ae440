"""Context-parallel prefill (2 processes, gloo, forked) gives the same tokens as the one-process pipeline."""

from __future__ import annotations

import pytest
import torch

from longlab.generation import generate
from longlab.ops.cp_generate import context_parallel_prefill, generate_context_parallel
from longlab.recipe import LonglabError


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_context_parallel_generate_is_token_identical(tiny_models, tokenizer, text, name):
    model = tiny_models[name][0]
    ref = generate(model, tokenizer, text, "Where is item 7?", "full", max_new_tokens=12)
    got = generate_context_parallel(model, tokenizer, text, "Where is item 7?", 2, max_new_tokens=12)
    assert got.token_ids == ref.token_ids
    assert got.context_tokens == ref.context_tokens


def test_context_parallel_prefill_kv_equals_one_forward(tiny_models):
    model = tiny_models["tiny-llama"][0]
    ids = list(range(3, 3 + 64))
    kv = context_parallel_prefill(model, ids, 2)
    from longlab.cache import LonglabCache

    cache = LonglabCache("full")
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    assert len(kv) == len(cache.layers)
    for (k, v), layer in zip(kv, cache.layers):
        assert (k - layer.keys[:, :, :64]).abs().max() < 1e-5
        assert (v - layer.values[:, :, :64]).abs().max() < 1e-5


def test_context_parallel_bad_input(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    with pytest.raises(LonglabError, match="world size"):
        generate_context_parallel(model, tokenizer, "abc", "q", 1)
    with pytest.raises(LonglabError, match="strategy"):
        generate_context_parallel(model, tokenizer, "abc", "q", 2, strategy="tree")
    with pytest.raises(LonglabError, match="too short"):
        generate_context_parallel(model, tokenizer, "ab", "q", 4)


def test_cli_context_parallel_matches_plain_generate(capsys):
    from longlab.cli import main

    args = ["generate", "--model", "tiny-llama", "--recipe", "full", "--context", "Item 3 is in box 9. " * 20,
            "--question", "Where is item 3?", "--max-new-tokens", "6", "--quiet-summary"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--context-parallel", "2"]) == 0
    assert capsys.readouterr().out == plain
    assert main(args[:3] + ["--recipe", "snapkv@0.5"] + args[5:] + ["--context-parallel", "2"]) == 2
    assert "--recipe full" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_context_parallel_prefill_is_token_identical():
    from longlab.models import load_model

    model, tok = load_model("smollm2-135m")
    context = " ".join(f"Record {i}: the code for door {i} is {i * 37 % 1000}." for i in range(120))
    question = "What is the code for door 42?"
    ref = generate(model, tok, context, question, "full", max_new_tokens=16)
    for world in (2, 4):
        got = generate_context_parallel(model, tok, context, question, world, max_new_tokens=16)
        assert got.token_ids == ref.token_ids, world
