"""The one engine: requests of every family in one batch give what each gives alone; the step-wise API."""

from __future__ import annotations

import pytest
import torch

from longlab import Engine, LonglabError, Request
from longlab.reuse import MemoryStore

CTX = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(50))
OTHER = " ".join(f"Crate {i} holds {i * 3 % 11} apples." for i in range(40))
DOCS = [
    "The archive code is 4417. It opens the west door.",
    "Marta keeps the ledger in the blue cabinet.",
    "The west door leads to the map room.",
]


def _requests() -> list[Request]:
    return [
        Request(context=CTX, question="Where is item 3?", recipe="snapkv@0.5", max_new_tokens=8),
        Request(documents=DOCS, question="What is the archive code?", reuse="cacheblend:recompute=0.5",
                max_new_tokens=8),
        Request(context=OTHER, question="How many apples?", recipe="full", speculative="lookup",
                max_new_tokens=8),
        Request(context=CTX, question="Where is item 9?", recipe="streaming@0.5", max_new_tokens=8,
                temperature=0.8, seed=5),
        Request(context=OTHER, question="How many apples in crate 2?", recipe="kivi4", max_new_tokens=6),
        Request(context=CTX, question="Where is item 3?", recipe="h2o@0.5", max_new_tokens=8),
    ]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_mixed_batch_gives_each_request_what_it_gives_alone(tiny_models, tokenizer, name):
    """A KV recipe, a reuse request, a speculative request, a sampled request, a quantized cache and a
    second recipe on a shared prompt, in one run: every request's tokens equal its own run alone."""
    model = tiny_models[name][0]
    together = Engine(model, tokenizer, store=MemoryStore()).run(_requests())
    for request, mixed in zip(_requests(), together):
        (alone,) = Engine(model, tokenizer, store=MemoryStore()).run([request])
        assert mixed.token_ids == alone.token_ids, request
        assert mixed.text == alone.text
    kinds = {r.request.recipe: r for r in together}
    assert kinds["snapkv@0.5"].extra["decode_batch"] >= 2  # plain rows shared a decode batch
    assert together[2].speculation is not None and together[2].speculation["spec"].startswith("lookup")
    assert together[1].reuse is not None and together[1].recipe.startswith("reuse=cacheblend")


def test_rows_join_and_leave_the_running_batch(tiny_models, tokenizer):
    """A request submitted while others decode joins their batch between steps; finished rows leave."""
    model = tiny_models["tiny-llama"][0]
    engine = Engine(model, tokenizer)
    first = engine.submit(Request(context=CTX, question="Where is item 3?", recipe="snapkv@0.5",
                                  max_new_tokens=12))
    done = engine.step()  # admits (prefills) the first request
    assert done == [] and len(engine._lanes) == 1
    engine.step()
    engine.step()  # two decode steps
    second = engine.submit(Request(context=OTHER, question="How many apples?", recipe="full",
                                   max_new_tokens=3))
    engine.step()  # admits the second: it joins the running batch
    assert len(engine._lanes) == 1 and len(engine._lanes[0].rows) == 2
    results = {}
    while engine.busy:
        for r in engine.step():
            results[r.key] = r
    assert set(results) == {first, second}
    alone = Engine(model, tokenizer).run([
        Request(context=CTX, question="Where is item 3?", recipe="snapkv@0.5", max_new_tokens=12),
        Request(context=OTHER, question="How many apples?", recipe="full", max_new_tokens=3),
    ])
    assert results[first].token_ids == alone[0].token_ids and results[second].token_ids == alone[1].token_ids
    assert len(results[second].token_ids) <= 3


def test_stop_strings_end_a_row_and_are_cut_from_its_text(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    (free,) = Engine(model, tokenizer).run([Request(context=CTX, question="Where?", max_new_tokens=16)])
    text = tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = text.strip()[2:4]
    assert stop.strip()
    stopped = Request(context=CTX, question="Where?", max_new_tokens=16, stop=[stop])
    (cut,) = Engine(model, tokenizer).run([stopped])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert len(cut.token_ids) < len(free.token_ids)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def test_continuation_scores_by_teacher_forcing(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    (greedy,) = Engine(model, tokenizer).run([Request(context=CTX, question="Where?", max_new_tokens=6)])
    answer = tokenizer.decode(greedy.token_ids, skip_special_tokens=True).strip()
    (forced,) = Engine(model, tokenizer).run([Request(context=CTX, question="Where?", continuation=answer)])
    assert forced.finish_reason == "forced" and forced.forced_ids
    # where greedy decoding emits the answer, the forced argmax follows it
    n = min(len(forced.forced), len(greedy.token_ids))
    if forced.forced_ids[:n] == greedy.token_ids[:n]:
        assert forced.forced[:n] == greedy.token_ids[:n]


def test_position_requests_run_under_their_method_and_restore_the_model(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    before = [b.clone() for _, b in model.named_buffers() if "inv_freq" in _]
    requests = [Request(context=CTX, question="Where?", max_new_tokens=4, position="pi:factor=2"),
                Request(context=CTX, question="Where?", max_new_tokens=4)]
    mixed = Engine(model, tokenizer).run(requests)
    after = [b for _, b in model.named_buffers() if "inv_freq" in _]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the model's own RoPE after the run
    for request, res in zip(requests, mixed):
        (alone,) = Engine(model, tokenizer).run([request])
        assert res.token_ids == alone.token_ids


def test_bad_requests_are_refused_at_submit_naming_the_field(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    engine = Engine(model, tokenizer)
    cases = [
        (dict(context=CTX, max_new_tokens=0), "max_new_tokens must be an integer in [1, "),
        (dict(context=CTX, recipe="yarn:factor=2"), "'yarn' is a position method"),
        (dict(context=CTX, reuse="cacheblend"), "reuse= needs documents="),
        (dict(documents=DOCS, question="q", speculative="lookup"), "does not combine"),
        (dict(context=CTX, verify="full"), "need speculative="),
        (dict(context=CTX, stop=[""]), "stop must be a list of non-empty strings"),
        (dict(context="x" * 9_000_000), "beyond longlab's input limit"),
        (dict(context=CTX * 400, question="q"), "max_position_embeddings"),
        (dict(messages=[{"role": "assistant", "content": "hi"}]), "must end with a user turn"),
    ]
    for fields, message in cases:
        with pytest.raises(LonglabError, match=message.replace("[", r"\[").replace("(", r"\(")):
            engine.submit(Request(**fields))
    assert not engine.busy


def test_messages_are_a_chat_whose_last_user_turn_is_the_question(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": CTX},
                {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Where is item 3?"}]
    (res,) = Engine(model, tokenizer).run([Request(messages=messages, recipe="snapkv@0.5", max_new_tokens=4)])
    assert res.prompt_tokens > res.extra["question_tokens"] > 0 and len(res.token_ids) <= 4


def test_cancel_frees_a_batch_row_and_the_others_go_on(tiny_models, tokenizer):
    """A server's hooks: held_bytes() counts each running row's cache, progress() its tokens so far,
    cancel() drops a row (its bytes leave at once, no result), and the rows beside it are unchanged."""
    model = tiny_models["tiny-llama"][0]
    engine = Engine(model, tokenizer)
    assert engine.check(Request(context=CTX, question="Where is item 3?")) > 0
    a = engine.submit(
        Request(context=CTX, question="Where is item 3?", recipe="snapkv@0.5", max_new_tokens=10)
    )
    engine.step()
    b = engine.submit(Request(context=OTHER, question="How many apples?", max_new_tokens=10))
    engine.step()
    engine.step()
    held = engine.held_bytes()
    assert set(held) == {a, b} and held[a] > 0 and held[b] > 0
    assert len(engine.progress()[a]) >= 1
    total = sum(held.values())
    assert engine.cancel(b) and not engine.cancel(b)
    assert set(engine.held_bytes()) == {a} and sum(engine.held_bytes().values()) < total
    results = []
    while engine.busy:
        results += engine.step()
    assert [r.key for r in results] == [a]
    (alone,) = Engine(model, tokenizer).run(
        [Request(context=CTX, question="Where is item 3?", recipe="snapkv@0.5", max_new_tokens=10)])
    assert results[0].token_ids == alone.token_ids
    assert engine.held_bytes() == {} and not engine.cancel(a)
    c = engine.submit(Request(context=CTX, question="Where?", recipe="kivi4", max_new_tokens=4))
    engine.step()
    assert engine.held_bytes()[c] > 0 and engine.cancel(c) and not engine.busy
    with pytest.raises(LonglabError, match="temperature"):
        engine.check(Request(context=CTX, question="Where?", temperature=-1))


def test_a_one_turn_chat_without_a_template_is_a_plain_prompt(tiny_models, tokenizer):
    """messages=[one user turn] on a tokenizer without a chat template: the turn is the prompt's context
    part (it was an empty context that crashed the prefill planner), as context= with no question."""
    model = tiny_models["tiny-llama"][0]
    chat, plain = Engine(model, tokenizer).run([
        Request(messages=[{"role": "user", "content": CTX}], recipe="snapkv@0.5", max_new_tokens=4),
        Request(context=CTX, chat_template=False, recipe="snapkv@0.5", max_new_tokens=4),
    ])
    assert chat.token_ids == plain.token_ids and chat.kv_bytes_after < chat.kv_bytes_before
