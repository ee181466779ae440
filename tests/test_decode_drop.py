"""A batched decode drops rows that finished (``Stream.decode(..., drop_finished=True)``): every row gets
the tokens it gets without dropping, and later steps run only the rows still going."""

from __future__ import annotations

import pytest

from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
from longlab.prompt import encode_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

# eviction, an observer with per-slot state, per-head budgets, quantized storage, decode-time eviction
# (its query buffer in layer.state): every method declares batch_select_safe
SAFE = ["full", "snapkv@0.5", "h2o@0.5", "adakv@0.5", "kivi2", "decoding:budget=96,interval=4"]


def _prefilled(model, tokenizer, text: str, recipe: str) -> tuple[Stream, object]:
    contexts = [text, text[:420], text[:260]]  # three rows of different lengths (left padding)
    n = len(contexts)
    ctx, q = encode_prompts(tokenizer, contexts, ["Where is item 3?", "Which box?", "Where?"], [""] * n)
    stream = Stream(model, LonglabCache(recipe), n)
    stream.pad_id = tokenizer.pad_token_id
    stream.feed(ctx, 128, compress="end")
    return stream, stream.feed(q, 128, compress="none")  # logits [3, V]


def _recording(stream: Stream) -> list[int]:
    """Batch size of every decode step's forward."""
    widths: list[int] = []
    feed = stream.feed

    def recorded(rows, *args, **kwargs):
        widths.append(len(rows))
        return feed(rows, *args, **kwargs)

    stream.feed = recorded  # type: ignore[method-assign]
    return widths


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("recipe", SAFE)
def test_dropping_finished_rows_gives_the_same_tokens(tiny_models, tokenizer, text, recipe, temperature):
    model = tiny_models["tiny-llama"][0]
    stream, logits = _prefilled(model, tokenizer, text, recipe)
    args = dict(temperature=temperature, top_p=0.9, seed=4)
    free = stream.fork().decode(logits, 14, set(), **args)  # no EOS: every row runs 14 steps
    eos = {free[0][1], free[1][6]}  # ends row 0 early and row 1 later (row 2 wherever they occur)
    expected = [_cut(r, eos) for r in free]
    assert len({len(r) for r in expected}) > 1, "the EOS choice must end rows at different steps"

    plain = stream.fork()
    plain_widths = _recording(plain)
    assert plain.decode(logits, 14, eos, **args) == expected
    assert set(plain_widths) == {3}  # without dropping every step runs the whole batch

    dropping = stream.fork()
    widths = _recording(dropping)
    assert dropping.decode(logits, 14, eos, **args, drop_finished=True) == expected
    steps = max(len(r) for r in expected) - 1  # forwards after the first token
    assert all(m.batch_select_safe for m in stream.cache.recipe.methods)  # what SAFE lists
    assert widths == [sum(len(r) > s for r in expected) for s in range(1, steps + 1)]
    assert dropping.batch_size == widths[-1] == dropping.cache.layers[0].keys.shape[0]


def test_rows_stay_when_a_method_keeps_state_off_the_layer(tiny_models, tokenizer, text):
    model = tiny_models["tiny-llama"][0]
    stream, logits = _prefilled(model, tokenizer, text, "quest")  # batch_select_safe = False
    assert not stream.cache.recipe.decode.batch_select_safe
    free = stream.fork().decode(logits, 8, set())
    eos = {free[0][1]}
    widths = _recording(stream)
    assert stream.decode(logits, 8, eos, drop_finished=True) == [_cut(r, eos) for r in free]
    assert set(widths) == {3}
