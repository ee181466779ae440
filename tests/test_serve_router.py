"""The prefix-affinity router (:mod:`longlab.serve.router`) in front of two ``longlab serve`` apps on
loopback (tiny model): longlab's own fields (``recipe``) reach the worker, answers and streams equal the
worker's own, a prompt always lands on its home worker, and different prompts use both workers."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import uvicorn  # noqa: E402
from test_serve import CTX, MODEL, Server, httpx  # noqa: E402

from longlab.errors import LonglabError  # noqa: E402
from longlab.serve import create_app  # noqa: E402
from longlab.serve.router import create_router, prefix_key, route_order  # noqa: E402


def test_prefix_key_and_rendezvous_order() -> None:
    chat = {"messages": [{"role": "system", "content": "S" * 600}, {"role": "user", "content": "q1"}]}
    other = {"messages": [{"role": "system", "content": "S" * 600}, {"role": "user", "content": "q2"}]}
    assert prefix_key(chat) == prefix_key(other)  # the same 512-character prefix: the same key
    assert prefix_key(chat, 2000) != prefix_key(other, 2000)
    assert prefix_key({"prompt": "abc"}) == "abc"
    assert prefix_key({"documents": ["d"], "prompt": "q"}) == "d\x1fq"
    workers = ["http://a", "http://b", "http://c"]
    homes = {route_order(f"key {i}", workers)[0] for i in range(30)}
    assert homes == set(workers)  # keys spread over every worker
    order = route_order("k", workers)
    assert route_order("k", [w for w in workers if w != order[1]]) == [order[0], order[2]]  # stable
    with pytest.raises(LonglabError, match="workers"):
        create_router(["127.0.0.1:1"])


@pytest.fixture(scope="module")
def cluster():
    from longlab.models import build_tiny_model, tiny_tokenizer

    model, tok = build_tiny_model(MODEL), tiny_tokenizer()
    workers = [Server(create_app(model, tok, model_name=MODEL, max_batch=8)) for _ in range(2)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_router([w.url for w in workers]), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", workers
    server.should_exit = True
    thread.join(timeout=20)
    for w in workers:
        w.close()


def test_router_keeps_recipes_streams_and_prefix_homes(cluster) -> None:
    url, workers = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    urls = [w.url for w in workers]
    prompts, homes = [], set()
    for i in range(40):  # prompts whose homes cover both workers
        p = f"Variant {i}. " + CTX + " Where is item 4?"
        home = route_order(prefix_key({"messages": [{"role": "user", "content": p}]}), urls)[0]
        if home not in homes or len(prompts) < 4:
            prompts.append((p, home))
            homes.add(home)
    assert len(homes) == 2
    for p, home in prompts:
        msgs = [{"role": "user", "content": p}]
        for recipe in ("snapkv@0.5", "full"):
            before = [w.app.state.scheduler.stats["prefills"] for w in workers]
            out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                 extra_body={"recipe": recipe})
            direct = workers[0].client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                               temperature=0, extra_body={"recipe": recipe})
            assert out.model_extra["longlab"]["recipe"] == recipe  # the field reached the worker
            assert out.choices[0].message.content == direct.choices[0].message.content
            after = [w.app.state.scheduler.stats["prefills"] for w in workers]
            served_by = urls[1] if after[1] > before[1] else urls[0]
            assert served_by == home, (recipe, p[:20])
    parts = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[0][0]}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"recipe": "snapkv@0.5"}))
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    direct = workers[0].client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[0][0]}], max_tokens=6, temperature=0,
        extra_body={"recipe": "snapkv@0.5"})
    assert text == direct.choices[0].message.content and parts[-1].usage is not None
    bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "recipe": "nosuch@0.5", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "recipe"
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == MODEL
