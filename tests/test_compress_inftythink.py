"""InftyThink (longlab.compress.inftythink): the prompt is prefilled once, yet every iteration decodes the
tokens a fresh prefill of prompt + history gives; and the worked-chain task's instruction leaks no value."""

from __future__ import annotations

import re

import pytest

import longlab  # noqa: F401  (registers the methods)
import longlab.compress.inftythink as it
from longlab.cache import LonglabCache
from longlab.compress.base import Prompt
from longlab.engine.stream import Stream
from longlab.generation import generate
from longlab.prompt import encode_prompts
from longlab.recipe import parse_recipe
from longlab.tasks import generate_samples as make_samples
from longlab.tasks.compression import REASON_QUESTION

CTX = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(14)) + " The code is 4821937."
QUESTION = "What is the code?"
TAGS = "inftythink:segment=12,iterations=4"
ASK = "inftythink:summarise=ask,segment=12,iterations=4,summary_tokens=6,ask=Summarise your work."


def _forced(text: str) -> tuple[str, str]:
    """A summary that depends on the segment (the tiny random models write no <summary>): a wrong
    segment gives a wrong history, so a later iteration would differ too."""
    return "after " + text[:8], ""


def _reference(model, tokenizer, spec: str) -> tuple[list[int], list[str], list[int], int]:
    """InftyThink written out independently: every iteration prefills prompt + history from scratch in a
    new cache, decodes its segment greedily and (with ``ask``) asks for the summary in the same cache.
    Returns (final tokens, summaries, history lengths, iterations)."""
    method = parse_recipe(spec).context
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    instruction = method.prompt_instruction
    prompt = ctx + (tokenizer(instruction, add_special_tokens=False)["input_ids"] if instruction else []) + q
    template = "<history>{}</history>\n" if method.summarise == "tags" else \
        "My progress so far: {}\nContinuing from there:\n"
    history: list[int] = []
    summaries, lengths = [], []
    for j in range(method.iterations):
        stream = Stream(model, LonglabCache(None), 1)
        logits = stream.feed([prompt + history], 4096, compress="none")  # [1, V]
        tokens = stream.decode(logits, method.segment, set())[0]
        if j == method.iterations - 1:
            return tokens, summaries, lengths, j + 1
        if method.summarise == "tags":
            summary = it.split_summary(tokenizer.decode(tokens, skip_special_tokens=True))[0]
        else:
            logits = stream.feed([[tokens[-1], *it.ask_turn(tokenizer, method.ask)]], 4096, compress="none")
            reply = stream.decode(logits, method.summary_tokens, set())[0]
            summary = tokenizer.decode(reply, skip_special_tokens=True).strip() or None
        if summary is None:
            return tokens, summaries, lengths, j + 1
        summaries.append(summary[:200])
        history = list(tokenizer(template.format(summary), add_special_tokens=False)["input_ids"])
        lengths.append(len(history))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("spec", [TAGS, ASK])
def test_inftythink_equals_a_fresh_prefill_every_iteration(tiny_models, tokenizer, one_thread, monkeypatch,
                                                           name, spec):
    """The prompt prefilled once and forked per iteration gives, token for token, what a fresh prefill
    of prompt + history gives at every iteration (greedy), for the paper's tags and the asked summaries."""
    model = tiny_models[name][0]
    if spec == TAGS:
        monkeypatch.setattr(it, "split_summary", _forced)
    ref_tokens, summaries, lengths, iterations = _reference(model, tokenizer, spec)
    assert iterations >= 3 and len(set(summaries)) >= 2  # 3+ iterations, the history changes
    r = generate(model, tokenizer, CTX, QUESTION, spec)
    rec = r.context[0]
    assert r.token_ids[0] == ref_tokens and rec["iterations"] == iterations
    assert rec["summaries"] == summaries and rec["history_tokens"] == lengths


@pytest.mark.parametrize("spec", [TAGS, ASK])
def test_inftythink_prefills_the_prompt_once(llama, tokenizer, one_thread, monkeypatch, spec):
    """Tokens through the model's forward over the whole run: the prompt once, each history once, the
    decode steps and (ask) each request turn and reply; not the prompt again at every iteration. The
    prompt-only stream is left as it was, and each iteration's cache holds prompt + history + its own
    tokens only (the fork neither double-counts the shared prompt nor keeps an earlier iteration)."""
    monkeypatch.setattr(it, "split_summary", _forced if spec == TAGS else lambda text: (None, text))
    method = parse_recipe(spec).context
    (ctx,), (q,) = encode_prompts(tokenizer, [CTX], [QUESTION], [""])
    compressed = method.compress(Prompt(ctx, QUESTION, q, tokenizer))
    n_prompt = len(compressed.ids) + len(q)
    fed: list[int] = []
    handle = llama.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        stream = Stream(llama, LonglabCache(None), 1)
        logits = stream.feed([compressed.ids + q], 1024)
        prompt_bytes = stream.cache.nbytes()
        fed.clear()
        tokens, stats = method.guided_decode(stream, logits, 0, set(), tokenizer, compressed)
    finally:
        handle.remove()
    n = stats["iterations"]
    assert n == 4 and stats["stop"] == "iterations" and len(tokens) == 12
    asked = stats["asked"] * (1 + len(it.ask_turn(tokenizer, method.ask))) + stats["summary_tokens_used"] - \
        stats["asked"]  # each request (the cut token + the turn) and reply (its last token is not fed)
    assert sum(fed) == sum(stats["history_tokens"]) + n * (12 - 1) + asked  # no prompt token fed again
    assert max(fed) < n_prompt and (spec != TAGS or max(fed) == max(stats["history_tokens"]))
    assert stream.cache.nbytes() == prompt_bytes == stats["prompt_kv_bytes"]  # the prompt stream: untouched
    per_token = prompt_bytes / n_prompt
    longest = n_prompt + max(stats["history_tokens"]) + 12 - 1  # the last segment token is not cached
    if spec == TAGS:  # the largest iteration's cache exactly: nothing of an earlier one, no prompt twice
        assert stats["peak_kv_bytes"] == pytest.approx(longest * per_token, rel=1e-9)
    else:  # + the request turn and the reply
        assert longest * per_token < stats["peak_kv_bytes"] <= (longest + 1 + len(
            it.ask_turn(tokenizer, method.ask)) + method.summary_tokens) * per_token


def _chain_values(sample) -> set[int]:
    """Every value of the chain v0, v1, ..., vn (parsed from the context)."""
    lines = re.findall(r"Let v\d+ = ([^.]+)\.", sample.context)
    values, value = set(), 0
    for rhs in lines:
        parts = rhs.split()
        value = int(parts[0]) if len(parts) == 1 else value + (1 if parts[1] == "+" else -1) * int(parts[2])
        values.add(value)
    return values


def test_lookup_chain_instruction_never_holds_a_sample_value(tokenizer):
    """The worked-chain instruction shows its format with a placeholder: no number in it (nor in any
    InftyThink instruction) can be a sample's v_i, the answer included (the old example 'v1 = 905' was
    sample 0's own v1)."""
    texts = [REASON_QUESTION, it.TAGS_INSTRUCTION, it.ASK, it.HISTORY, it.ASK_HISTORY]
    numbers = {int(x) for t in texts for x in re.findall(r"\d+", t)}
    checked = 0
    for seed in (0, 1):
        for length in (300, 600, 1200):
            for s in make_samples("lookup_chain", tokenizer, length, 4, seed, reason=True):
                values = _chain_values(s)
                assert int(s.answers[0]) in values and len(values) > 1
                question = re.sub(r"\bv\d+\b", "", s.question)  # the asked variable's name is not a value
                assert REASON_QUESTION in s.question and not re.findall(r"\d", question)
                assert not numbers & values
                checked += 1
    assert checked == 24 and not numbers
