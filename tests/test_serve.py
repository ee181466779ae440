"""``longlab serve``: the OpenAI-compatible server on loopback (a tiny model), talked to with the official
``openai`` client: chat, completions, streaming, usage, a recipe per request, errors, metrics, many
clients at once (each answer equals the request served alone), the byte budget and disconnects."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
try:  # the openai client's HTTP library: httpx (openai 1.x, 2.x) or its successor httpx2 (openai 3.x)
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from longlab import Engine, Request  # noqa: E402
from longlab.serve import create_app  # noqa: E402

CTX = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(30))
OTHER = " ".join(f"Crate {i} holds {i * 3 % 11} apples." for i in range(25))
MODEL = "tiny-llama"


class Server:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def get(self, path):
        return httpx.get(self.url + path, timeout=10)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from longlab.models import build_tiny_model, tiny_tokenizer

    return build_tiny_model(MODEL), tiny_tokenizer()


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tok = model_and_tokenizer
    srv = Server(create_app(model, tok, model_name=MODEL, max_batch=16))
    yield srv
    srv.close()


def _alone(model_and_tokenizer, **fields):
    model, tok = model_and_tokenizer
    (result,) = Engine(model, tok).run([Request(**fields)])
    return result


def _chat(content, max_tokens=8):
    return [{"role": "user", "content": content}], max_tokens


def test_models_health_chat_and_completions(server, model_and_tokenizer):
    assert server.client.models.list().data[0].id == MODEL
    assert server.get("/health").json()["status"] == "ok"
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": CTX + " Where is item 3?"}]
    out = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    alone = _alone(model_and_tokenizer, messages=msgs, max_new_tokens=8, query_aware=True)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == alone.text
    assert out.choices[0].finish_reason == ("length" if alone.finish_reason == "length" else "stop")
    assert out.usage.prompt_tokens == alone.prompt_tokens
    assert out.usage.completion_tokens == len(alone.token_ids)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    done = server.client.completions.create(model=MODEL, prompt=OTHER, max_tokens=6)
    plain = _alone(model_and_tokenizer, context=OTHER, chat_template=False, max_new_tokens=6)
    assert done.choices[0].text == plain.text and done.usage.completion_tokens == len(plain.token_ids)


def test_streaming_matches_the_whole_answer_and_reports_usage(server):
    msgs, n = _chat(CTX + " Where is item 7?", 12)
    whole = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n)
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=n, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pieces = list(server.client.completions.create(model=MODEL, prompt=OTHER, max_tokens=10, stream=True))
    whole = server.client.completions.create(model=MODEL, prompt=OTHER, max_tokens=10)
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": OTHER, "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_a_recipe_per_request_through_extra_body(server, model_and_tokenizer):
    msgs, n = _chat(CTX + " Where is item 5?")
    out = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n,
                                                extra_body={"recipe": "snapkv@0.5"})
    extra = out.model_extra["longlab"]
    assert extra["recipe"] == "snapkv@0.5" and extra["kv_bytes_after"] < extra["kv_bytes_before"]
    alone = _alone(model_and_tokenizer, messages=msgs, max_new_tokens=n, recipe="snapkv@0.5",
                   query_aware=True)
    assert out.choices[0].message.content == alone.text
    docs = ["The archive code is 4417. It opens the west door.",
            "Marta keeps the ledger in the blue cabinet."]
    body = {"documents": docs, "reuse": "cacheblend:recompute=0.5"}
    first = server.client.completions.create(model=MODEL, prompt="What is the code?", max_tokens=4,
                                             extra_body=body)
    again = server.client.completions.create(model=MODEL, prompt="Who keeps the ledger?", max_tokens=4,
                                             extra_body=body)
    assert first.model_extra["longlab"]["recipe"].startswith("reuse=cacheblend")
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the documents' KV came from the store


@pytest.mark.parametrize("extra, param", [
    ({"extra_body": {"recipe": "nosuch@0.5"}}, "recipe"),
    ({"extra_body": {"recipe": "snapkv@7"}}, "recipe"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"extra_body": {"speculative": "bogus"}}, "speculative"),
    ({"extra_body": {"query_aware": "yes"}}, "query_aware"),
    ({"n": 2}, "n"),
    ({"prompt": "x " * 5000}, "prompt"),  # 10k byte tokens: beyond the tiny model's 8192 positions
])
def test_bad_values_are_400_naming_the_field(server, caplog, extra, param):
    caplog.set_level(logging.INFO)
    kwargs = {"model": MODEL, "prompt": OTHER, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(**kwargs)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and body["type"] == "invalid_request_error"
    assert "Traceback" not in json.dumps(body) and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_unknown_fields_are_tolerated_and_a_wrong_model_is_404(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
        "some_future_field": {"x": 1}, "user": "u1"})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()


def test_many_clients_with_mixed_recipes_each_get_their_answer_alone(server, model_and_tokenizer):
    recipes = ["full", "snapkv@0.5", "streaming@0.5", "h2o@0.5", "kivi4", "tova@0.5"]
    jobs = []
    for i in range(12):
        ctx = (CTX if i % 2 else OTHER) + f" Question {i}: where is item {i}?"
        jobs.append((ctx, recipes[i % len(recipes)], 4 + i % 5, i % 3 == 0))

    def ask(job):
        ctx, recipe, n, stream = job
        msgs = [{"role": "user", "content": ctx}]
        if stream:
            parts = server.client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=n, extra_body={"recipe": recipe}, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        out = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n,
                                                    extra_body={"recipe": recipe})
        return out.choices[0].message.content

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    assert server.app.state.scheduler.peak_running >= 4  # they ran together, not one by one
    assert sum(len(a) for a in answers) >= 12, answers
    for (ctx, recipe, n, _), answer in zip(jobs, answers):
        alone = _alone(model_and_tokenizer, messages=[{"role": "user", "content": ctx}], max_new_tokens=n,
                       recipe=recipe, query_aware=True)
        assert answer == alone.text, (recipe, n)
    metrics = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    ok = {s.labels["recipe"]: s.value for s in metrics["longlab_requests"].samples
          if s.name == "longlab_requests_total" and s.labels["status"] == "ok"}
    assert all(ok.get(r, 0) >= 2 for r in recipes)
    assert any(s.value > 0 for s in metrics["longlab_ttft_seconds"].samples if s.name.endswith("_count"))
    assert "longlab_kv_bytes_held" in metrics and "longlab_queue_length" in metrics


def _wait(cond, what, seconds=20):
    deadline = time.time() + seconds
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def test_budget_queue_503_and_a_disconnect_frees_bytes(model_and_tokenizer):
    """A 1-byte budget runs one request at a time: the second waits in the queue, the third is refused
    (503, Retry-After); the first client leaves mid-stream: its row and bytes are freed, the second runs."""
    model, tok = model_and_tokenizer
    srv = Server(create_app(model, tok, model_name=MODEL, kv_budget_bytes=1, max_batch=4, max_queue=1))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": CTX}], "max_tokens": 3000,
                "stream": True}
        pool = ThreadPoolExecutor(1)
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            _wait(lambda: srv.get("/health").json()["kv_bytes_held"] > 0, "the stream holds no bytes")
            second = pool.submit(srv.client.completions.create, model=MODEL, prompt=OTHER, max_tokens=3)
            _wait(lambda: srv.get("/health").json()["queued"] == 1, "the second request is not queued")
            with pytest.raises(openai.APIStatusError) as err:
                srv.client.completions.create(model=MODEL, prompt=OTHER, max_tokens=3)
            assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
            assert srv.get("/health").json()["running"] == 1  # the budget holds the second back
        # the streaming client has left: its row leaves, the second request runs
        assert second.result(timeout=60).choices[0].text is not None
        assert srv.app.state.scheduler.peak_running == 1
        pool.shutdown()
        _wait(lambda: srv.get("/health").json()["kv_bytes_held"] == 0, "the bytes were not freed")
        health = srv.get("/health").json()
        assert health["running"] == 0 and health["queued"] == 0
        families = {f.name: f for f in text_string_to_metric_families(srv.get("/metrics").text)}
        status = {s.labels["status"]: s.value for s in families["longlab_requests"].samples
                  if s.name == "longlab_requests_total"}
        assert status.get("cancelled") == 1 and status.get("rejected") == 1 and status.get("ok") == 1
    finally:
        srv.close()


@pytest.mark.parametrize("flags, message", [
    (["--port", "0"], "--port"),
    (["--recipe", "nosuch@0.5"], "--recipe"),
    (["--kv-budget-mib", "-1"], "--kv-budget-mib"),
    (["--max-batch", "0"], "--max-batch"),
    (["--prefill-slice-s", "-1"], "--prefill-slice-s"),
])
def test_the_command_refuses_bad_flags_before_loading(capsys, flags, message):
    from longlab.cli import main

    assert main(["serve", "--model", MODEL, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_longlab_serve_command_answers_the_openai_client():
    """`longlab serve --model tiny-llama` in a process of its own: the README's client example works."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "longlab.cli", "serve", "--model", MODEL, "--port", str(port),
         "--kv-budget-mib", "64", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

        def up():
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(up, "longlab serve did not start", seconds=60)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CTX}],
                                             max_tokens=4, extra_body={"recipe": "snapkv@0.5"})
        assert out.model_extra["longlab"]["recipe"] == "snapkv@0.5" and out.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


def test_admission_estimate_counts_the_bytes_a_full_row_holds(one_thread):
    """The scheduler's estimate of an uncompressed request, ``(prompt + max_tokens) x
    cache_bytes_per_token``, is exactly what its row holds once admitted (keys, values and the slots'
    position index), so a budget of N such requests admits N of them."""
    from longlab import Engine, Request
    from longlab.engine.limits import cache_bytes_per_token, kv_bytes_per_token
    from longlab.models import build_tiny_model, tiny_tokenizer

    model = build_tiny_model(MODEL)
    engine = Engine(model, tiny_tokenizer())
    # tiny-llama: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes, plus an int32 index per head and layer
    assert kv_bytes_per_token(model) == 512 and cache_bytes_per_token(model) == 512 + 16
    req = Request(messages=[{"role": "user", "content": CTX}], max_new_tokens=8)
    n = engine.check(req)
    key = engine.submit(req)
    engine.step()  # the admission: prefill, then the row joins the batch with room for its 8 tokens
    assert engine.held_bytes() == {key: (n + 8) * cache_bytes_per_token(model)}
    sched = create_app(engine, model_name=MODEL).state.scheduler  # the estimate the scheduler uses
    assert sched.per_token == cache_bytes_per_token(model)
    sched.slicer.close()  # never started: its hooks are removed by hand


def test_a_queued_request_is_estimated_with_what_its_recipe_is_known_to_hold(one_thread):
    """Requests that queued before the first of their recipe ran are estimated, when considered for
    admission, with the ratio learnt since (snapkv@0.5 holds about half): a budget with room for half a
    request more admits a snapkv@0.5 request that a stale full-size estimate would have kept waiting."""
    import asyncio

    from longlab.engine.limits import cache_bytes_per_token
    from longlab.models import build_tiny_model, tiny_tokenizer
    from longlab.serve.protocol import parse_chat
    from longlab.serve.scheduler import Scheduler, Ticket

    model = build_tiny_model(MODEL)
    per = cache_bytes_per_token(model)
    sched = Scheduler(Engine(model, tiny_tokenizer()), kv_budget_bytes=1000 * per, prefill_slice_s=None)
    loop = asyncio.new_event_loop()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": CTX}], "max_tokens": 4,
                "recipe": "snapkv@0.5"}
        ticket = Ticket(parse_chat(body, MODEL, "full"), loop)
        ticket.size, ticket.estimate = 600 * per, 600 * per  # queued before any snapkv@0.5 row was seen
        sched._queue.append(ticket)
        sched._running[0] = ticket  # one row runs, holding 600 slots' bytes
        sched.held = 600 * per
        assert not sched._can_admit()  # nothing learnt yet: 600 + 600 > 1000
        sched._ratio["snapkv@0.5"] = 0.5  # a snapkv@0.5 row has since been seen holding half its size
        assert sched._can_admit() and ticket.estimate == 300 * per  # 600 + 300 <= 1000
        assert sched.stats["rows_when_budget_full"] == 1  # the refusal came with one row running
    finally:
        loop.close()
