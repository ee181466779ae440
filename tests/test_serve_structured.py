"""``response_format`` through the server (the official openai client on loopback, a tiny model): json_schema
and json_object answers that parse and equal the same request run alone, streaming included; a bad
response_format is OpenAI's 400 naming it, with no traceback in the response or the log."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from test_serve import MODEL, Server  # noqa: E402  (the loopback server helper of tests/test_serve.py)
from test_structured import FMT, MSGS, SCHEMA, _valid  # noqa: E402

from longlab import Engine, Request  # noqa: E402
from longlab.serve import create_app  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from longlab.models import build_tiny_model, tiny_tokenizer

    return build_tiny_model(MODEL), tiny_tokenizer()


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tok = model_and_tokenizer
    srv = Server(create_app(model, tok, model_name=MODEL, max_batch=8))
    yield srv
    srv.close()


def test_chat_json_schema_parses_and_equals_the_request_alone(server, model_and_tokenizer):
    out = server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=96,
                                                response_format=FMT)
    text = out.choices[0].message.content
    _valid(text)
    assert out.choices[0].finish_reason == "stop"
    model, tok = model_and_tokenizer
    (alone,) = Engine(model, tok).run([Request(messages=MSGS, response_format=FMT, max_new_tokens=96,
                                               query_aware=True)])
    assert text == alone.text and out.usage.completion_tokens == len(alone.token_ids)
    free = server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=96)
    with pytest.raises(ValueError):  # without response_format the tiny model writes no JSON
        json.loads(free.choices[0].message.content)


def test_streamed_json_and_completions_json_object(server):
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=96,
                                                        response_format=FMT, stream=True))
    _valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    done = server.client.completions.create(model=MODEL, prompt="Item 3 is stored in box 4. The answer:",
                                            max_tokens=96, extra_body={"response_format": FMT})
    _valid(done.choices[0].text)
    obj = server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=64,
                                                response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["y" * 1000] * 70}}},
    {"type": 7},
])
def test_bad_response_format_is_400_naming_it(server, caplog, fmt):
    caplog.set_level(logging.INFO)
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, response_format=fmt)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == "response_format"
    assert body["type"] == "invalid_request_error" and body["message"].startswith("response_format")
    assert "Traceback" not in json.dumps(body) and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_constrained_and_free_clients_at_once_each_get_their_answer(server):
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        kwargs = {"response_format": FMT} if i % 2 == 0 else {}
        return server.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=96,
                                                     **kwargs).choices[0].message.content

    alone = [ask(0), ask(1)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert got == [alone[i % 2] for i in range(6)]
    assert json.loads(got[0]).keys() == SCHEMA["properties"].keys()
