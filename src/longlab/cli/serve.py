"""``longlab serve``: the OpenAI-compatible server (:mod:`longlab.serve`) on one model, a recipe per
request. Every flag is checked before the model loads; without the ``serve`` extra it says how to get it.
``--replicas N`` (N > 1) runs the same app on N Ray Serve replicas (:mod:`longlab.serve.replicas`, the ``ray``
extra), each loading the model, behind Ray Serve's proxy on ``--host:--port``."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ..errors import LonglabError, check_range

__all__ = ["add_serve_arguments", "cmd_serve"]


def add_serve_arguments(sub: Any) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible server where every request picks its KV recipe")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--recipe", default="full", help="the recipe of requests that name none (default full)")
    s.add_argument("--position", help="a position method applied to the model (yarn:factor=4, ...)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-budget-mib", type=float, metavar="N",
                   help="KV cache bytes the running requests may hold, in MiB (default: no budget)")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded at once (default 16)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for admission; past it, 503 with Retry-After (default 64)")
    s.add_argument("--prefill-slice-s", type=float, default=0.5, metavar="S",
                   help="a long prefill pauses every S seconds for one decode step of the running rows "
                   "(default 0.5; 0: prefills run whole, fewer decode steps at more rows each)")
    s.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N Ray Serve replicas behind one address, each loading the model (the ray "
                   "extra); default 1: one process, no Ray")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..recipe import parse_recipe

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise LonglabError(
            f"longlab serve needs the serve extra ({', '.join(missing)} missing): "
            "pip install 'longlab[serve]'"
        )
    check_range("--port", args.port, 1, 65535, integer=True)
    check_range("--max-batch", args.max_batch, 1, 4096, integer=True)
    check_range("--max-queue", args.max_queue, 0, 65536, integer=True)
    check_range("--replicas", args.replicas, 1, 256, integer=True)
    check_range("--prefill-slice-s", args.prefill_slice_s, 0, 3600)
    budget = None
    if args.kv_budget_mib is not None:
        check_range("--kv-budget-mib", args.kv_budget_mib, 0, 1 << 24, low_open=True)
        budget = max(int(args.kv_budget_mib * 2**20), 1)
    if not args.host.strip():
        raise LonglabError("--host is empty: give an address such as 127.0.0.1")
    try:
        recipe = parse_recipe(args.recipe).name
    except LonglabError as exc:
        raise LonglabError(f"--recipe: {exc}") from None
    if args.replicas > 1:
        return _serve_replicas(args, recipe, budget)
    from ..engine import Engine
    from ..models import load_model
    from ..serve import create_app, run_server

    model, tokenizer = load_model(args.model, position=args.position)
    app = create_app(Engine(model, tokenizer), model_name=args.model, default_recipe=recipe,
                     kv_budget_bytes=budget, max_batch=args.max_batch, max_queue=args.max_queue,
                     prefill_slice_s=args.prefill_slice_s)
    print(f"longlab serve: {args.model} on http://{args.host}:{args.port}/v1 (default recipe {recipe}, "
          f"KV budget {'none' if budget is None else f'{budget / 2**20:g} MiB'})", flush=True)
    run_server(app, args.host, args.port, args.log_level)
    return 0


def _serve_replicas(args: argparse.Namespace, recipe: str, budget: int | None) -> int:
    """``--replicas N``: the app on N Ray Serve replicas until interrupted (Ctrl-C stops Serve and Ray)."""
    import time

    from ..serve.replicas import require_ray_serve, start_replicas, stop_replicas

    require_ray_serve()  # before anything starts
    spec = {"model": args.model, "position": args.position, "model_name": args.model,
            "default_recipe": recipe, "kv_budget_bytes": budget, "max_batch": args.max_batch,
            "max_queue": args.max_queue, "prefill_slice_s": args.prefill_slice_s}
    url = start_replicas(spec, args.replicas, host=args.host, port=args.port)
    print(f"longlab serve: {args.model} on {url} ({args.replicas} Ray Serve replicas, "
          f"default recipe {recipe}, KV budget {'none' if budget is None else f'{budget / 2**20:g} MiB'} "
          "each)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_replicas()
    return 0
