"""The OpenAI-compatible app: ``create_app(engine_or_model, ...)`` -> a FastAPI app.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming as server-sent events
when ``stream`` is true: ``data: {chunk}`` ... ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/recipes``
(the registered recipe methods, each with a name a request may send), ``GET /health``, ``GET /metrics``
(Prometheus text), and ``GET /``: the playground (``static/playground.html``, one static page: a context,
a question and a recipe in, the streamed answer with its KV bytes and timings out). Every request is a
:class:`~longlab.request.Request` run by the one engine that :class:`~longlab.serve.scheduler.Scheduler`
drives in its own thread; each request may name its own recipe and ``response_format``. Errors are
OpenAI's ``{"error": {...}}`` with their status; a client's bad value never puts a traceback in the
response or the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # the serve extra: app.py is imported only by longlab.serve
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..errors import LonglabError, check_range
from .metrics import Metrics
from .protocol import (
    ApiError,
    chunk,
    completion_body,
    error_body,
    finish_reason,
    longlab_of,
    new_id,
    parse_chat,
    parse_completion,
    usage_of,
)
from .scheduler import Scheduler, Ticket

__all__ = ["create_app", "recipe_list", "PLAYGROUND"]

log = logging.getLogger("longlab.serve")
MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused before it is parsed


def create_app(engine_or_model: Any, tokenizer: Any = None, *, model_name: str | None = None,
               default_recipe: str = "full", kv_budget_bytes: int | None = None, max_batch: int = 16,
               max_queue: int = 64, store: Any = None, prefill_slice_s: float = 0.5) -> Any:
    """The server app. ``engine_or_model``: an :class:`~longlab.engine.Engine`, a model (with its
    ``tokenizer``) or a model name for :func:`~longlab.models.load_model`. ``model_name``: the id clients
    send as ``model`` (default: the name given, or the model's ``name_or_path``). ``default_recipe``: the
    recipe of requests that name none. ``kv_budget_bytes`` (None: no budget), ``max_batch`` and
    ``max_queue``: the scheduler's limits. ``prefill_slice_s``: a long prefill pauses every this many
    seconds for one decode step of the running rows (0: prefills run whole; smaller: shorter stalls of the
    running rows, more decode steps at few rows)."""
    from ..recipe import parse_recipe

    for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 16:
            raise LonglabError(f"{name} must be an integer in [{low}, 65536], got {value!r}")
    check_range("prefill_slice_s", prefill_slice_s, 0, 3600)
    if kv_budget_bytes is not None and (not isinstance(kv_budget_bytes, int) or kv_budget_bytes <= 0):
        raise LonglabError(f"kv_budget_bytes must be a positive integer or None, got {kv_budget_bytes!r}")
    default_recipe = parse_recipe(default_recipe).name  # a bad default is refused before anything loads
    if isinstance(engine_or_model, Engine):
        engine = engine_or_model
    elif isinstance(engine_or_model, str):
        from ..models import load_model

        model_name = model_name or engine_or_model
        model, tokenizer = load_model(engine_or_model)
        engine = Engine(model, tokenizer, store=store)
    else:
        engine = Engine(engine_or_model, tokenizer, store=store)
    if model_name is None:
        model_name = str(getattr(engine.model.config, "name_or_path", "") or "longlab")
    metrics = Metrics(kv_budget_bytes)
    scheduler = Scheduler(engine, kv_budget_bytes=kv_budget_bytes, max_batch=max_batch,
                          max_queue=max_queue, metrics=metrics, prefill_slice_s=prefill_slice_s or None)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="longlab", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.model_name = scheduler, metrics, model_name

    @app.exception_handler(ApiError)
    async def _api_error(_: Any, exc: ApiError) -> Any:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Any, exc: Any) -> Any:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Any, exc: Exception) -> Any:
        log.error("internal error: %s: %s", exc.__class__.__name__, exc)
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)

    async def serve(http: Request, kind: str) -> Any:
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body has {len(raw):,} bytes, beyond the limit of {MAX_BODY_BYTES:,}")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        parse = parse_chat if kind == "chat" else parse_completion
        parsed = parse(body, model_name, default_recipe)
        ticket = Ticket(parsed, asyncio.get_running_loop())
        scheduler.submit(ticket)
        try:
            first, value = await ticket.events.get()  # accepted (checked, queued) or refused
        except asyncio.CancelledError:
            scheduler.cancel(ticket)
            raise
        if first == "error":
            raise value
        rid = new_id(kind)
        if parsed.stream:
            return StreamingResponse(_sse(ticket, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while True:
                try:
                    event, value = await asyncio.wait_for(ticket.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        scheduler.cancel(ticket)
                        return Response(status_code=499)
                    continue
                if event == "done":
                    return JSONResponse(completion_body(parsed, rid, model_name, value))
                if event == "error":
                    raise value
        except asyncio.CancelledError:
            scheduler.cancel(ticket)
            raise

    async def _sse(ticket: Ticket, rid: str) -> AsyncIterator[str]:
        parsed, done = ticket.parsed, False
        try:
            if parsed.kind == "chat":
                yield _data(chunk(parsed, rid, model_name, role=True, text=""))
            while True:
                event, value = await ticket.events.get()
                if event == "delta":
                    yield _data(chunk(parsed, rid, model_name, text=value))
                elif event == "done":
                    final = chunk(parsed, rid, model_name, finish=finish_reason(value))
                    final["longlab"] = longlab_of(value)
                    yield _data(final)
                    if parsed.include_usage:
                        yield _data(chunk(parsed, rid, model_name, usage=usage_of(value)))
                    done = True
                    yield "data: [DONE]\n\n"
                    return
                elif event == "error":
                    done = True
                    yield _data(value.body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client left mid-stream: its row leaves the engine, its bytes with it
                scheduler.cancel(ticket)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Any:
        return await serve(http, "chat")

    @app.post("/v1/completions")
    async def completions(http: Request) -> Any:
        return await serve(http, "completions")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "longlab"}]}

    @app.get("/v1/recipes")
    async def recipes() -> Any:
        return {"object": "list", "default": default_recipe, "data": recipe_list(default_recipe)}

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> Any:
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "ok" if scheduler.alive else "down", "model": model_name,
                "running": scheduler.running, "queued": scheduler.queued,
                "kv_bytes_held": scheduler.held, "kv_budget_bytes": kv_budget_bytes}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


PLAYGROUND = Path(__file__).with_name("static") / "playground.html"
#: the recipe kinds a playground user picks from (prefill / decode attention, KV policies, quantizers)
RECIPE_KINDS = ("kv", "quant", "prefill", "decode")


def recipe_list(default_recipe: str = "full") -> list[dict[str, str]]:
    """The registered recipe methods of :data:`RECIPE_KINDS` (``longlab.registry``), each with an
    ``example`` a request may send as ``recipe`` (``name@0.5`` where the method removes a fraction),
    its ``kind`` and the first line of its docstring; the default recipe first (the package face has
    registered every family)."""
    import dataclasses

    from ..recipe import parse_recipe
    from ..registry import REGISTRY

    out: list[dict[str, str]] = []
    for name in REGISTRY.names("recipe"):
        cls = REGISTRY.get("recipe", name)
        if getattr(cls, "kind", None) not in RECIPE_KINDS:
            continue
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        for example in ([f"{name}@0.5"] if "compression_ratio" in fields else []) + [name]:
            try:
                parse_recipe(example)
            except (LonglabError, TypeError, ValueError):
                continue
            summary = (cls.__doc__ or "").strip().split("\n")[0]
            out.append({"name": name, "kind": cls.kind, "example": example, "summary": summary})
            break
    out.sort(key=lambda r: (r["example"] != default_recipe, r["kind"] != "kv", r["name"]))
    if not any(r["example"] == default_recipe for r in out):
        out.insert(0, {"name": default_recipe, "kind": "recipe", "example": default_recipe,
                       "summary": "the server's default recipe"})
    return out


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

