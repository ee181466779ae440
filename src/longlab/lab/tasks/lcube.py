"""``lcube``: L-CUBE hierarchical Gaussian sequences (:mod:`longlab.lab.lcube`) [recon]: continuous
tokens ``x_t ∈ R^D``, the exact conditional ``p(x_t | x_{<t})``; the model has a linear input and a
diagonal-Gaussian head; score = the utilisation ``U`` (1: the exact conditional, 0: the marginal)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import IGNORE, Batch, Task, _check, register_task


@register_task("lcube")
@dataclass
class LCubeTask(Task):
    """L-CUBE (see :mod:`longlab.lab.lcube`): defaults β = 0.75, c = 1, ρ = 0.9, D = 8, σ_n = 0.1."""

    dim: int = 8
    beta: float = 0.75
    c: float = 1.0
    rho: float = 0.9
    sigma: float = 0.1
    min_logvar: float = -9.0  # clamp of the model's log-variance (keeps the Gaussian NLL finite)

    def __post_init__(self) -> None:
        _check(self.name, "dim", self.dim, 1)
        ranges = {"beta": "(0, 1)", "c": "(0, inf)", "rho": "(0, 1)", "sigma": "[0, inf)"}
        for f, allowed in ranges.items():
            v = getattr(self, f)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            ok = ok and (v >= 0 if f == "sigma" else v > 0) and (v < 1 if allowed.endswith("1)") else True)
            if not ok:
                raise LonglabError(f"task lcube: {f} must be a number in {allowed}, got {v!r}")
        self._cond: dict[int, object] = {}

    @property
    def vocab_size(self) -> int:
        return 0

    @property
    def input_dim(self) -> int:
        return self.dim

    def min_length(self) -> int:
        return 2

    def conditional(self, length: int):
        from ..lcube import Conditional

        if length not in self._cond:
            self._cond[length] = Conditional(length, self.dim, self.c, self.beta, self.rho, self.sigma)
        return self._cond[length]

    def sample(self, batch, length, gen, exact=True):
        from ..lcube import lcube_sample

        self.check_length(length)
        x = lcube_sample(batch, length, self.dim, self.c, self.beta, self.rho, self.sigma, gen)  # [B, T, D]
        values = torch.zeros_like(x)
        values[:, :-1] = x[:, 1:]
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, :-1] = True
        out = Batch(x.float(), torch.full((batch, length), IGNORE), answer, values=values.float())
        if exact:
            cond = self.conditional(length)
            mean = cond.mean(x)  # [B, T, D] E[x_t | x_<t]
            out.cond_mean = torch.zeros_like(x)
            out.cond_mean[:, :-1] = mean[:, 1:]
            out.cond_var = torch.ones(length, self.dim, dtype=torch.float64)
            out.cond_var[:-1] = cond.var[1:]
            out.info = torch.zeros(length, dtype=torch.float64)
            out.info[:-1] = cond.info()[1:]
        return out

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Model output ``[B, T, 2D]`` -> mean ``[B, T, D]`` and variance ``[B, T, D]``."""
        mean, logvar = out[..., : self.dim], out[..., self.dim :]
        return mean, torch.exp(logvar.clamp(self.min_logvar, 9.0))

    def loss(self, out, batch):
        """Gaussian negative log-likelihood of ``x_{t+1}`` per coordinate (up to ``½ log 2π``)."""
        mean, var = self.split(out.float())
        nll = 0.5 * (torch.log(var) + (batch.values - mean) ** 2 / var)  # [B, T, D]
        m = batch.answer.float()[..., None]
        return (nll * m).sum() / (m.sum() * self.dim)

    def _kl(self, out, batch) -> torch.Tensor:
        from ..lcube import gaussian_kl

        assert batch.cond_mean is not None and batch.cond_var is not None
        mean, var = self.split(out.double())
        return gaussian_kl(batch.cond_mean, batch.cond_var[None], mean, var)  # [B, T]

    def score(self, logits, batch):
        """Utilisation ``U = Σ_t (I*_t − KL_t) / Σ_t I*_t`` per sample ``[B]``."""
        m = batch.answer.double()
        kl = self._kl(logits, batch)
        info = batch.info[None].double()
        return (((info - kl) * m).sum(-1) / (info * m).sum(-1).clamp_min(1e-12)).float()

    def metrics(self, out, batch):
        m = batch.answer.double()
        kl = (self._kl(out, batch) * m).sum(-1) / m.sum(-1)
        info = (batch.info[None].double() * m).sum(-1) / m.sum(-1)
        return {"kl": float(kl[0]), "info": float(info[0])}
