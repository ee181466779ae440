"""Chunked prefill in ``longlab serve``: an admission's prefill pauses between slices for decode steps of
the running rows (:class:`longlab.serve.scheduler.PrefillSlicer`); every answer still equals the request
served alone (greedy), streaming included, and a client that leaves mid-prefill frees its row."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from test_serve import CTX, MODEL, OTHER, Server, _alone  # noqa: E402

from longlab.serve import create_app  # noqa: E402
from longlab.serve.scheduler import sliceable  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from longlab.models import build_tiny_model, tiny_tokenizer

    return build_tiny_model(MODEL), tiny_tokenizer()


@pytest.fixture
def sliced(model_and_tokenizer):
    model, tok = model_and_tokenizer
    srv = Server(create_app(model, tok, model_name=MODEL, max_batch=16))
    srv.app.state.scheduler.slicer.slice_s = 1e-9  # pause before every decoder layer of every prefill
    srv.app.state.scheduler.slicer.always = True  # even a prefill with no other row running
    yield srv
    srv.close()
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)  # stop removed the hooks


def test_sliced_prefills_interleave_with_decode_and_answers_equal_alone(sliced, model_and_tokenizer):
    recipes = ["full", "snapkv@0.5", "streaming@0.5", "h2o@0.5", "kivi4", "tova@0.5"]
    jobs = []
    for i in range(12):
        ctx = (CTX if i % 2 else OTHER) + f" Question {i}: where is item {i}?"
        jobs.append((ctx, recipes[i % len(recipes)], 6 + i % 5, i % 3 == 0))

    def ask(job):
        ctx, recipe, n, stream = job
        msgs = [{"role": "user", "content": ctx}]
        if stream:
            parts = sliced.client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=n, extra_body={"recipe": recipe}, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        out = sliced.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n,
                                                    extra_body={"recipe": recipe})
        return out.choices[0].message.content

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    stats = sliced.app.state.scheduler.stats
    layers = len(model_and_tokenizer[0].model.layers)
    assert stats["prefills"] == 12 and stats["prefill_slices"] >= 12 * layers  # paused at every layer
    assert stats["decodes_during_prefill"] > 0  # running rows advanced while a prompt was prefilled
    for (ctx, recipe, n, _), answer in zip(jobs, answers):
        alone = _alone(model_and_tokenizer, messages=[{"role": "user", "content": ctx}], max_new_tokens=n,
                       recipe=recipe, query_aware=True)
        assert answer == alone.text, (recipe, n)


def test_a_client_leaving_mid_prefill_frees_its_row(sliced):
    sched = sliced.app.state.scheduler
    sched.slicer.slice_s = 1e-9
    real_resume = sched.slicer.resume
    left = {}

    def slow_resume():  # widen the window between slices so the client leaves mid-prefill
        time.sleep(0.01)
        real_resume()
        if sched._admitting is not None and "t" in left and not left.get("sent"):
            left["sent"] = True
            sched.cancel(left["t"])

    sched.slicer.resume = slow_resume
    orig_submit = sched.submit

    def spy(ticket):
        left["t"] = ticket
        orig_submit(ticket)

    sched.submit = spy
    with ThreadPoolExecutor(1) as pool:  # the client waits (its answer would take 400 decode steps)
        pool.submit(lambda: sliced.client.with_options(timeout=3).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CTX}], max_tokens=400))
        deadline = time.time() + 10
        while not (left.get("sent") and sched._admitting is None) and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(0.3)  # a few decode steps at most: the row must be gone, not decoding its 400 tokens
        assert left.get("sent") and sched.running == 0 and not sched.engine.busy
        assert sched.engine.progress() == {} and sched.held == 0


def test_only_model_neutral_prefills_are_sliced():
    from longlab import Request

    plain = Request(context="a b c", question="q?", recipe="snapkv@0.5")
    plain.check()
    assert sliceable(plain)
    for fields in ({"documents": ["d one", "d two"], "question": "q?"},
                   {"context": "a b c", "question": "q?", "position": "yarn:factor=2"},
                   {"context": "a b c", "question": "q?", "speculative": "lookup"}):
        req = Request(**fields)
        req.check()
        assert not sliceable(req), fields


def test_prefill_slice_s_zero_turns_slicing_off_and_a_bad_value_is_refused(model_and_tokenizer):
    from longlab.errors import LonglabError

    model, tok = model_and_tokenizer
    app = create_app(model, tok, model_name=MODEL, prefill_slice_s=0)
    assert app.state.scheduler.slicer is None  # prefills run whole
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)
    slicer = create_app(model, tok, model_name=MODEL, prefill_slice_s=2).state.scheduler.slicer
    assert slicer.slice_s == 2 and slicer.active
    slicer.close()  # never started: its hooks are removed by hand
    for bad in (-1, float("nan"), "0.5", True):
        with pytest.raises(LonglabError, match="prefill_slice_s"):
            create_app(model, tok, model_name=MODEL, prefill_slice_s=bad)


def test_an_admission_with_no_other_row_running_is_not_sliced(model_and_tokenizer):
    """Slices make room for the running rows' decode steps; alone, a prefill runs whole."""
    model, tok = model_and_tokenizer
    srv = Server(create_app(model, tok, model_name=MODEL, max_batch=1))  # one at a time: never another row
    try:
        srv.app.state.scheduler.slicer.slice_s = 1e-9
        for _ in range(2):
            srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CTX}],
                                               max_tokens=3)
        stats = srv.app.state.scheduler.stats
        assert stats["prefills"] == 2 and stats["prefill_slices"] == 0
    finally:
        srv.close()
