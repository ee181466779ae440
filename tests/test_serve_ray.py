"""``longlab serve --replicas 2``: the app on two Ray Serve replicas on loopback (tiny model), talked to
with the official ``openai`` client: chat, streaming and a recipe per request through Ray Serve's proxy,
answers equal to the single-process server's, and both replicas answering. Marked ``ray`` (CI runs it:
``.ci/run``); skipped when Ray Serve is not installed. The missing-extra message is tested without Ray."""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from longlab.errors import LonglabError

MODEL = "tiny-llama"
CTX = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(30))


def test_missing_ray_serve_names_the_extra(monkeypatch) -> None:
    from longlab.serve import replicas

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(LonglabError, match=r"pip install 'longlab\[ray\]'"):
        replicas.require_ray_serve()


def test_cli_refuses_bad_replicas_before_loading(capsys) -> None:
    from longlab.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    err = capsys.readouterr().err
    assert "--replicas" in err and "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
def test_two_replicas_answer_like_one_server() -> None:
    pytest.importorskip("ray.serve")
    openai = pytest.importorskip("openai")
    try:  # openai's HTTP library: httpx (openai 1.x, 2.x) or httpx2 (3.x)
        import httpx
    except ImportError:
        import httpx2 as httpx

    from longlab import Engine, Request, load_model
    from longlab.serve.replicas import start_replicas, stop_replicas

    model, tok = load_model(MODEL)
    engine = Engine(model, tok)
    questions = [f"Where is item {i}?" for i in range(6)]
    recipes = ["full", "snapkv@0.5", "streaming@0.5"]
    alone = {
        (q, r): engine.run([Request(messages=[{"role": "user", "content": CTX + "\n" + q}], recipe=r,
                                    max_new_tokens=6, query_aware=True)])[0].text
        for i, q in enumerate(questions) for r in [recipes[i % 3]]
    }
    port = _free_port()
    url = start_replicas({"model": MODEL, "max_batch": 4, "max_queue": 16}, 2, port=port,
                         cpus_per_replica=1, timeout_s=300)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL]

        def ask(i: int) -> tuple:
            q, r = questions[i], recipes[i % 3]
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": CTX + "\n" + q}], max_tokens=6,
                temperature=0, extra_body={"recipe": r})
            return (q, r), out.choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            answers = dict(pool.map(ask, range(6)))
        assert answers == alone  # greedy: each answer equals the request served alone

        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CTX + "\n" + questions[1]}], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"recipe": "snapkv@0.5"})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == alone[(questions[1], "snapkv@0.5")]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

        bad = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}], "recipe": "nosuch@0.5"}, timeout=60)
        assert bad.status_code == 400 and "recipe" in bad.json()["error"]["message"]

        pids = {httpx.get(url.removesuffix("/v1") + "/replica", timeout=30).json()["pid"] for _ in range(40)}
        assert len(pids) == 2  # the proxy spreads requests over both replicas
    finally:
        stop_replicas()
