"""``GET /metrics``: Prometheus counters, histograms and gauges labelled by recipe, in a registry of the
app's own (two apps in one process never share counts). Recipes are request text, so at most
``MAX_RECIPES`` distinct labels are kept; later ones count as ``"other"``."""

from __future__ import annotations

from typing import Any

__all__ = ["Metrics", "MAX_RECIPES"]

MAX_RECIPES = 32
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, budget_bytes: int | None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("longlab_requests", "Requests by recipe and outcome (ok, error, cancelled, "
                                "rejected)", ["recipe", "status"], registry=r)
        self.generated = Counter("longlab_generated_tokens", "Tokens generated", ["recipe"], registry=r)
        self.prompt = Counter("longlab_prompt_tokens", "Prompt tokens read", ["recipe"], registry=r)
        self.ttft_s = Histogram("longlab_ttft_seconds", "Seconds from arrival to the first token",
                                ["recipe"], buckets=_TTFT_BUCKETS, registry=r)
        self.latency_s = Histogram("longlab_request_seconds", "Seconds from arrival to the last token",
                                   ["recipe"], buckets=_TTFT_BUCKETS, registry=r)
        self.kv_after = Counter("longlab_request_kv_bytes", "KV bytes a request's prompt cache held after "
                                "compression (sum over finished requests)", ["recipe"], registry=r)
        self.queue = Gauge("longlab_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("longlab_running_requests", "Requests being decoded", registry=r)
        self.held = Gauge("longlab_kv_bytes_held", "KV bytes the running requests hold", ["recipe"],
                          registry=r)
        self.budget = Gauge("longlab_kv_budget_bytes", "The KV byte budget (0: none)", registry=r)
        self.budget.set(budget_bytes or 0)
        self._labels: set[str] = set()

    def label(self, recipe: str) -> str:
        if recipe in self._labels or len(self._labels) < MAX_RECIPES:
            self._labels.add(recipe)
            return recipe
        return "other"

    def finished(self, recipe: str, result: Any, seconds: float) -> None:
        label = self.label(recipe)
        self.requests.labels(label, "ok").inc()
        self.generated.labels(label).inc(len(result.token_ids))
        self.prompt.labels(label).inc(result.prompt_tokens)
        self.kv_after.labels(label).inc(result.kv_bytes_after)
        self.latency_s.labels(label).observe(seconds)

    def ttft(self, recipe: str, seconds: float) -> None:
        self.ttft_s.labels(self.label(recipe)).observe(seconds)

    def failed(self, recipe: str) -> None:
        self.requests.labels(self.label(recipe), "error").inc()

    def cancelled(self, recipe: str) -> None:
        self.requests.labels(self.label(recipe), "cancelled").inc()

    def rejected(self, recipe: str) -> None:
        self.requests.labels(self.label(recipe), "rejected").inc()

    def state(self, queued: int, running: int, held_by_recipe: dict[str, int]) -> None:
        self.queue.set(queued)
        self.running.set(running)
        held: dict[str, int] = {}
        for recipe, n in held_by_recipe.items():
            label = self.label(recipe)
            held[label] = held.get(label, 0) + n
        for label in self._labels | {"other"} | set(held):
            if label in held or label in self._labels:
                self.held.labels(label).set(held.get(label, 0))
