"""``mtd``: mixture of transition distributions (D'Angelo & Flammarion, arXiv 2604.10848): a fixed
transition matrix Q (from the task seed), per-sequence lag weights ``λ ~ Dir(1_K)``, ``x_t ~ Σ_k λ_k
Q(x_{t−k}, ·)``. ``probs`` is the Bayes-optimal predictor ``E_{λ|x_{<t}}[Σ_k λ_k Q(x_{t−k}, ·)]`` by
self-normalised importance sampling over ``draws`` prior draws; :func:`mirror_descent` gives the
MD-n estimator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, _check, register_task

__all__ = ["MTDTask", "mirror_descent"]

@register_task("mtd")
@dataclass
class MTDTask(Task):
    states: int = 8
    lags: int = 3
    draws: int = 4096
    concentration: float = 0.5  # Dirichlet prior of each row of Q

    def __post_init__(self) -> None:
        _check(self.name, "states", self.states, 2)
        _check(self.name, "lags", self.lags, 1)
        _check(self.name, "draws", self.draws, 1)
        g = torch.Generator().manual_seed(10_000 + int(self.seed))
        conc = torch.full((self.states, self.states), float(self.concentration))
        self.Q = _dirichlet(conc, g)  # [S, S], rows sum to 1

    @property
    def vocab_size(self) -> int:
        return self.states

    def min_length(self) -> int:
        return self.lags + 2

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        s, k = self.states, self.lags
        lam = _dirichlet(torch.ones(batch, k), gen)  # [B, K]
        x = torch.randint(0, s, (batch, length), generator=gen)
        for t in range(k, length):
            lag = torch.multinomial(lam, 1, generator=gen)[:, 0] + 1  # [B]
            prev = x[torch.arange(batch), t - lag]
            x[:, t] = torch.multinomial(self.Q[prev], 1, generator=gen)[:, 0]
        probs = self.bayes(x, gen) if exact else None
        targets = torch.full_like(x, IGNORE)
        targets[:, k - 1 : -1] = x[:, k:]
        answer = targets != IGNORE
        return Batch(x, targets, answer, probs)

    def lag_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``Q(x_{t+1−k}, ·)`` for the prediction at position t: ``[B, T, K, S]`` (zeros before lag k)."""
        b, t = x.shape
        out = torch.zeros(b, t, self.lags, self.states)
        for k in range(1, self.lags + 1):
            out[:, k - 1 :, k - 1] = self.Q[x[:, : t - k + 1]]
        return out

    def bayes(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Bayes predictor at every position ``[B, T, S]`` (prediction of x_{t+1} from x_{≤t})."""
        b, t = x.shape
        k = self.lags
        lam = _dirichlet(torch.ones(self.draws, k), gen)  # [N, K] prior draws
        rows = self.lag_rows(x)  # [B, T, K, S]
        # likelihood of x_{t+1} under each lag, for t = k-1 .. T-2: Q(x_{t+1-k}, x_{t+1})
        lik = torch.zeros(b, t, k)
        lik[:, :-1] = rows[:, :-1].gather(-1, x[:, 1:, None, None].expand(-1, -1, k, 1))[..., 0]
        ll = torch.log((lik[:, k - 1 : -1] @ lam.T).clamp_min(1e-30))  # [B, T-k, N]
        cum = torch.cat([torch.zeros(b, 1, self.draws), ll.cumsum(1)], dim=1)  # evidence before each step
        w = torch.softmax(cum, dim=-1)  # [B, T-k+1, N] posterior weights at t = k-1 .. T-1
        post_lam = w @ lam  # [B, T-k+1, K] posterior mean of λ
        probs = torch.full((b, t, self.states), 1.0 / self.states)
        probs[:, k - 1 :] = (post_lam[..., None] * rows[:, k - 1 :]).sum(-2)
        return probs


def _dirichlet(conc: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Dirichlet draws (one per row of ``conc``) from ``gen``: normalised Gamma(conc, 1) variates."""
    g = torch._standard_gamma(conc, generator=gen)
    return g / g.sum(-1, keepdim=True).clamp_min(1e-30)


def mirror_descent(task: MTDTask, x: torch.Tensor, steps: int, eta: float) -> torch.Tensor:
    """MD-n estimate of λ from the whole sequence ``x: [B, T]`` (entropic mirror descent from uniform):
    ``λ^{n+1} ∝ λ^n · exp(η g)``, ``g_k = (1/T') Σ_t Q(x_{t−k}, x_t) / Σ_j λ_j Q(x_{t−j}, x_t)``
    (the gradient of the mean log-likelihood). Returns ``[B, K]``."""
    b, t = x.shape
    k = task.lags
    rows = task.lag_rows(x)
    lik = rows[:, :-1].gather(-1, x[:, 1:, None, None].expand(-1, -1, k, 1))[..., 0][:, k - 1 :]  # [B, T', K]
    lam = torch.full((b, k), 1.0 / k)
    log_lam = torch.log(lam)
    for _ in range(steps):
        g = (lik / (lik @ lam[..., None]).clamp_min(1e-30)).mean(1)
        log_lam = log_lam + eta * g  # the same update in log space: no overflow of exp(η g) for large g
        lam = torch.softmax(log_lam, dim=-1)
    return lam
