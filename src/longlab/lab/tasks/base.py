"""The task extension point of the layers lab: :class:`Batch`, :class:`Task`, the registry ``LAB_TASKS``
(``@register_task("name")``) and :func:`task_config` (``"name"`` or ``"name:k=v,..."``).

A task makes a :class:`Batch` of ``tokens: [B, T]`` (the model input), ``targets: [B, T]`` (the next
token to predict where the loss counts, else ``-100``) and ``answer: [B, T]`` (the positions that are
scored). ``score`` is the fraction of answer positions whose argmax is right, per sample; tasks with
an exact next-token distribution (``mtd``) also give ``probs: [B, T, V]`` and score
``exp(−mean KL(p_true ‖ p_model))``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...recipe import LonglabError

__all__ = [
    "IGNORE",
    "LAB_TASKS",
    "Batch",
    "ClassBatch",
    "Task",
    "TimeClassTask",
    "kl_per_position",
    "register_task",
    "task_config",
]

LAB_TASKS: dict[str, type[Task]] = {}
IGNORE = -100


def register_task(name: str):
    def wrap(cls: type[Task]) -> type[Task]:
        cls.name = name
        LAB_TASKS[name] = cls
        return cls

    return wrap


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T] long, IGNORE where no loss
    answer: torch.Tensor  # [B, T] bool, scored positions
    probs: torch.Tensor | None = None  # [B, T, V] exact next-token distribution (where known)
    # continuous tasks (lcube): tokens are [B, T, D] floats; the next value, its exact conditional
    values: torch.Tensor | None = None  # [B, T, D] x_{t+1} (the target at t)
    cond_mean: torch.Tensor | None = None  # [B, T, D] E[x_{t+1} | x_{≤t}]
    cond_var: torch.Tensor | None = None  # [T, D] Var[x_{t+1} | x_{≤t}] (data-independent)
    info: torch.Tensor | None = None  # [T] available information I* of x_{t+1} (nats)


@dataclass
class Task:
    """Base: subclasses set ``vocab_size`` and implement :meth:`_sample` for one sequence."""

    name: ClassVar[str] = "?"
    seed: int = 0  # task-level randomness (mtd's Q); sequences come from the generator given to sample

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def input_dim(self) -> int:
        """0 for token tasks; the value dimension ``D`` of continuous tasks (``lcube``)."""
        return 0

    @property
    def output_dim(self) -> int:
        """0: the default head (tied logits, or lcube's Gaussian); ``O > 0``: a linear head to ``O`` outputs
        per position that this task's :meth:`loss` and :meth:`score` read."""
        return 0

    @property
    def loss_params(self) -> tuple[float, ...]:
        """Initial values of the loss's learnable scalars (``model.loss_params``); none by default."""
        return ()

    def check_rollout(self, length: int, rollout: int) -> None:
        """Whether ``rollout`` autoregressive training steps fit sequences of ``length`` (default: only 0)."""
        if rollout:
            raise LonglabError(f"--rollout: task {self.name} has no rollout training; use --rollout 0")

    def train_losses(self, model: nn.Module, batch: Batch, rollout: int = 0) -> Iterator[torch.Tensor]:
        """The losses of one training step, one per optimizer update (the trainer steps after each):
        by default one, ``loss(model(tokens), batch)``; forecasting tasks roll out ``rollout`` steps."""
        self.check_rollout(int(batch.tokens.shape[1]), rollout)
        yield self.loss(model(batch.tokens), batch)

    def predict(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """What :meth:`score` reads for the inputs ``tokens`` (default: one forward pass)."""
        return model(tokens)

    def loss(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Training loss: cross-entropy on the answer tokens (``out``: logits ``[B, T, V]``)."""
        return F.cross_entropy(out.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)

    def metrics(self, out: torch.Tensor, batch: Batch) -> dict[str, float]:
        """Extra per-sample numbers for the results row (``batch`` of one sequence)."""
        return {"kl": float(kl_per_position(out, batch)[0])} if batch.probs is not None else {}

    def min_length(self) -> int:
        return 8

    def check_length(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < self.min_length():
            raise LonglabError(
                f"task {self.name}: length must be an integer >= {self.min_length()}, got {length!r}"
            )

    def sample(self, batch: int, length: int, gen: torch.Generator, exact: bool = True) -> Batch:
        """``batch`` sequences of exactly ``length`` tokens, drawn from ``gen``; ``exact=False`` skips the
        exact next-token distributions (training needs only the tokens)."""
        self.check_length(length)
        rows = [self._sample(length, gen) for _ in range(batch)]
        tokens = torch.stack([r[0] for r in rows])
        answer = torch.stack([r[1] for r in rows])  # [B, T] bool: the token at t+1 is an answer
        targets = torch.full_like(tokens, IGNORE)
        targets[:, :-1] = torch.where(answer[:, :-1], tokens[:, 1:], IGNORE)
        return Batch(tokens, targets, answer & (targets != IGNORE))

    def _sample(self, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence ``[T]`` and the mask ``[T]`` of positions whose *next* token is an answer."""
        raise NotImplementedError

    def score(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per-sample score ``[B]`` in [0, 1] (see the module docstring)."""
        if batch.probs is not None:
            kl = kl_per_position(logits, batch)
            return torch.exp(-kl)
        right = (logits.argmax(-1) == batch.targets) & batch.answer
        return right.sum(-1).float() / batch.answer.sum(-1).clamp_min(1).float()


def kl_per_position(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean over answer positions of ``KL(p_true ‖ p_model)`` in nats, per sample ``[B]``."""
    assert batch.probs is not None
    logq = torch.log_softmax(logits.float(), -1)
    p = batch.probs.float()
    kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)  # [B, T]
    m = batch.answer.float()
    return (kl * m).sum(-1) / m.sum(-1).clamp_min(1)


def _randint(n: int, gen: torch.Generator, size: int = 1) -> torch.Tensor:
    return torch.randint(0, n, (size,), generator=gen)


def _check(name: str, field_: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise LonglabError(f"task {name}: {field_} must be an integer >= {lo}, got {value!r}")


def _check_p(name: str, field_: str, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    if not ok:
        raise LonglabError(f"task {name}: {field_} must be a probability in [0, 1], got {value!r}")


def _split_top(text: str) -> list[str]:
    """Split ``k=v,k=[a,b]`` at the commas outside brackets (list values keep their commas)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth <= 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def task_config(spec: str | Task, seed: int = 0) -> Task:
    """A task from ``"name"`` or ``"name:k=v,..."`` (values as JSON scalars, never evaluated)."""
    if isinstance(spec, Task):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        choices = ", ".join(LAB_TASKS)
        raise LonglabError(f"--task: expected a task name, got {spec!r}; choose one of {choices}")
    name, _, rest = spec.strip().partition(":")
    if name not in LAB_TASKS:
        raise LonglabError(f"--task: unknown task {name!r}; choose one of {', '.join(sorted(LAB_TASKS))}")
    cls = LAB_TASKS[name]
    fields = {f for f in cls.__dataclass_fields__}
    kwargs: dict = {"seed": seed}
    for item in filter(None, (p.strip() for p in _split_top(rest))):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            raise LonglabError(
                f"--task: {name} has no parameter {key!r}; parameters: {', '.join(sorted(fields))}"
            )
        try:
            kwargs[key] = json.loads(raw)
        except ValueError:
            kwargs[key] = raw
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise LonglabError(f"--task: {name}: {err}") from None



@dataclass
class ClassBatch(Batch):
    """A sequence-classification batch: ``label: [B]``; ``answer: [B, T]`` marks the readout steps."""

    label: torch.Tensor | None = None


class TimeClassTask(Task):
    """Base of sequence classification with a rate readout (the spiking tasks): the model's outputs
    ``[B, T, classes]`` are averaged over the readout steps (``answer``) into logits ``[B, classes]``."""

    classes: int = 2

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def output_dim(self) -> int:
        return self.classes

    def readout(self, out: torch.Tensor, batch: ClassBatch) -> torch.Tensor:
        """``[B, classes]``: the mean of ``out`` over the readout steps."""
        m = batch.answer.to(out.dtype)[..., None]
        return (out * m).sum(1) / m.sum(1).clamp_min(1)

    def loss(self, out, batch):
        return F.cross_entropy(self.readout(out, batch), batch.label)

    def score(self, logits, batch):
        return (self.readout(logits, batch).argmax(-1) == batch.label).float()

    def metrics(self, out, batch):
        return {}
