"""A prefix-affinity router in front of N ``longlab serve`` processes: ``python -m longlab.serve.router
--workers http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8000``.

Each request goes to the worker that wins rendezvous hashing (highest ``sha256(key | worker)``) on its
*prefix key*: the first ``prefix_chars`` characters of its prompt (the messages' contents, the
completion prompt, or the documents). Requests that share a long prefix (a system prompt, the same
documents) thus land on the same worker, where its document store (``reuse``) and any other per-process
cache of that prefix live; adding or removing a worker moves only that worker's share of the keys. A
worker that refuses the connection is skipped for the next in its order.

The body is forwarded byte for byte, so longlab's own request fields (``recipe``, ``documents``,
``reuse``, ...) reach the worker: sglang-router 0.3.2 (``--policy cache_aware``) drops unknown top-level
fields, so behind it every request silently ran under the server's default recipe
(docs/results/serve-load.md). Responses, server-sent events included, are streamed back unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request  # the serve extra: imported only by `python -m longlab.serve.router`
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import LonglabError

__all__ = ["prefix_key", "route_order", "create_router", "main"]


def prefix_key(body: dict[str, Any], prefix_chars: int = 512) -> str:
    """The text a request's routing depends on: its prompt's first ``prefix_chars`` characters."""
    parts: list[str] = []
    for doc in body.get("documents") or ():
        parts.append(str(doc))
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: their texts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}:{content or ''}")
    prompt = body.get("prompt")
    if prompt is not None:
        parts.append(prompt if isinstance(prompt, str) else json.dumps(prompt))
    return "\x1f".join(parts)[:prefix_chars]


def route_order(key: str, workers: list[str]) -> list[str]:
    """``workers`` in rendezvous-hash order for ``key``: the first is the key's home."""
    def score(w: str) -> bytes:
        return hashlib.sha256(f"{key}\x1e{w}".encode()).digest()

    return sorted(workers, key=score, reverse=True)


def create_router(workers: list[str], *, prefix_chars: int = 512, timeout_s: float = 1800.0) -> Any:
    """The router app (FastAPI): ``POST /v1/...`` routed by prefix, ``GET`` to the first live worker,
    ``/router`` says which worker each key maps to (``?key=``) and counts requests per worker."""
    if not workers or any(not w.startswith(("http://", "https://")) for w in workers):
        raise LonglabError(f"workers must be http(s) URLs, got {workers!r}")
    if not 1 <= prefix_chars <= 1 << 20:
        raise LonglabError(f"prefix_chars must be in [1, 1048576], got {prefix_chars!r}")
    try:  # openai's HTTP library: httpx (openai 1.x, 2.x) or httpx2 (3.x)
        import httpx
    except ImportError:
        import httpx2 as httpx  # type: ignore[no-redef]

    workers = [w.rstrip("/") for w in workers]
    client = httpx.AsyncClient(timeout=timeout_s)
    served = {w: 0 for w in workers}

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="longlab router", lifespan=lifespan)

    async def forward(order: list[str], method: str, path: str, raw: bytes, headers: dict) -> Any:
        for worker in order:
            req = client.build_request(method, worker + path, content=raw, headers=headers)
            try:
                resp = await client.send(req, stream=True)
            except httpx.ConnectError:
                continue  # a worker that is down: the next in the key's order
            served[worker] += 1

            async def body(resp: Any = resp) -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            keep = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "retry-after")}
            return StreamingResponse(body(), status_code=resp.status_code, headers=keep)
        return JSONResponse({"error": {"message": "no worker is reachable", "type": "server_error",
                                       "param": None, "code": "no_worker"}}, status_code=503)

    @app.get("/router")
    async def router_state(key: str | None = None) -> Any:
        return {"workers": workers, "served": served,
                "home": route_order(key, workers)[0] if key is not None else None}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(http: Request, path: str) -> Any:
        raw = await http.body()
        order = workers
        if http.method == "POST":
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                body = None
            if isinstance(body, dict):
                order = route_order(prefix_key(body, prefix_chars), workers)
        headers = {"content-type": http.headers.get("content-type", "application/json")}
        query = ("?" + http.url.query) if http.url.query else ""
        return await forward(order, http.method, "/" + path + query, raw, headers)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="prefix-affinity router for N longlab serve processes")
    p.add_argument("--workers", nargs="+", required=True, help="the servers' base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefix-chars", type=int, default=512, help="prompt characters that pick the worker")
    args = p.parse_args(argv)
    import uvicorn

    uvicorn.run(create_router(args.workers, prefix_chars=args.prefix_chars), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
