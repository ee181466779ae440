"""``longlab eval --backend ray``: the grid sharded by sample over Ray workers.

A shard is one (task, length, sample, position) with the cells it still lacks, so each worker keeps the
prefill-once branching of its engine (:class:`~longlab.eval.runner.SampleRunner`). Each worker is a Ray
actor that
loads the model once (a GPU each when CUDA is available, else a share of the CPUs); shards go to
whichever worker is free. Workers only compute and return rows: the driver is the single writer of
the results store, one transaction per row, so resuming works exactly as with the serial backend.

Ray is an optional dependency (``pip install 'longlab[ray]'``). ``RAY_ADDRESS`` set in the
environment joins an existing cluster; otherwise a local one is started for the run and shut down.
The grid driver (:func:`longlab.eval.driver.run_eval`) chooses this backend; nothing here imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..recipe import LonglabError
from .config import EvalConfig
from .runner import SampleRunner

__all__ = ["require_ray", "run_ray", "SampleWorker"]


def require_ray() -> Any:
    """Import Ray, or fail with the command that installs it."""
    try:
        import ray
    except ImportError:
        raise LonglabError("--backend ray needs Ray: pip install 'longlab[ray]'") from None
    return ray


class SampleWorker:
    """One model per worker; ``run(sample, cells, position)`` returns that sample's rows."""

    def __init__(self, config: dict[str, Any], config_hash: dict[str, str], threads: int,
                 device: str) -> None:
        import torch

        from ..models import load_model

        torch.set_num_threads(max(1, threads))
        cfg = EvalConfig(**config)
        model, tokenizer = load_model(cfg.model, device=device)
        self.runner = SampleRunner(model, tokenizer, cfg, config_hash, backend="ray")

    def run(self, sample: Any, cells: list[Any], position: str) -> list[dict[str, Any]]:
        rows = list(self.runner.run(sample, cells, position))
        for row in rows:
            row["extra"]["worker_pid"] = os.getpid()
        return rows


def run_ray(
    config: EvalConfig,
    config_hash: dict[str, str],
    todo: list[tuple[Any, list[Any], str]],
    write: Callable[[dict[str, Any]], None],
) -> None:
    """Evaluate ``todo`` (sample, missing cells, position) on ``config.workers`` Ray workers; ``write``
    each row."""
    if not todo:
        return
    ray = require_ray()
    import torch
    from ray.util import ActorPool

    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=max(config.workers or 2, os.cpu_count() or 1), **kwargs)
        started = True
    try:
        use_gpu = torch.cuda.is_available()
        n_workers = config.workers or 2
        if use_gpu:  # one GPU per worker: more workers than GPUs would wait forever
            n_workers = max(1, min(n_workers, int(ray.available_resources().get("GPU", 0)) or 1))
        cpus = float(ray.available_resources().get("CPU", n_workers))
        per_worker = max(1, int(cpus // n_workers))
        actor = ray.remote(num_cpus=per_worker, num_gpus=1 if use_gpu else 0)(SampleWorker)
        settings = {**asdict(config), "backend": "serial", "progress": False}  # what a worker needs
        device = "cuda" if use_gpu else "cpu"
        workers = [actor.remote(settings, config_hash, per_worker, device) for _ in range(n_workers)]
        pool = ActorPool(workers)
        try:
            for rows in pool.map_unordered(lambda w, item: w.run.remote(*item), todo):
                for row in rows:
                    write(row)
        finally:
            for w in workers:
                ray.kill(w)
    finally:
        if started:
            ray.shutdown()
