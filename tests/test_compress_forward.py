"""HiCo token dropping inside the prefill forward (longlab.compress.hico_forward)."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.cache import LonglabCache
from longlab.compress.hico_forward import HiCoForward, decoder_layers
from longlab.engine.stream import Stream
from longlab.prompt import encode_prompts
from longlab.recipe import LonglabError, parse_recipe

CTX = " ".join(f"Record {i} says the shelf {i * 5 % 11} holds item {i * 3 % 17}." for i in range(30))
QUESTION = "Which shelf holds item 7?"


def _prompt(tokenizer) -> list[int]:
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    return ctx + q, len(q)


def _stream(model, recipe: str = "full") -> Stream:
    return Stream(model, LonglabCache(recipe), 1)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model6(request):
    from longlab.models import build_tiny_model

    return build_tiny_model(request.param, num_hidden_layers=6)


def test_keep_ratio_one_is_a_plain_prefill(model6, tokenizer, one_thread):
    ids, nq = _prompt(tokenizer)
    plain = _stream(model6)
    a = plain.feed([ids], chunk_size=len(ids), compress="end")
    hico = _stream(model6)
    b = HiCoForward(0.0, protect=nq).prefill(hico, [ids])
    assert torch.equal(a, b)
    for la, lb in zip(plain.cache.layers, hico.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.index, lb.index)
    assert plain.decode(a, 5, set()) == hico.decode(b, 5, set())


def test_dropping_equals_running_the_later_layers_on_the_kept_rows(model6, tokenizer, one_thread):
    """One stage boundary b: layers >= b run only on the kept rows of the plain forward's hidden states
    (at their true RoPE positions); the logits equal that hand-run reference."""
    ids, nq = _prompt(tokenizer)
    method = HiCoForward(0.6, stages=(0.5,), protect=nq)
    stream = _stream(model6)
    logits = method.prefill(stream, [ids])
    b = method.info["layers"][0]
    (kept,) = method.info["kept_positions"][0]
    n = len(ids)
    assert len(kept) == math.ceil(0.4 * (n - nq) - 1e-9) + nq and kept == sorted(kept)
    assert kept[-nq:] == list(range(n - nq, n))
    inner = model6.get_decoder()
    with torch.inference_mode():
        x = torch.tensor([ids])
        hs = model6(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        pos = torch.tensor([kept])
        h = hs[b][:, kept]
        pe = inner.rotary_emb(h, pos)
        for layer in decoder_layers(model6)[b:]:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        ref = model6.lm_head(inner.norm(h[:, -1]))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    for i, layer in enumerate(stream.cache.layers):  # the cache holds true positions
        held = layer.index[0, 0].tolist()
        assert held == (list(range(n)) if i < b else kept)
        assert int(layer.n_real[0]) == n and layer.n_seen == n
    # decoding continues at position n in every layer (a decode step appends index n)
    stream.feed([[int(logits.argmax())]], compress="none")
    assert all(int(layer.index[0, 0, -1]) == n for layer in stream.cache.layers)


def test_stages_drop_cumulatively_and_save_rows(model6, tokenizer, one_thread):
    ids, nq = _prompt(tokenizer)
    method = HiCoForward(0.75, protect=nq)
    stream = _stream(model6, "snapkv@0.5")  # composes: the cache's own policy compresses at the end
    method.prefill(stream, [ids])
    n = len(ids) - nq
    counts = method.info["tokens_per_stage"]
    assert counts == [len(ids), math.ceil(0.5 * n - 1e-9) + nq, math.ceil(0.25 * n - 1e-9) + nq]
    (s1,), (s2,) = method.info["kept_positions"]
    assert set(s2) <= set(s1) and len(s1) == counts[1] and len(s2) == counts[2]
    sizes = [int(layer.valid[0, 0].sum()) for layer in stream.cache.layers]
    half = math.ceil(0.5 * len(ids))  # snapkv@0.5 keeps half of the stream's tokens, of what a layer holds
    assert sizes == [min(half, c) for c in (counts[0],) * 2 + (counts[1],) * 2 + (counts[2],) * 2]
    assert stream.cache.recipe.kv[0].name == "snapkv"  # the stand-in is gone after the forward


def test_bad_settings_are_refused(model6, tokenizer):
    with pytest.raises(LonglabError, match="compression_ratio"):
        HiCoForward(1.0)
    with pytest.raises(LonglabError, match="stages"):
        HiCoForward(0.5, stages=(0.6, 0.3))
    with pytest.raises(LonglabError, match="protect"):
        HiCoForward(0.5, protect=0)
    with pytest.raises(LonglabError, match="equal length"):
        HiCoForward(0.5).prefill(_stream(model6), [[1, 2, 3], [1, 2]])
    with pytest.raises(LonglabError, match="layers"):
        HiCoForward(0.5, stages=(0.01,)).prefill(_stream(model6), [list(range(5, 40))])


def test_sliding_window_models_are_refused(tiny_models):
    gemma = tiny_models["tiny-gemma3"][0]  # 4 layers, three of them sliding-window
    with pytest.raises(LonglabError, match="sliding-window"):
        HiCoForward(0.5, stages=(0.5,)).prefill(_stream(gemma), [list(range(5, 60))])


# ------------------------------------------------------------------ hico-forward@r: a recipe part
def _by_hand(model, tokenizer, ratio: float, kv: str, query_aware: bool, n_new: int = 8) -> list[int]:
    """HiCoForward's own prefill on a Stream (the tested direct API), then the question and decoding."""
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    stream = _stream(model, kv)
    method = HiCoForward(ratio)
    if query_aware:
        logits = method.prefill(stream, [ctx + q], protect=len(q))
    else:
        method.prefill(stream, [ctx])  # the last context token scores
        logits = stream.feed([q], compress="none")
    return stream.decode(logits, n_new, set())[0]


@pytest.mark.parametrize("query_aware", [True, False])
def test_hico_forward_is_a_recipe_part_of_generate(model6, tokenizer, one_thread, query_aware):
    from longlab import generate

    def run(recipe: str):
        return generate(model6, tokenizer, CTX, QUESTION, recipe, query_aware=query_aware, max_new_tokens=8)

    # nothing dropped = the plain prefill (one forward), bit for bit: same tokens and cache
    plain, same = run("full"), run("hico-forward@0")
    assert plain.token_ids == same.token_ids
    for la, lb in zip(plain.cache.layers, same.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.index, lb.index)
    for kv in ("", "+snapkv@0.5"):  # composes with a KV recipe; equals the direct API
        out = run("hico-forward@0.5" + kv)
        hand = _by_hand(model6, tokenizer, 0.5, "snapkv@0.5" if kv else "full", query_aware)
        assert out.token_ids[0] == hand
        rec = out.context[0]
        assert rec["kept_tokens"] == rec["original_tokens"]  # nothing removed before the prefill
        stages = rec["tokens_per_stage"]
        assert len(stages) == 3 and stages[0] > stages[1] > stages[2] and rec["layers"] == [2, 4]
    sizes = [int(layer.valid[0, 0].sum()) for layer in run("hico-forward@0.5").cache.layers]
    assert sizes[0] == sizes[1] > sizes[2] == sizes[3] > sizes[4] == sizes[5]  # later layers hold fewer
    assert parse_recipe("hico-forward@0.5").context.name == "hico-forward"
    assert parse_recipe("hico@0.5").context.name == "hico"  # ToMe merging keeps its name


def test_hico_forward_in_the_eval_harness_equals_generate(model6, tokenizer, one_thread):
    """Every row equals an independent generate(); the hico-forward recipes prefill alone (no shared
    prefix, no replayed tail), the others still share theirs; r = 0 reproduces the plain row."""
    from longlab import generate
    from longlab.eval.config import EvalConfig
    from longlab.eval.runner import SampleRunner
    from longlab.tasks import generate_samples as make_samples

    (sample,) = make_samples("redundant_niah", tokenizer, length=600, num_samples=1, seed=0)
    recipes = ["full", "snapkv@0.5", "hico-forward@0", "hico-forward@0.5", "hico-forward@0.5+snapkv@0.5"]
    for query_aware, chunk in ((True, 1024), (False, 256)):
        config = EvalConfig(out="unused", model="tiny", chunk_size=chunk, query_aware=query_aware)
        rows = {r["recipe"]: r for r in SampleRunner(model6, tokenizer, config, "t").run(sample, recipes)}
        assert sorted(rows) == sorted(recipes)
        for name in recipes:
            ref = generate(model6, tokenizer, sample.context, sample.question, name, chunk_size=chunk,
                           compress="end", query_aware=query_aware, max_new_tokens=sample.max_new_tokens,
                           answer_prefix=sample.answer_prefix)
            row = rows[name]
            assert row["prediction"] == ref.text, (name, query_aware)
            assert row["kv_bytes_after"] == ref.kv_bytes_after, (name, query_aware)
            if name.startswith("hico-forward"):
                assert row["extra"]["shared_prefill_tokens"] == 0 and not row["extra"].get("replayed")
                assert row["extra"]["context"]["tokens_per_stage"][0] == row["context_tokens"] + (
                    row["extra"]["question_tokens"] if query_aware else 0)
        assert rows["snapkv@0.5"]["extra"].get("replayed")  # the plain recipes still share their tail
        assert (rows["hico-forward@0.5"]["method"], rows["hico-forward@0.5"]["compression_ratio"]) == (
            "hico-forward", 0.5)
        if query_aware:  # one forward for both: nothing dropped = the plain row
            assert rows["hico-forward@0"]["prediction"] == rows["full"]["prediction"]
            assert rows["hico-forward@0"]["kv_bytes_after"] == rows["full"]["kv_bytes_after"]
        held = [rows[n]["kv_bytes_after"]
                for n in ("full", "hico-forward@0.5", "hico-forward@0.5+snapkv@0.5")]
        assert held[0] > held[1] > held[2]


def test_planner_gives_a_prefill_transform_its_own_prefill():
    from longlab.engine.planner import plan, replayable, transforms_prefill

    recipes = [(n, parse_recipe(n)) for n in ("full", "hico-forward@0.5", "hico-forward@0.5+snapkv@0.5")]
    groups = plan(recipes, 2000, 20, 512, False, {})
    starts = {name: g.start for g in groups for name, _ in g.recipes}
    assert starts["full"] > 0 and starts["hico-forward@0.5"] == starts["hico-forward@0.5+snapkv@0.5"] == 0
    assert [transforms_prefill(r) for _, r in recipes] == [False, True, True]
    assert [replayable(r) for _, r in recipes] == [True, False, False]


def test_hico_forward_from_the_cli(capsys, tmp_path):
    """`longlab generate`, `longlab eval` and `longlab methods` know the name (tiny-llama has 2 layers:
    one stage boundary, at layer 1)."""
    from longlab.cli import main

    recipe = "hico-forward@0.5:stages=[0.5]"
    assert main(["generate", "--model", "tiny-llama", "--recipe", recipe, "--context", CTX,
                 "--question", QUESTION, "--max-new-tokens", "4"]) == 0
    assert f"[{recipe}] context tokens" in capsys.readouterr().out
    out = tmp_path / "run"
    assert main(["eval", "--model", "tiny-llama", "--tasks", "redundant_niah", "--lengths", "500",
                 "--samples", "1", "--recipes", f"full,{recipe}", "--out", str(out), "--no-progress",
                 "--max-new-tokens", "4", "--threads", "1"]) == 0
    assert recipe in capsys.readouterr().out
    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    assert "hico-forward" in listing and "2501.00574" in listing
    assert main(["generate", "--model", "tiny-llama", "--recipe", "hico-forward@0.5", "--context", CTX]) == 2
    assert "hico-forward: stages" in capsys.readouterr().err  # 2 layers cannot hold two boundaries
