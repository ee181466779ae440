"""The embedded real model (SmolLM2-135M-Instruct): pass-key retrieval at ~1k tokens.

Marked slow (model load + 1k-token prefills): run with ``make test-slow``."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from longlab.models import load_model

    return load_model("smollm2-135m")


def passkey_context(key: int, n_repeats: int = 40) -> str:
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    half = n_repeats // 2
    return filler * half + f"The pass key is {key}. Remember it. {key} is the pass key. " + filler * half


@pytest.mark.parametrize("recipe", ["full", "snapkv@0.5"])
def test_passkey_found_at_1k_tokens(smollm2, recipe):
    model, tokenizer = smollm2
    found = 0
    for key in (68420, 31975, 50227):
        result = generate_answer(model, tokenizer, passkey_context(key), recipe)
        assert 900 <= result.context_tokens[0] <= 1300
        found += str(key) in result.text
    assert found >= 2, f"{recipe}: pass key found {found}/3"


def generate_answer(model, tokenizer, context, recipe):
    from longlab.pipeline import generate

    return generate(model, tokenizer, context, "What is the pass key?", recipe, max_new_tokens=12)


def test_hook_matches_sdpa_on_the_real_model(smollm2):
    import torch

    from longlab.models import load_model

    model, tokenizer = smollm2
    ref, _ = load_model("smollm2-135m", attn_implementation="sdpa")
    ids = tokenizer(passkey_context(12345, 10), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max() <= 1e-3
