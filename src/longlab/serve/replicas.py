"""``longlab serve --replicas N``: the same OpenAI-compatible app on N Ray Serve replicas.

Each replica is a Ray actor that loads the model itself and runs the app of :func:`longlab.serve.create_app`
(its own engine, scheduler and KV budget) as the deployment's ASGI ingress
(``serve.ingress()`` + ``__serve_build_asgi_app__``: the app is built in the replica after the model
loads, and Ray Serve runs its lifespan, which starts the scheduler thread). Ray Serve's HTTP proxy listens
on ``host:port`` and spreads requests over the replicas (its default router: the less loaded of two
random replicas); the API, streaming included, is the single server's. Budgets and ``/metrics`` are
per replica: ``/health`` and ``/metrics`` answer for whichever replica the proxy picked.

Ray is an optional dependency: ``pip install 'longlab[ray]'`` (``ray[serve]``). ``RAY_ADDRESS`` set in
the environment joins an existing cluster; otherwise a local one is started with the machine's CPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..errors import LonglabError

__all__ = ["require_ray_serve", "ReplicaSpec", "start_replicas", "stop_replicas", "APP_NAME"]

APP_NAME = "longlab"


def require_ray_serve() -> Any:
    """Import ``ray.serve``, or fail with the command that installs it."""
    try:
        from ray import serve
    except ImportError:
        raise LonglabError("longlab serve --replicas needs Ray Serve: pip install 'longlab[ray]' "
                           "(it installs ray[serve])") from None
    return serve


class ReplicaSpec(dict):
    """What each replica needs to build its app (plain values, shipped to the replica by Ray):
    ``model`` (a :func:`~longlab.models.load_model` name), ``position``, ``model_name``, ``default_recipe``,
    ``kv_budget_bytes``, ``max_batch``, ``max_queue``, ``prefill_slice_s``, ``threads`` (torch threads per
    replica)."""


class LonglabReplica:
    """One replica: loads the model, builds the app. Ray Serve wraps it (``serve.ingress()``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from ..engine import Engine
        from ..models import load_model
        from .app import create_app

        torch.set_num_threads(max(1, int(spec.get("threads", 1))))
        model, tokenizer = load_model(spec["model"], position=spec.get("position"))
        self._app = create_app(
            Engine(model, tokenizer), model_name=spec.get("model_name") or spec["model"],
            default_recipe=spec.get("default_recipe", "full"), kv_budget_bytes=spec.get("kv_budget_bytes"),
            max_batch=int(spec.get("max_batch", 16)), max_queue=int(spec.get("max_queue", 64)),
            prefill_slice_s=float(spec.get("prefill_slice_s", 0.5)),
        )
        self._app.state.replica_pid = os.getpid()

        @self._app.get("/replica")
        async def replica() -> Any:  # which process answered: the replicas' tests and benches read it
            return {"pid": os.getpid()}

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def start_replicas(spec: dict[str, Any], replicas: int, *, host: str = "127.0.0.1", port: int = 8000,
                   cpus_per_replica: float | None = None, timeout_s: float = 600.0) -> str:
    """Start Ray (or join ``RAY_ADDRESS``), deploy ``replicas`` copies of the app behind Ray Serve's
    proxy on ``host:port`` and wait until every replica has loaded its model. Returns the base URL
    (``http://host:port/v1``). ``cpus_per_replica``: Ray's CPU reservation per replica (default: the
    machine's CPUs divided among them, at least 1)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 256:
        raise LonglabError(f"replicas must be an integer in [1, 256], got {replicas!r}")
    serve = require_ray_serve()
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=max(replicas, os.cpu_count() or 1), **kwargs)
    cpus = float(ray.available_resources().get("CPU", replicas))
    per = cpus_per_replica if cpus_per_replica is not None else max(cpus // replicas, 1.0)
    spec = {**spec, "threads": spec.get("threads") or max(int(per), 1)}
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(
        serve.ingress()(LonglabReplica), name="LonglabReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": per}, max_ongoing_requests=max(int(spec.get("max_queue", 64)), 1)
        + int(spec.get("max_batch", 16)),
        health_check_period_s=10, graceful_shutdown_timeout_s=5,
    )
    t0 = time.monotonic()
    try:
        serve.run(deployment.bind(dict(spec)), name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as exc:  # noqa: BLE001  a replica's constructor failed (e.g. an unknown model)
        stop_replicas()
        raise LonglabError(f"the replicas did not start: {str(exc).strip().splitlines()[-1][:500]}") from None
    while time.monotonic() - t0 < timeout_s:  # serve.run returns once every replica is up
        status = serve.status().applications.get(APP_NAME)
        if status is not None and str(status.status).endswith("RUNNING"):
            break
        time.sleep(0.5)
    else:
        raise LonglabError(f"the {replicas} replicas did not start within {timeout_s:.0f} s")
    return f"http://{host}:{port}/v1"


def stop_replicas(shutdown_ray: bool = True) -> None:
    """Delete the deployment, stop Serve, and (``shutdown_ray``) Ray if this process started it."""
    serve = require_ray_serve()
    import ray

    try:
        serve.shutdown()
    finally:
        if shutdown_ray and ray.is_initialized():
            ray.shutdown()
