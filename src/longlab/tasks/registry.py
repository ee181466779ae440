"""The task registry: every task is registered once, with the metric its samples are scored by.

A generator registers itself where it is defined::

    @register_task("qa_1", metric="string_match_part")
    def qa_1(tokenizer, length, num_samples=1, seed=0, **options) -> list[Sample]: ...

A task whose samples come from a file (a JSONL set in the common format) has no generator; declare its
metric with ``declare_task("my_task", metric="exact_match")``, or give a line its own ``"metric"`` (read
into :attr:`Sample.metric`, which :func:`score_sample` prefers). A task nobody registered is scored with
:data:`DEFAULT_METRIC` (``string_match_all``), as RULER scores its NIAH tasks.

:func:`metric_for` and :func:`score` read this registry; there is no list of task names anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..recipe import LiveView, LonglabError
from .sample import Sample
from .scoring import METRICS, Refs

__all__ = [
    "DEFAULT_METRIC",
    "TaskSpec",
    "TASK_REGISTRY",
    "TASKS",
    "register_task",
    "declare_task",
    "get_task",
    "metric_for",
    "score",
    "score_sample",
]

DEFAULT_METRIC = "string_match_all"
KINDS = ("generated", "grid", "file")


@dataclass(frozen=True)
class TaskSpec:
    """One registered task.

    ``kind``: ``"generated"`` (``generator(tokenizer, length, num_samples=1, seed=0, **options)``),
    ``"grid"`` (:func:`~longlab.tasks.classic.niah_grid`'s ``(tokenizer, lengths, depths, ...)``) or
    ``"file"`` (samples come from a file; no generator). ``metric``: a name in
    :data:`~longlab.tasks.scoring.METRICS`."""

    name: str
    metric: str
    kind: str = "generated"
    generator: Callable[..., list[Sample]] | None = None


TASK_REGISTRY: dict[str, TaskSpec] = {}


def _check_metric(task: str, metric: Any) -> str:
    if not isinstance(metric, str) or metric not in METRICS:
        raise LonglabError(
            f"task {task!r}: metric must be one of {', '.join(sorted(METRICS))}, got {metric!r} "
            "(register a new one with longlab.tasks.register_metric)"
        )
    return metric


def _same_function(a: Callable | None, b: Callable | None) -> bool:
    """The same definition (a module imported twice, e.g. reloaded, defines it anew)."""
    if a is b:
        return True
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return a is not None and b is not None and key(a) == key(b)


def _add(spec: TaskSpec, replace: bool) -> TaskSpec:
    old = TASK_REGISTRY.get(spec.name)
    if old is not None and not replace and old != spec and not (
        old.kind == spec.kind and old.metric == spec.metric and _same_function(old.generator, spec.generator)
    ):
        raise LonglabError(
            f"task {spec.name!r} is already registered ({old.kind}, metric {old.metric}); "
            "pass replace=True to change it"
        )
    TASK_REGISTRY[spec.name] = spec
    return spec


def register_task(
    name: str, *, metric: str = DEFAULT_METRIC, kind: str = "generated", replace: bool = False
) -> Callable[[Callable[..., list[Sample]]], Callable[..., list[Sample]]]:
    """Decorator: register a sample generator as task ``name``, scored with ``metric``."""
    if not isinstance(name, str) or not name:
        raise LonglabError(f"a task name must be a non-empty string, got {name!r}")
    _check_metric(name, metric)
    if kind not in ("generated", "grid"):
        raise LonglabError(f"task {name!r}: kind must be 'generated' or 'grid', got {kind!r}")

    def wrap(generator: Callable[..., list[Sample]]) -> Callable[..., list[Sample]]:
        _add(TaskSpec(name, metric, kind, generator), replace)
        return generator

    return wrap


def declare_task(name: str, metric: str = DEFAULT_METRIC, *, replace: bool = False) -> TaskSpec:
    """Register a task whose samples come from a file (no generator), scored with ``metric``.

    Declaring the same name with the same metric again is a no-op; a generated task keeps its
    generator and metric unless ``replace=True``."""
    if not isinstance(name, str) or not name:
        raise LonglabError(f"a task name must be a non-empty string, got {name!r}")
    _check_metric(name, metric)
    old = TASK_REGISTRY.get(name)
    if old is not None and old.metric == metric and not replace:
        return old
    return _add(TaskSpec(name, metric, "file"), replace)


TASKS: Mapping[str, Callable[..., list[Sample]]] = LiveView(
    "TASKS", lambda: {n: s.generator for n, s in TASK_REGISTRY.items() if s.kind == "generated"}
)
"""Task name -> generator ``(tokenizer, length, num_samples=1, seed=0, **options) -> list[Sample]``."""


def get_task(name: str) -> Callable[..., list[Sample]]:
    """The generator registered as ``name``; :class:`LonglabError` (a ``ValueError``) listing the valid
    names otherwise."""
    spec = TASK_REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None or spec.kind != "generated":
        raise LonglabError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    assert spec.generator is not None
    return spec.generator


def metric_for(task: str) -> str:
    """The metric ``task`` is registered with; :data:`DEFAULT_METRIC` for a task nobody registered."""
    spec = TASK_REGISTRY.get(task) if isinstance(task, str) else None
    return spec.metric if spec is not None else DEFAULT_METRIC


def score(task: str, prediction: str, answers: Refs, *, metric: str | None = None) -> float:
    """Score one prediction with ``metric`` or else the task's registered metric; a float in [0, 1]."""
    name = metric or metric_for(task)
    return METRICS[_check_metric(task, name)](prediction, answers)


def score_sample(sample: Sample, prediction: str) -> float:
    """Score a prediction for ``sample``: its own declared ``metric`` (a JSONL line's ``"metric"``) if
    any, else its task's registered metric."""
    return score(sample.task, prediction, sample.answers, metric=sample.metric or None)
