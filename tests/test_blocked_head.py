"""The LM head in row blocks (``longlab.engine.stream``): the same logits bit for bit, so the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longlab.engine import stream as pipeline
from longlab.engine.stream import _row_blocked_head, blocked_linear
from longlab.generation import generate


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_blocked_linear_is_bitwise_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(1000, 64, generator=gen), torch.randn(rows, 64, generator=gen)  # [V, D], [B, D]
    for block in (64, 300, 1000, 4096):
        if rows >= pipeline.HEAD_MIN_ROWS:  # the rows the pipeline blocks (and checks at run time)
            assert torch.equal(blocked_linear(x, w, block), F.linear(x, w))
        else:  # one row: BLAS may take a gemv path whose sums differ in the last bit (seen on one Xeon)
            torch.testing.assert_close(blocked_linear(x, w, block), F.linear(x, w), rtol=1e-6, atol=1e-5)


def _answers(model) -> dict:
    """The bitwise-equality answers remembered on the model's own head: (V, D, rows, block) -> bool."""
    return model.lm_head.__dict__.get("_longlab_blocked_exact", {})


@pytest.fixture
def small_blocks(monkeypatch, tiny_models):
    """Blocks of 64 vocabulary rows, so the tiny models' 260-entry head spans five blocks; no answer
    remembered from another test."""
    monkeypatch.setattr(pipeline, "HEAD_BLOCK", 64)
    monkeypatch.setattr(pipeline, "HEAD_MIN_ROWS", 2)
    for model, _ in tiny_models.values():
        model.lm_head.__dict__.pop("_longlab_blocked_exact", None)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_blocked_head_gives_the_models_logits(tiny_models, small_blocks, name):
    model, _ = tiny_models[name]
    head = _row_blocked_head(model, 3)
    assert head is not None
    hidden = torch.randn(3, model.config.hidden_size)  # [B, D]
    assert torch.equal(head(hidden), model.lm_head(hidden))


def test_blocked_head_gives_the_same_tokens(tiny_models, tokenizer, text, small_blocks, monkeypatch):
    model, _ = tiny_models["tiny-llama"]
    contexts, questions = [text[:200], text[:120]], ["Where is item 3?", "Which box?"]
    kwargs = dict(max_new_tokens=6, chunk_size=128, compress="end")
    blocked = generate(model, tokenizer, contexts, questions, "snapkv@0.5", **kwargs)
    assert any(ok for (_, _, rows, _), ok in _answers(model).items() if rows == 2)  # the path ran
    monkeypatch.setattr(pipeline, "HEAD_MIN_ROWS", 10**9)  # off: the model's own head
    plain = generate(model, tokenizer, contexts, questions, "snapkv@0.5", **kwargs)
    assert blocked.token_ids == plain.token_ids


def test_blocked_head_is_not_used_where_it_is_not_known_equal(tiny_models, small_blocks):
    llama, _ = tiny_models["tiny-llama"]
    gemma, _ = tiny_models["tiny-gemma3"]
    assert _row_blocked_head(llama, 1) is None  # one row: F.linear is faster
    assert _row_blocked_head(gemma, 4) is None  # another head (final logit soft-capping)
    handle = llama.lm_head.register_forward_hook(lambda *a: None)
    try:
        assert _row_blocked_head(llama, 4) is None  # a hook that the direct call would skip
    finally:
        handle.remove()
    assert _row_blocked_head(llama, 4) is not None


def test_a_blocked_head_that_differs_falls_back_to_f_linear(tiny_models, small_blocks, monkeypatch):
    llama, _ = tiny_models["tiny-llama"]
    monkeypatch.setattr(pipeline, "blocked_linear", lambda x, w, block: F.linear(x, w) + 1.0)
    hidden = torch.randn(4, llama.config.hidden_size)
    head = _row_blocked_head(llama, 4)
    assert torch.equal(head(hidden), F.linear(hidden, llama.lm_head.weight))  # checked on first use
    assert torch.equal(head(hidden), F.linear(hidden, llama.lm_head.weight))  # and remembered


def test_the_remembered_answer_belongs_to_one_model(tiny_models, small_blocks):
    """An answer is kept on the head it was checked on: another model checks for itself, whatever the first
    one's answer was, and a head that was never used carries none."""
    llama, _ = tiny_models["tiny-llama"]
    qwen, _ = tiny_models["tiny-qwen2"]
    x = torch.randn(4, llama.config.hidden_size)  # [B, D]
    _row_blocked_head(llama, 4)(x)
    key = (*llama.lm_head.weight.shape, 4, 64)
    truth = torch.equal(blocked_linear(x, llama.lm_head.weight, 64), F.linear(x, llama.lm_head.weight))
    assert _answers(llama) == {key: truth}
    _answers(llama)[key] = not truth  # as if llama's head had answered the other way
    y = torch.randn(4, qwen.config.hidden_size)
    _row_blocked_head(qwen, 4)(y)
    own = torch.equal(blocked_linear(y, qwen.lm_head.weight, 64), F.linear(y, qwen.lm_head.weight))
    assert _answers(qwen) == {(*qwen.lm_head.weight.shape, 4, 64): own}  # its own check, not llama's
    unused = torch.nn.Linear(llama.lm_head.in_features, llama.lm_head.out_features, bias=False)
    assert "_longlab_blocked_exact" not in unused.__dict__
