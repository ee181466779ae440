"""``lorenz96``: Lorenz-96 forecasting, the layers-lab proxy of EMFormer's weather forecasting (Chen et al.,
arXiv 2602.01194, ICML 2026; spec: remaining-seeds §35) [recon].

The system (Lorenz 1996): ``dx_i/dt = (x_{i+1} − x_{i−2})·x_{i−1} − x_i + F`` on a ring of ``n = 40``
variables, ``F = 8``, integrated by RK4 with step ``dt = 0.05`` (one state per step). A sequence of
length ``L`` is ``L`` consecutive states on the attractor, normalised by the climatological mean and
standard deviation, so an RMSE of 1 is one climatological std. Start states: a pool of attractor states
(from the task seed), perturbed by N(0, 0.5²) and run ``spinup`` steps further (≈ 3 Lyapunov times at
the default 40), so every sequence is a new trajectory.

The model (``output_dim = n``) sees a window of ``window = 8`` past states and outputs the next state at
every position. Training (:meth:`Lorenz96Task.train_losses`):

- one-step (``rollout = 0``): the outputs at the ``window`` positions against the next states;
- accumulative-context rollout (``rollout = t_out``, EMFormer's released form [code]): from the first
  ``window`` true states, predict the next one, loss and optimizer update, append the **detached**
  prediction and drop the oldest state, ``t_out`` times;
- the composite loss [code] ``L = (1 − w)·L₂ + w·RMSE`` with ``w = (sin θ + 1)/2`` and a learnable ``θ``
  (``model.loss_params[0]``, initialised to −π/2: pure L₂ at the start). ``L₂`` is the mean squared error,
  ``RMSE`` the per-state root mean squared error over the variables (the paper's latitude weights are all
  1 on a ring).

Evaluation (:meth:`Lorenz96Task.predict`): from the first ``window`` true states, an autoregressive rollout
to the end of the sequence; per sample the metrics ``rmse@k`` at leads ``k`` in (1, 5, 20, 40) that fit,
and the score = the anomaly correlation (ACC) of the last lead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...recipe import LonglabError
from .base import IGNORE, Batch, Task, _check, register_task

__all__ = ["LEADS", "Lorenz96Task", "composite_loss", "lorenz96_rk4"]

LEADS = (1, 5, 20, 40)
_POOL: dict[tuple, tuple[torch.Tensor, float, float]] = {}  # (n, F, dt, seed) -> pool, mean, std


def _tendency(x: torch.Tensor, forcing: float) -> torch.Tensor:
    """``dx/dt`` of Lorenz-96 for ``x: [..., n]`` (cyclic indices)."""
    return (torch.roll(x, -1, -1) - torch.roll(x, 2, -1)) * torch.roll(x, 1, -1) - x + forcing


def lorenz96_rk4(x: torch.Tensor, forcing: float, dt: float) -> torch.Tensor:
    """One RK4 step of Lorenz-96: ``x: [..., n]`` -> ``[..., n]``."""
    k1 = _tendency(x, forcing)
    k2 = _tendency(x + 0.5 * dt * k1, forcing)
    k3 = _tendency(x + 0.5 * dt * k2, forcing)
    k4 = _tendency(x + dt * k3, forcing)
    return x + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)


def composite_loss(pred: torch.Tensor, target: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """EMFormer's composite loss ``(1 − w)·mean((p − y)²) + w·mean_states sqrt(mean_vars (p − y)²)``,
    ``w = (sin θ + 1)/2``; ``pred, target: [..., n]``, ``theta`` a scalar tensor."""
    sq = (pred - target) ** 2
    l2 = sq.mean()
    rmse = torch.sqrt(sq.mean(-1) + 1e-12).mean()
    w = (torch.sin(theta) + 1.0) / 2.0
    return (1.0 - w) * l2 + w * rmse


@register_task("lorenz96")
@dataclass
class Lorenz96Task(Task):
    """Lorenz-96 forecasting (see the module docstring); ``length`` counts states."""

    n: int = 40
    forcing: float = 8.0
    dt: float = 0.05
    window: int = 8
    spinup: int = 40
    pool: int = 512

    def __post_init__(self) -> None:
        _check(self.name, "n", self.n, 4)
        _check(self.name, "window", self.window, 1)
        _check(self.name, "spinup", self.spinup, 0)
        _check(self.name, "pool", self.pool, 1)
        for f, hi in (("forcing", 100.0), ("dt", 0.2)):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= hi:
                raise LonglabError(f"task lorenz96: {f} must be a number in (0, {hi}], got {v!r}")

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def input_dim(self) -> int:
        return self.n

    @property
    def output_dim(self) -> int:
        return self.n

    @property
    def loss_params(self) -> tuple[float, ...]:
        return (-math.pi / 2,)  # θ: w = 0, pure L₂ at the start

    def min_length(self) -> int:
        return self.window + 1

    def check_rollout(self, length: int, rollout: int) -> None:
        if rollout and length < self.window + rollout:
            raise LonglabError(
                f"--rollout: {rollout} steps from a window of {self.window} need sequences of at least "
                f"{self.window + rollout} states, got --train-len {length}"
            )

    def _pool(self) -> tuple[torch.Tensor, float, float]:
        """Attractor states ``[pool, n]`` (float64) and the climatological mean and std (cached)."""
        key = (self.n, float(self.forcing), float(self.dt), self.pool, int(self.seed))
        if key not in _POOL:
            g = torch.Generator().manual_seed(30_000 + int(self.seed))
            x = self.forcing + torch.randn(self.pool, self.n, generator=g, dtype=torch.float64)
            for _ in range(int(round(10.0 / self.dt))):  # 10 time units onto the attractor
                x = lorenz96_rk4(x, self.forcing, self.dt)
            states = []
            for _ in range(40):
                x = lorenz96_rk4(x, self.forcing, self.dt)
                states.append(x)
            clim = torch.stack(states)
            _POOL[key] = (x, float(clim.mean()), float(clim.std()))
        return _POOL[key]

    def trajectories(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """``[B, L, n]`` float64 raw states (not normalised)."""
        pool, _, _ = self._pool()
        idx = torch.randint(0, pool.shape[0], (batch,), generator=gen)
        x = pool[idx] + 0.5 * torch.randn(batch, self.n, generator=gen, dtype=torch.float64)
        for _ in range(self.spinup):
            x = lorenz96_rk4(x, self.forcing, self.dt)
        out = []
        for _ in range(length):
            out.append(x)
            x = lorenz96_rk4(x, self.forcing, self.dt)
        return torch.stack(out, dim=1)

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        _, mean, std = self._pool()
        x = ((self.trajectories(batch, length, gen) - mean) / std).float()  # [B, L, n]
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, self.window :] = True  # the forecast states
        return Batch(x, torch.full((batch, length), IGNORE), answer, values=x)

    def loss(self, out, batch):
        """One-step L₂ (the composite loss at θ = −π/2) of the outputs at the first ``window`` positions."""
        w = self.window
        return ((out[:, :w] - batch.tokens[:, 1 : w + 1]) ** 2).mean()

    def train_losses(self, model: nn.Module, batch: Batch, rollout: int = 0) -> Iterator[torch.Tensor]:
        """One-step (one loss) or accumulative-context rollout (``rollout`` losses, one update each)."""
        x, w = batch.tokens, self.window
        self.check_rollout(x.shape[1], rollout)
        theta = model.loss_params[0]
        if not rollout:
            yield composite_loss(model(x[:, :w]), x[:, 1 : w + 1], theta)
            return
        win = x[:, :w]
        for k in range(rollout):
            pred = model(win)[:, -1]  # [B, n]
            yield composite_loss(pred, x[:, w + k], theta)
            win = torch.cat([win[:, 1:], pred.detach()[:, None]], dim=1)  # the detached prediction

    def predict(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, L, n]``: the true first ``window`` states, then the autoregressive rollout."""
        w = self.window
        win = tokens[:, :w]
        preds = []
        for _ in range(tokens.shape[1] - w):
            pred = model(win)[:, -1]
            preds.append(pred)
            win = torch.cat([win[:, 1:], pred[:, None]], dim=1)
        return torch.cat([tokens[:, :w], torch.stack(preds, dim=1)], dim=1)

    def rmse(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``[B, L − window]``: the RMSE over the variables at each lead 1, 2, ... (climatological stds)."""
        w = self.window
        return torch.sqrt(((out[:, w:].double() - batch.tokens[:, w:].double()) ** 2).mean(-1))

    def score(self, logits, batch):
        """Anomaly correlation of the last lead, per sample ``[B]`` (normalised states: anomalies)."""
        f, o = logits[:, -1].double(), batch.tokens[:, -1].double()
        return ((f * o).sum(-1) / torch.sqrt((f * f).sum(-1) * (o * o).sum(-1)).clamp_min(1e-12)).float()

    def metrics(self, out, batch):
        r = self.rmse(out, batch)[0]
        return {f"rmse@{k}": float(r[k - 1]) for k in LEADS if k <= r.shape[0]}
