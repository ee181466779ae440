"""Context compression (longlab.compress): the spine place, identities, formulas, tasks and bad input."""

from __future__ import annotations

import math
import re

import pytest
import torch

import longlab  # noqa: F401  (registers the methods)
from longlab.compress.api import compress_prompts
from longlab.compress.base import Compressed, Prompt, keep_budget, select_units, units
from longlab.compress.lingua import coarse_keep, recover_subsequences
from longlab.compress.merge import tome_merge, tpp_replace
from longlab.engine.stream import Stream
from longlab.eval.config import EvalConfig
from longlab.eval.runner import SampleRunner
from longlab.generation import generate
from longlab.prompt import encode_prompts
from longlab.recipe import LonglabError, parse_recipe
from longlab.tasks import generate_samples as make_samples
from longlab.tasks import score
from longlab.tasks.compression import citation_scores

CTX = (
    " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(14))
    + "\n\nThe secret code of the amber archive is 4821937. "
    + "Caf\u00e9 cr\u00e8me, \u65e5\u672c\u8a9e text.\n\n"
    + " ".join(f"Shelf {i} holds {i * 3} jars of honey." for i in range(10))
)
QUESTION = "What is the secret code of the amber archive?"


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_recipe_part_and_name_round_trip():
    r = parse_recipe("llmlingua@0.5+snapkv@0.5")
    assert r.context is not None and r.context.name == "llmlingua" and r.context.kind == "context"
    assert [m.name for m in r.kv] == ["snapkv"]
    assert r.name == "llmlingua@0.5+snapkv@0.5"
    assert parse_recipe("hico@0.75").name == "hico@0.75" and not parse_recipe("tpp@0.5").is_empty
    with pytest.raises(LonglabError, match="two context compressors"):
        parse_recipe("llmlingua@0.5+tpp@0.5")


@pytest.mark.parametrize("spec", ["llmlingua@1", "llmlingua@1.5", "longllmlingua@-0.1", "hico@2", "tpp@1"])
def test_ratio_outside_range_is_refused(spec):
    with pytest.raises(LonglabError, match="compression_ratio"):
        parse_recipe(spec)


def test_units_never_split_words_numbers_or_characters(tokenizer):
    ids = _ids(tokenizer, CTX)
    us = units(tokenizer, ids)
    assert us[0].start == 0 and us[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(us, us[1:]))
    texts = [u.text for u in us]
    assert "".join(texts) == CTX  # byte-exact, every unit decodes whole
    assert " 4821937" in texts and " Caf\u00e9" in texts and " \u65e5\u672c\u8a9e" in texts
    assert all("\ufffd" not in t for t in texts)


def test_select_units_keeps_the_best_within_budget(tokenizer):
    us = units(tokenizer, _ids(tokenizer, " aa bbb c dddd"))  # sizes 3, 4, 2, 5
    assert [u.size for u in us] == [3, 4, 2, 5]
    assert select_units(us, [1.0, 4.0, 3.0, 2.0], budget=6) == [1, 2]  # 4 + 2 tokens
    assert select_units(us, [1.0, 4.0, 3.0, 2.0], budget=6, forced=[0]) == [0, 2]  # forced 3, then 2
    assert coarse_keep([2, 0, 1], [10, 10, 10], low=15, high=20) == [2, 0]
    assert keep_budget(10, 0.5) == 5 and keep_budget(7, 0.5) == 4 and keep_budget(3, 0.99) == 1


def _stream_logits(model, ctx_rows, q_rows, squeezed=None):
    stream = Stream(model, longlab.LonglabCache(None), len(ctx_rows))
    if squeezed is not None:
        logits = squeezed.feed(stream, ctx_rows, 1024, "chunk")
    else:
        logits = stream.feed(ctx_rows, 1024)
    return stream.feed(q_rows, 1024, compress="none"), logits


@pytest.mark.parametrize("spec", ["llmlingua@0", "longllmlingua@0", "hico@0", "tpp@0", "comi@0"])
def test_ratio_zero_reproduces_uncompressed_logits(llama, tokenizer, spec, one_thread):
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    squeezed = compress_prompts(llama, tokenizer, parse_recipe(spec).context, [ctx], [q], [QUESTION])
    assert squeezed.ids == [ctx]
    ref, _ = _stream_logits(llama, [ctx], [q])
    out, _ = _stream_logits(llama, squeezed.ids, [q], squeezed)
    assert torch.equal(out, ref)
    a = generate(llama, tokenizer, CTX, QUESTION, spec, max_new_tokens=6)
    b = generate(llama, tokenizer, CTX, QUESTION, "full", max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.context[0]["kept_tokens"] == len(ctx)


def test_embedding_override_with_the_models_own_embeddings_is_exact(llama, tokenizer, one_thread):
    """The merged-embedding path (hico): feeding the model's own input embeddings through the override
    reproduces the plain logits, also batched with left padding."""
    rows = [_ids(tokenizer, CTX), _ids(tokenizer, CTX[:300])]
    q = [_ids(tokenizer, "\n" + QUESTION)] * 2
    table = llama.get_input_embeddings()
    squeezed = compress_prompts(llama, tokenizer, None, rows, q, [QUESTION] * 2)
    squeezed.method = parse_recipe("hico@0.5").context
    squeezed.rows = [Compressed(r, list(range(len(r))), len(r), embeds=table(torch.tensor(r)).detach())
                     for r in rows]
    ref, _ = _stream_logits(llama, rows, q)
    out, _ = _stream_logits(llama, rows, q, squeezed)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # and the override is really read: zeroed embeddings change the logits; it is gone after the block
    squeezed.rows[0].embeds = torch.zeros_like(squeezed.rows[0].embeds)
    changed, _ = _stream_logits(llama, rows, q, squeezed)
    assert not torch.allclose(changed[0], ref[0])
    again, _ = _stream_logits(llama, rows, q)
    assert torch.equal(again, ref)


def test_tome_merging_conserves_size_weighted_sums():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, dtype=torch.float64)
    size = torch.randint(1, 4, (37,), generator=g).double()
    merged, s, index = tome_merge(x, size, keep=9)
    assert merged.shape == (9, 16) and s.shape == (9,)
    torch.testing.assert_close((merged * s[:, None]).sum(0), (x * size[:, None]).sum(0))
    assert float(s.sum()) == float(size.sum())
    assert index == sorted(index) and len(set(index)) == 9
    # identical tokens merge losslessly: each A token (even) has its twin in B (odd) and merges into it
    a, b = torch.randn(2, 8, generator=g, dtype=torch.float64)
    dup = torch.stack([a, a, b, b] * 3)
    m2, s2, idx2 = tome_merge(dup, torch.ones(12, dtype=torch.float64), keep=6)
    assert torch.equal(m2, torch.stack([a, b] * 3)) and float(s2.sum()) == 12.0  # exact, sizes add up
    assert idx2 == [1, 3, 5, 7, 9, 11]
    same, ss, idx = tome_merge(x, size, keep=37)  # nothing to remove: unchanged
    assert torch.equal(same, x) and torch.equal(ss, size) and idx == list(range(37))


def test_hico_output_is_shorter_and_read_as_embeddings(llama, tokenizer, one_thread):
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    sq = compress_prompts(llama, tokenizer, parse_recipe("hico@0.75").context, [ctx], [q], [QUESTION])
    out = sq.rows[0]
    assert out.embeds is not None and out.embeds.shape[0] == len(out.ids) == len(out.sizes)
    assert sum(out.sizes) == len(ctx) and out.source == sorted(out.source)
    assert len(out.ids) <= sum(keep_budget(min(64, len(ctx) - a), 0.75) for a in range(0, len(ctx), 64))
    r = generate(llama, tokenizer, CTX, QUESTION, "hico@0.75+snapkv@0.5", max_new_tokens=3)
    assert r.context_tokens == [len(out.ids)] and r.context[0]["merged"]


NUMBERS = re.compile(r"\d+")


@pytest.mark.parametrize("spec", ["llmlingua", "longllmlingua", "llmlingua:iterative=false"])
@pytest.mark.parametrize("ratio", [0.3, 0.6, 0.9])
def test_compressed_prompt_keeps_numbers_whole_and_the_budget(llama, tokenizer, spec, ratio, one_thread):
    name, _, params = spec.partition(":")
    method = parse_recipe(f"{name}@{ratio}" + (f":{params}" if params else "")).context
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    out = compress_prompts(llama, tokenizer, method, [ctx], [q], [QUESTION]).rows[0]
    assert 0 < out.kept_tokens <= keep_budget(len(ctx), ratio)
    assert out.kept_tokens >= keep_budget(len(ctx), ratio) - 12  # the greedy fill leaves little room
    text = tokenizer.decode(out.ids)
    text.encode("utf-8")  # whole characters only
    assert "\ufffd" not in text
    original = set(NUMBERS.findall(CTX))
    assert set(NUMBERS.findall(text)) <= original  # no number cut into a new one...
    kept = [tokenizer.decode([ctx[s] for s in range(a, b)]) for a, b in out.kept_spans]
    # ...and the needle is whole or gone
    assert "4821937" in text or not any(d in "".join(kept) for d in ("482", "937"))


def test_longllmlingua_needs_a_question_and_records_its_ranking(llama, tokenizer, one_thread):
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [None], [""])
    with pytest.raises(LonglabError, match="needs a question"):
        compress_prompts(llama, tokenizer, parse_recipe("longllmlingua@0.5").context, [ctx], [q], [None])
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    out = compress_prompts(llama, tokenizer, parse_recipe("longllmlingua@0.5").context, [ctx], [q],
                           [QUESTION]).rows[0]
    assert sorted(out.info["ranking"]) == list(range(out.info["documents"])) and out.info["documents"] == 3


def test_subsequence_recovery_restores_dropped_words(tokenizer):
    text = " The secret code of the amber archive is 4821937."
    ids = _ids(tokenizer, text)
    prompt = Prompt(ids, "q", [], tokenizer)
    us = prompt.units
    drop = {k for k, u in enumerate(us) if u.text in (" of", " the")}
    source = [t for k, u in enumerate(us) if k not in drop for t in range(u.start, u.end)]
    compressed = Compressed([ids[s] for s in source], source, len(ids))
    assert recover_subsequences("secret code amber archive.", prompt, compressed) == \
        "secret code of the amber archive."
    assert recover_subsequences("nothing here", prompt, compressed) == "nothing here"


def test_tpp_backward_builder_hand_example():
    a, b, c = {1, 2, 3}, {1, 2, 4}, {7, 8, 9}
    # newest (last) kept; b ~ c? no (0); a ~ b: 2/4 = 0.5 -> replaced at tau 0.5, kept at 0.6
    assert tpp_replace([a, b, c], 0.5) == [True, False, False]
    assert tpp_replace([a, b, c], 0.6) == [False, False, False]
    # the reference stays the last kept segment: a repeats a, a -> both replaced against the newest a
    assert tpp_replace([a, a, a], 1.0) == [True, True, False]


def test_tpp_compresses_redundant_frames_and_keeps_the_needles(tokenizer):
    (s,) = make_samples("redundant_niah", tokenizer, length=1500, num_samples=1, seed=1)
    (ctx,), (q,) = encode_prompts(tokenizer, [s.context], [s.question], [""])
    out = compress_prompts(None, tokenizer, parse_recipe("tpp@0.5").context, [ctx], [q], [s.question]).rows[0]
    text = tokenizer.decode(out.ids)
    assert out.kept_tokens <= keep_budget(len(ctx), 0.5) and "[similar]" in text
    assert s.answers[0] in text  # a needle is unlike its neighbours: never replaced


def test_bad_input_gives_clear_errors(llama, tokenizer):
    with pytest.raises(LonglabError, match="context is empty"):
        generate(llama, tokenizer, "   ", QUESTION, "llmlingua@0.5")
    with pytest.raises(LonglabError, match="one token repeated"):
        generate(llama, tokenizer, "a" * 200, QUESTION, "llmlingua@0.5")
    with pytest.raises(LonglabError, match="not valid UTF-8"):
        generate(llama, tokenizer, b"caf\xe9 \xff\xfe", QUESTION, "llmlingua@0.5")
    with pytest.raises(LonglabError, match="compression_ratio"):
        generate(llama, tokenizer, CTX, QUESTION, "tpp@1")
    with pytest.raises(LonglabError, match="empty"):
        compress_prompts(llama, tokenizer, parse_recipe("tpp@0.5").context, [[]], [[]], [QUESTION])


def test_eval_rows_equal_generate_and_record_the_compression(llama, tokenizer, one_thread):
    (sample,) = make_samples("redundant_niah", tokenizer, length=700, num_samples=1, seed=0)
    recipes = ["full", "llmlingua@0.5", "llmlingua@0.5+snapkv@0.5", "tpp@0.5", "hico@0.5"]
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128)
    rows = {r["recipe"]: r for r in SampleRunner(llama, tokenizer, config, "t").run(sample, recipes)}
    assert sorted(rows) == sorted(recipes)
    assert "context" not in rows["full"]["extra"]
    for name in recipes[1:]:
        row = rows[name]
        rec = row["extra"]["context"]
        assert rec["kept_tokens"] == row["context_tokens"] < rec["original_tokens"]
        assert row["extra"]["context_s"] > 0
        ref = generate(
            llama, tokenizer, sample.context, sample.question, name, chunk_size=128, compress="end",
            max_new_tokens=sample.max_new_tokens, answer_prefix=sample.answer_prefix,
        )
        assert row["prediction"] == ref.text, name
        assert row["context_tokens"] == ref.context_tokens[0]
    assert (rows["llmlingua@0.5"]["method"], rows["llmlingua@0.5"]["compression_ratio"]) == ("llmlingua", 0.5)
    assert rows["llmlingua@0.5+snapkv@0.5"]["kv_bytes_after"] < rows["llmlingua@0.5"]["kv_bytes_after"]


def test_tasks_have_exact_answers_in_context(tokenizer):
    for task in ("redundant_niah", "redundant_niah_2hop"):
        for s in make_samples(task, tokenizer, length=900, num_samples=2, seed=3, num_needles=3):
            assert s.answers[0] in s.context
            assert len(_ids(tokenizer, s.context)) + len(_ids(tokenizer, s.question)) <= 900
            if task.endswith("2hop"):
                key = s.question.split("that the ")[1].split(" archive")[0]
                link = re.search(rf"The {key} archive points to the (\S+) archive", s.context)
                assert link and f"for the {link.group(1)} archive is {s.answers[0]}" in s.context
    (c,) = make_samples("cite_qa", tokenizer, length=900, num_samples=1, seed=0)
    number, *ids = c.answers
    assert ids == [f"[{i}]" for i in c.metadata["cited"]]
    for i in ids:
        assert re.search(rf"\{i[:-1]}\] [^\[]*({number}|kept by)", c.context)
    assert score("cite_qa", f"{number} {ids[0]}{ids[1]}", c.answers) == 1.0
    half = citation_scores(f"{number} {ids[0]}[99]", c.answers)
    assert half == {"correct": 1.0, "precision": 0.5, "recall": 0.5, "f1": 0.5}


# ------------------------------------------------------------------------------------------------ guidance
def test_guidance_with_an_empty_pool_is_plain_decoding(llama, tokenizer, one_thread):
    for kv in ("", "+snapkv@0.5"):
        a = generate(llama, tokenizer, CTX, QUESTION, "guidance:empty_pool=true" + kv, max_new_tokens=12)
        b = generate(llama, tokenizer, CTX, QUESTION, "full" + kv if kv else "full", max_new_tokens=12)
        assert a.token_ids == b.token_ids and a.context[0]["pool_sentences"] == 0
    with pytest.raises(LonglabError, match="compression_ratio must be 0"):
        parse_recipe("guidance@0.5")


def test_guidance_pool_reads_numbered_sentences_and_matches_by_word_f1(tokenizer):
    from longlab.compress.guidance import Guidance, build_pool, word_f1

    text = ("[1] The archive is kept by Nora Quint in the hall. [2] Short one. "
            "[3] Nora Quint has badge number 5531904.")
    prompt = Prompt(_ids(tokenizer, text), None, [], tokenizer)
    pool = build_pool(prompt, prefix_tokens=12, min_tokens=16)
    assert [e.cite for e in pool] == [1, 3]  # [2] is too short for the pool
    assert tokenizer.decode(pool[1].ids).strip() == "Nora Quint has badge number 5531904."
    assert pool[1].prefix == ["nora", "quint", "has"]  # the first 12 byte tokens
    assert word_f1(["a", "b"], ["a", "c"]) == 0.5 and word_f1([], ["a"]) == 0.0
    g = Guidance(threshold=0.8)
    assert g.match(["nora", "quint", "has", "a"], pool) == 1 and g.match(["the", "cat"], pool) is None


def test_guidance_forces_the_sentence_and_its_citation_teacher_forced(llama, tokenizer, one_thread):
    """A matched sentence is committed with its marker; what follows equals plain greedy decoding of the
    prompt extended by those tokens (the cache holds exactly what was emitted)."""
    from longlab.compress.guidance import Guidance

    class FirstMatch(Guidance):  # the tiny random model never writes words: match at the first boundary
        def match(self, words, pool):
            return 0 if len(pool) == 2 else None

    FirstMatch.name = "guidance"
    text = "[1] The archive is kept by Nora Quint in the hall. [2] Nora Quint has badge number 5531904."
    (ctx,), (q,) = encode_prompts(tokenizer, [text], [QUESTION], [""])
    method = FirstMatch()
    sq = compress_prompts(llama, tokenizer, method, [ctx], [q], [QUESTION])
    stream = Stream(llama, longlab.LonglabCache(None), 1)
    stream.feed(sq.ids, 1024)
    logits = stream.feed([q], 1024, compress="none")
    (tokens,) = sq.decode(stream, logits, 90, set())
    forced = sq.rows[0].state[0].ids + _ids(tokenizer, " [1]")
    assert tokens[: len(forced)] == forced and sq.rows[0].info["forced_sentences"] == 1
    assert tokenizer.decode(forced).strip() == "The archive is kept by Nora Quint in the hall. [1]"
    ref = Stream(llama, longlab.LonglabCache(None), 1)
    ref.feed(sq.ids, 1024)
    ref_logits = ref.feed([q + forced], 1024, compress="none")
    rest = ref.decode(ref_logits, 90 - len(forced), set())[0]
    assert tokens[len(forced):] == rest


def test_guidance_runs_in_the_eval_harness_as_in_generate(llama, tokenizer, one_thread):
    (sample,) = make_samples("cite_qa", tokenizer, length=600, num_samples=1, seed=0)
    recipes = ["full", "guidance", "guidance:empty_pool=true+snapkv@0.5", "snapkv@0.5"]
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128)
    rows = {r["recipe"]: r for r in SampleRunner(llama, tokenizer, config, "t").run(sample, recipes)}
    assert rows["guidance:empty_pool=true+snapkv@0.5"]["prediction"] == rows["snapkv@0.5"]["prediction"]
    ref = generate(llama, tokenizer, sample.context, sample.question, "guidance", chunk_size=128,
                   compress="end", max_new_tokens=sample.max_new_tokens, answer_prefix=sample.answer_prefix)
    assert rows["guidance"]["prediction"] == ref.text
    assert rows["guidance"]["extra"]["context"]["pool_sentences"] > 0
    assert rows["guidance"]["extra"]["context"]["lookaheads"] >= 1


def test_harness_hooks_take_the_compression_as_an_argument(llama, tokenizer, one_thread):
    """prefill_rows / decode_rows read no module state: a guiding or prefill-transforming recipe needs
    the Squeeze of its own compression, passed explicitly; plain recipes need none."""
    import longlab.compress.api as api
    from longlab.cache import LonglabCache

    assert not [k for k, v in vars(api).items() if isinstance(v, dict) and k not in ("_LOADED",)
                and not k.startswith("__")]
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    guided = parse_recipe("guidance")
    stream = Stream(llama, LonglabCache(guided), 1)
    logits = stream.feed([ctx + q], 128, "end")
    with pytest.raises(LonglabError, match="Squeeze"):
        api.decode_rows([guided], stream, logits, 4, set())
    other = api.compress_prompts(llama, tokenizer, parse_recipe("inftythink").context, [ctx], [q], [QUESTION])
    with pytest.raises(LonglabError, match="Squeeze"):  # the compression of another method
        api.decode_rows([guided], stream, logits, 4, set(), squeeze=other)
    squeeze = api.compress_prompts(llama, tokenizer, guided.context, [ctx], [q], [QUESTION])
    assert len(api.decode_rows([guided], stream, logits, 4, set(), squeeze=squeeze)[0]) == 4
    fwd = parse_recipe("hico-forward@0.5")
    with pytest.raises(LonglabError, match="Squeeze"):
        api.prefill_rows(fwd, Stream(llama, LonglabCache(fwd), 1), [ctx], 128)
    plain = Stream(llama, LonglabCache(parse_recipe("full")), 1)
    assert api.prefill_rows(parse_recipe("full"), plain, [ctx], 128).shape[0] == 1


# ------------------------------------------------------------------------------------------------ COMI
def test_comi_mig_formulas_by_hand():
    from longlab.compress.comi import group_weights, reallocate

    hq = torch.tensor([1.0, 0.0])
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    # 3 groups of 2: rel = max cos to q = (1, 1/sqrt2, 1); reps 0, 2, 5; red: g0 ~ g2 (1), g1 ~ g0 (1/sqrt2)
    r2 = 2**-0.5
    mig = torch.tensor([1 - 1, r2 - r2, 1 - 1])
    pi = torch.softmax(-mig, 0)  # equal: the 3 spare tokens go one each
    assert torch.allclose(pi, torch.full((3,), 1 / 3))
    assert reallocate(h, hq, 3) == [2, 2, 2]
    # a group far from the question (low MIG) takes more tokens
    h2 = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.0, 1.0], [0.1, 1.0], [0.0, 1.0]])
    sizes = reallocate(h2, hq, 3)
    assert sum(sizes) == 6 and min(sizes) >= 1 and sizes[0] < max(sizes)
    w = group_weights(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), hq)
    # mig = (1 - 0, 0 - 0): softmax -> (e/(e+1), 1/(e+1))
    e = torch.e
    assert torch.allclose(w, torch.tensor([e / (e + 1), 1 / (e + 1)]))


def test_comi_merges_into_fewer_embeddings(llama, tokenizer, one_thread):
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    method = parse_recipe("comi@0.75").context
    out = compress_prompts(llama, tokenizer, method, [ctx], [q], [QUESTION]).rows[0]
    assert out.embeds.shape[0] == len(out.ids) == keep_budget(len(ctx), 0.75)
    assert sum(out.sizes) == len(ctx) and out.source == sorted(out.source)
    r = generate(llama, tokenizer, CTX, QUESTION, "comi@0.75+snapkv@0.5", max_new_tokens=3)
    assert r.context[0]["merged"] and r.context_tokens == [len(out.ids)]


# ------------------------------------------------------------------------------------------------ InftyThink
def test_inftythink_split_summary():
    from longlab.compress.inftythink import split_summary

    assert split_summary("<think> a + b </think> The answer is 7.") == (None, "The answer is 7.")
    assert split_summary("<think> x=3 </think>\n<summary> * x = 3 </summary>") == ("* x = 3", "")
    assert split_summary("<summary> unfinished") == (None, "unfinished")


def test_inftythink_without_summaries_is_one_plain_iteration(llama, tokenizer, one_thread):
    r = generate(llama, tokenizer, CTX, QUESTION, "inftythink:segment=10", max_new_tokens=4)
    assert r.context[0]["iterations"] == 1 and r.context[0]["reasoning_tokens"] == 10
    method = parse_recipe("inftythink").context
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    stream = Stream(llama, longlab.LonglabCache(None), 1)
    stream.feed([ctx + _ids(tokenizer, method.prompt_instruction)], 1024)
    ref = stream.decode(stream.feed([q], 1024, compress="none"), 10, set())[0]
    assert r.token_ids[0] == ref


def test_inftythink_iterations_keep_the_cache_bounded(llama, tokenizer, one_thread, monkeypatch):
    """Forced summaries (the tiny random model writes none): every iteration restarts from prompt +
    history, so the peak cache is one iteration's, while the reasoning grows with the iterations."""
    import longlab.compress.inftythink as it

    monkeypatch.setattr(it, "split_summary", lambda text: ("step done", ""))
    peaks = {}
    for n in (1, 4):
        r = generate(llama, tokenizer, CTX, QUESTION, f"inftythink:segment=16,iterations={n}")
        rec = r.context[0]
        assert rec["iterations"] == n and rec["reasoning_tokens"] == 16 * n
        peaks[n] = rec["peak_kv_bytes"]
    history = len(_ids(tokenizer, "<history>step done</history>\n"))
    n_q = len(encode_prompts(tokenizer, [CTX], [QUESTION], [""])[1][0])
    per_token = peaks[1] / (r.context_tokens[0] + n_q + 15)  # the last token generated is not cached
    assert peaks[4] == pytest.approx(peaks[1] + history * per_token, rel=1e-6)  # one iteration's, not four


ASK = "inftythink:summarise=ask,segment=16,summary_tokens=6,ask=Summarise your work."


def test_inftythink_ask_first_segment_is_plain_decoding(llama, tokenizer, one_thread):
    """summarise=ask adds no instruction: one iteration is plain greedy decoding of the prompt."""
    r = generate(llama, tokenizer, CTX, QUESTION, f"{ASK},iterations=1")
    ref = generate(llama, tokenizer, CTX, QUESTION, "full", max_new_tokens=16)
    assert r.token_ids == ref.token_ids and r.context_tokens == ref.context_tokens
    rec = r.context[0]
    assert rec["iterations"] == 1 and rec["asked"] == 0 and rec["stop"] == "iterations"


def test_inftythink_ask_summaries_keep_the_cache_bounded(llama, tokenizer, one_thread):
    """Each cut segment is followed by the request turn and the model's own reply (its summary), which
    becomes the next iteration's history in a fresh cache: the reasoning grows with the iterations, the
    peak cache stays within prompt + history + segment + request + reply."""
    from longlab.compress.inftythink import ask_turn

    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    n_prompt = len(ctx) + len(q)
    n_ask = len(ask_turn(tokenizer, parse_recipe(ASK).context.ask))
    short, long = (generate(llama, tokenizer, CTX, QUESTION, "full", max_new_tokens=k).cache
                   for k in (16, 40))
    per_token = (long.nbytes() - short.nbytes()) / 24  # bytes of one cached token (keys, values, index)
    assert short.nbytes() == per_token * (n_prompt + 15)
    for n in (2, 8):
        r = generate(llama, tokenizer, CTX, QUESTION, f"{ASK},iterations={n}")
        rec = r.context[0]
        assert rec["iterations"] == n and rec["asked"] == n - 1 and rec["stop"] == "iterations"
        assert rec["reasoning_tokens"] == 16 * n and 0 < rec["summary_tokens_used"] <= 6 * (n - 1)
        assert len(rec["summaries"]) == n - 1 and all(rec["summaries"])
        assert len(rec["history_tokens"]) == n - 1
        held = rec["peak_kv_bytes"] / per_token  # tokens in the largest cache of any iteration
        # iteration 1 holds prompt + segment + request + reply - 1; later ones a history on top
        assert n_prompt + 16 + n_ask < held <= n_prompt + max(rec["history_tokens"]) + 16 + n_ask + 5
    assert held < n_prompt + 16 * 8 + 6 * 7  # one long context of the same tokens would hold more


def test_inftythink_ask_stops_when_the_model_ends_its_turn(llama, tokenizer, one_thread):
    """Stop rule: a segment that ends at end of turn is the answer (no request, no further iteration)."""
    method = parse_recipe(f"{ASK},iterations=4").context
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    compressed = method.compress(Prompt(ctx, QUESTION, q, tokenizer))

    def run(eos):
        stream = Stream(llama, longlab.LonglabCache(None), 1)
        logits = stream.feed([compressed.ids + q], 1024)
        return method.guided_decode(stream, logits, 0, eos, tokenizer, compressed)

    last, stats = run(set())
    assert stats["iterations"] == 4 and stats["asked"] == 3 and len(last) == 16
    plain = generate(llama, tokenizer, CTX, QUESTION, "full", max_new_tokens=16).token_ids[0]  # segment 1
    k = next(i for i in range(3, 16) if plain[i] not in plain[:i])  # a token first emitted at step k
    tokens, stats = run({plain[k]})
    assert tokens == plain[: k + 1] and stats["iterations"] == 1 and stats["asked"] == 0
    assert stats["stop"] == "end of turn"


def test_inftythink_ask_runs_in_the_eval_harness_as_in_generate(llama, tokenizer, one_thread):
    (sample,) = make_samples("lookup_chain", tokenizer, length=300, num_samples=1, seed=0, reason=True)
    name = f"{ASK},iterations=3"
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, max_new_tokens=8)
    rows = {r["recipe"]: r for r in SampleRunner(llama, tokenizer, config, "t").run(sample, ["full", name])}
    ref = generate(llama, tokenizer, sample.context, sample.question, name, chunk_size=128, compress="end",
                   answer_prefix=sample.answer_prefix)
    assert rows[name]["prediction"] == ref.text and rows[name]["extra"]["context"]["iterations"] == 3
    assert rows[name]["extra"]["context"]["asked"] == 2 and rows["full"]["extra"]["generated_tokens"] <= 8


@pytest.mark.parametrize("params", ["summarise=auto", "summary_tokens=0", "history=plain", "segment=0"])
def test_inftythink_bad_settings_are_refused(params):
    with pytest.raises(LonglabError, match="inftythink"):
        parse_recipe(f"inftythink:{params}")


# ------------------------------------------------------------------------------------------------ hico-drop
def test_hico_drop_keeps_cumulative_stage_ratios(tokenizer, one_thread):
    from longlab.compress.drop import stage_of
    from longlab.models import build_tiny_model

    stages = [stage_of(i, 6, (1 / 3, 2 / 3)) for i in range(6)]
    assert stages == [(0, 0), (0, 0), (1, 2), (1, 2), (2, 4), (2, 4)]
    model = build_tiny_model("tiny-llama", num_hidden_layers=6)
    a = generate(model, tokenizer, CTX, QUESTION, "hico-drop@0", max_new_tokens=6)
    b = generate(model, tokenizer, CTX, QUESTION, "full", max_new_tokens=6)
    assert a.token_ids == b.token_ids
    r = generate(model, tokenizer, CTX, QUESTION, "hico-drop@0.75", max_new_tokens=2, compress="end")
    n = r.context_tokens[0]
    kept = []
    for layer in r.cache.layers:
        pos = [sorted(int(p) for p in layer.index[0, h][layer.valid[0, h]].tolist() if p < n)
               for h in range(layer.index.shape[1])]
        assert all(p == pos[0] for p in pos)  # token-level: every head keeps the same tokens
        kept.append(set(pos[0]))
    sizes = [len(k) for k in kept]
    assert sizes[:2] == [n, n] and sizes[2:4] == [math.ceil(0.5 * n)] * 2
    assert sizes[4:] == [math.ceil(0.25 * n)] * 2
    assert kept[4] <= kept[2] and kept[2] == kept[3] and kept[4] == kept[5]  # cumulative, shared in a stage


def test_hico_drop_in_the_eval_harness_equals_generate(tokenizer, one_thread):
    from longlab.models import build_tiny_model

    model = build_tiny_model("tiny-llama", num_hidden_layers=6)
    (sample,) = make_samples("redundant_niah", tokenizer, length=700, num_samples=1, seed=0)
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128)
    rows = {r["recipe"]: r for r in SampleRunner(model, tokenizer, config, "t").run(
        sample, ["full", "hico-drop@0.75", "snapkv@0.75"])}
    ref = generate(model, tokenizer, sample.context, sample.question, "hico-drop@0.75", chunk_size=128,
                   compress="end", max_new_tokens=sample.max_new_tokens, answer_prefix=sample.answer_prefix)
    assert rows["hico-drop@0.75"]["prediction"] == ref.text
    assert rows["hico-drop@0.75"]["kv_bytes_after"] == ref.kv_bytes_after
    assert rows["snapkv@0.75"]["kv_bytes_after"] < ref.kv_bytes_after < rows["full"]["kv_bytes_after"]


def test_a_compressor_with_docs_is_refused(llama, tokenizer):
    with pytest.raises(LonglabError, match="does not combine with docs"):
        generate(llama, tokenizer, docs=["a b c.", "d e f."], question=QUESTION, reuse="full-prefill",
                 recipe="llmlingua@0.5")


def test_lookup_chain_answer_is_the_last_value(tokenizer):
    (s,) = make_samples("lookup_chain", tokenizer, length=900, num_samples=1, seed=2)
    lines = re.findall(r"Let (v\d+) = ([^.]+)\.", s.context)
    value = None
    for _, rhs in lines:
        parts = rhs.split()
        step = int(parts[2]) if len(parts) == 3 and parts[1] == "+" else -int(parts[-1])
        value = int(parts[0]) if len(parts) == 1 else value + step
    assert s.answers == [str(value)] and s.question.endswith(f"{lines[-1][0]}?") and s.metadata["steps"] > 20


def test_lookup_chain_reason_asks_for_the_steps_and_scores_the_final_number(tokenizer):
    from longlab.tasks import score_sample
    from longlab.tasks.compression import final_number

    (plain,) = make_samples("lookup_chain", tokenizer, length=300, num_samples=1, seed=1)
    (s,) = make_samples("lookup_chain", tokenizer, length=300, num_samples=1, seed=1, reason=True)
    # the same chain, shorter (the longer question takes room)
    assert plain.context.startswith(s.context[:-1]) and s.metadata["steps"] <= plain.metadata["steps"]
    assert s.answer_prefix == "" and "Answer: <number>" in s.question and s.max_new_tokens == 1024
    a = s.answers[0]
    assert score_sample(s, f"v1 = 3\nv2 = {a}\nAnswer: {a}") == 1.0
    assert score_sample(s, f"v2 = {a}, then v3 = 7") == 0.0  # the answer only as an intermediate
    assert score_sample(s, f"so it is {a}.") == 1.0 and score_sample(s, "no number") == 0.0
    assert final_number(f"Answer: 12, not {a}", [a]) == float(a == "12")
    with pytest.raises(ValueError, match="reason"):
        make_samples("lookup_chain", tokenizer, length=300, reason="yes")
