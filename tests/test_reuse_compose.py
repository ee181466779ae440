"""Reuse methods composed with KV recipes (longlab.reuse.compose): full-prefill + recipe = a plain query-aware
prefill + recipe token for token, ratio 1 + recipe likewise, partial methods compress, bad combinations are
refused before anything runs. Tiny models, one thread."""

from __future__ import annotations

import pytest
import torch

from longlab import LonglabCache, LonglabError, generate
from longlab.engine.stream import Stream, eos_token_ids
from longlab.reuse import DocStore, MemoryStore, doc_segment, reuse_prefill, split_prompt

TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
DOCS = [" ".join(f"Item {i} is in box {i * 7 % 13}." for i in range(j, j + 8)) for j in (0, 10, 20, 30)]
QUESTION = "Where is item 12?"

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompt(tokenizer):
    prefix, q = split_prompt(tokenizer, QUESTION)
    docs = [t for d in DOCS for t in tokenizer(doc_segment(d), add_special_tokens=False)["input_ids"]]
    return prefix + docs + q


@torch.inference_mode()
def _plain(model, tokenizer, recipe, n_new):
    """The reference: the same token ids prefilled as one chunk under ``recipe``, compressed at the end with
    the question in the prompt (query-aware), then greedy decoding."""
    ids = _prompt(tokenizer)
    cache = LonglabCache(recipe)
    stream = Stream(model, cache, 1)
    logits = stream.feed([ids], chunk_size=len(ids), compress="end")
    tokens = stream.decode(logits, n_new, eos_token_ids(model, tokenizer))
    return tokens[0], cache, len(ids)


def _held(cache, n):
    """Per layer and head, the prompt positions (< n) the cache holds."""
    return [
        sorted(p for p in layer.index[0, h].tolist() if 0 <= p < n)
        for layer in cache.layers
        for h in range(layer.index.shape[1])
    ]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("recipe", ["snapkv@0.5", "pyramidkv@0.6", "streaming:budget=40", "snapkv@0.5+kivi4"])
def test_full_prefill_plus_recipe_is_plain_prefill_plus_recipe(tiny_models, tokenizer, name, recipe):
    model = tiny_models[name][0]
    want, ref_cache, n = _plain(model, tokenizer, recipe, 8)
    got = generate(
        model, tokenizer, docs=DOCS, question=QUESTION, reuse="full-prefill", recipe=recipe, max_new_tokens=8
    )
    assert got.token_ids[0] == want
    assert got.recipe == f"reuse=full-prefill+{recipe}"
    assert got.kv_bytes_after < got.kv_bytes_before  # compressed
    pre = reuse_prefill(model, tokenizer, DOCS, QUESTION, "full-prefill", recipe=recipe)
    if "kivi" not in recipe:  # the same positions kept in every layer and head as the plain prefill
        assert _held(pre.cache, n) == _held(ref_cache, n)
    assert pre.recipe == recipe and pre.n_positions == n


@pytest.mark.parametrize("name", TINY)
def test_ratio_one_plus_recipe_is_plain_prefill_plus_recipe(tiny_models, tokenizer, name):
    """At ratio 1 the last forward of every method is the whole prompt: the same compression as plain."""
    model = tiny_models[name][0]
    want, _, _ = _plain(model, tokenizer, "snapkv@0.5", 8)
    store = MemoryStore()
    for spec in ("cacheblend:recompute=1", "prophetkv:recompute=1", "prophetkv:recompute=1,dual_stage=true",
                 "epic:recompute=1"):
        got = generate(
            model, tokenizer, docs=DOCS, question=QUESTION, reuse=spec, store=store, recipe="snapkv@0.5",
            max_new_tokens=8,
        )
        assert got.token_ids[0] == want, spec


@pytest.mark.parametrize(
    "spec", ["no-recompute", "cacheblend:recompute=0.2", "prophetkv:recompute=0.2", "epic:k=4", "ape"]
)
def test_partial_reuse_plus_recipe_compresses_in_stream_order(tiny_models, tokenizer, spec):
    """A partial method + snapkv@0.5 keeps ceil(n/2) positions per head, the question's last window among
    them, slots in stream order; decoding runs under the recipe; without a recipe nothing is dropped."""
    model = tiny_models["tiny-qwen2"][0]
    store = MemoryStore()
    plain = reuse_prefill(model, tokenizer, DOCS, QUESTION, spec, store=store)
    pre = reuse_prefill(model, tokenizer, DOCS, QUESTION, spec, store=store, recipe="snapkv@0.5")
    torch.testing.assert_close(pre.logits, plain.logits)  # the first token is computed before compressing
    n = pre.n_positions
    for layer in pre.cache.layers:
        held = layer.index[0]  # [H_kv, T]
        assert int((held >= 0).sum(-1).max()) <= -(-n // 2) + (0 if spec != "ape" else n)
        assert bool((held[:, 1:] >= held[:, :-1]).all()) or spec == "ape"
        assert set(range(n - 32, n)) <= set(held[0].tolist())  # SnapKV's window is protected
    assert pre.cache.nbytes() < plain.cache.nbytes()
    assert pre.cache.recipe.name == "snapkv@0.5" or spec == "ape"
    out = generate(
        model, tokenizer, docs=DOCS, question=QUESTION, reuse=spec, store=store, recipe="snapkv@0.5",
        max_new_tokens=4,
    )
    assert len(out.token_ids[0]) >= 1


def test_recipe_full_or_none_keeps_everything(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    store = MemoryStore()
    a = generate(model, tokenizer, docs=DOCS, question=QUESTION, reuse="cacheblend:recompute=0.2",
                 store=store, recipe="full", max_new_tokens=6)
    b = generate(model, tokenizer, docs=DOCS, question=QUESTION, reuse="cacheblend:recompute=0.2",
                 store=store, recipe=None, max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.recipe == b.recipe == "reuse=cacheblend:recompute=0.2"
    assert a.reuse.recipe == "full" and a.kv_bytes_after >= a.kv_bytes_before


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        ("h2o@0.5", "accumulates attention"),
        ("prism+snapkv@0.5", "prefill-attention policy"),
        ("indexmem:budget=32", "computes attention itself"),
        ("snapkv@1.5", "compression_ratio"),
        ("nope@0.5", "nope"),
    ],
)
def test_bad_recipe_with_docs_refused_before_running(tiny_models, tokenizer, tmp_path, recipe, match):
    model = tiny_models["tiny-llama"][0]
    store = DocStore(tmp_path / "s")
    with pytest.raises(LonglabError, match=match):
        generate(model, tokenizer, docs=DOCS, question=QUESTION, reuse="cacheblend:recompute=0.2",
                 store=store, recipe=recipe)
    assert len(store) == 0  # nothing encoded, nothing written


def test_ape_with_a_decode_policy_is_refused(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    with pytest.raises(LonglabError, match="decode policy"):
        reuse_prefill(model, tokenizer, DOCS, QUESTION, "ape", recipe="quest")
    with pytest.raises(LonglabError, match="longlab"):
        reuse_prefill(tiny_models["tiny-llama"][1], tokenizer, DOCS, QUESTION, "epic", recipe="snapkv@0.5")


@pytest.mark.slow
def test_real_model_full_prefill_plus_recipe_is_plain():
    """SmolLM2-135M: full-prefill + snapkv@0.5 (and cacheblend:recompute=1 + snapkv@0.5) = the plain
    query-aware prefill + snapkv@0.5 of the same token ids, 12 tokens."""
    from longlab import load_model
    from longlab.tasks import generate_samples as make_task

    try:
        model, tok = load_model("smollm2-135m")
    except LonglabError as exc:  # weights package not installed
        pytest.skip(str(exc))
    sample = make_task("multidoc_qa_1", tok, 4 * 150 + 200, 1, 0, num_docs=4, doc_tokens=150)[0]
    docs, q, prefix = sample.metadata["documents"], sample.question, sample.answer_prefix
    pre_ids, q_ids = split_prompt(tok, q, prefix)
    doc_ids = [t for d in docs for t in tok(doc_segment(d), add_special_tokens=False)["input_ids"]]
    ids = pre_ids + doc_ids + q_ids
    with torch.inference_mode():
        stream = Stream(model, LonglabCache("snapkv@0.5"), 1)
        logits = stream.feed([ids], chunk_size=len(ids), compress="end")
        want = stream.decode(logits, 12, eos_token_ids(model, tok))[0]
    store = MemoryStore()
    for spec in ("full-prefill", "cacheblend:recompute=1"):
        got = generate(model, tok, docs=docs, question=q, answer_prefix=prefix, reuse=spec, store=store,
                       recipe="snapkv@0.5", max_new_tokens=12)
        assert got.token_ids[0] == want, spec
