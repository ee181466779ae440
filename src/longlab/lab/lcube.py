"""L-CUBE: hierarchical Gaussian sequences with exact conditionals (Chen, Mayné i Comas et al., ICML 2026;
the generator's code is withheld, so this follows the reconstruction in the spec [recon]).

Generator (``L = 2^K`` leaves; a shorter length ``T`` is the first ``T`` leaves of the ``2^⌈log₂T⌉`` tree):

- level-ℓ nodes (ℓ = 0..K, leaves at ℓ = 0) cover dyadic blocks of ``2^ℓ`` tokens; widths
  ``d_0 = D`` and ``d_ℓ = max(d_{ℓ−1}, ⌈c·2^{βℓ}⌉)`` [recon: the spec's ``⌈c·2^{βℓ}⌉`` is below ``D`` at the
  lowest levels, and a child cannot take more coordinates than its parent has, so widths are clamped to be
  non-decreasing];
- root ``z_K ~ N(0, I)``; child ``z_child = ρ·S·z_parent + √(1−ρ²)·ε``, where the left child takes the
  parent's coordinates ``[0, d_{ℓ−1})`` and the right child ``[d_ℓ − d_{ℓ−1}, d_ℓ)`` (they share
  ``2d_{ℓ−1} − d_ℓ ∝ 2^{βℓ}`` coordinates, so ``I^BP_{L/2;L} ∝ L^β``);
- token ``x_t = z_leaf,t + σ_n·ξ_t`` (``D`` coordinates). Sampling is top-down, ``O(Σ_ℓ L/2^ℓ·d_ℓ) = O(L)``.

Every node coordinate has unit variance and a single parent coordinate, so the coordinates form a forest
whose roots are the ``d_K`` root coordinates. Two leaf coordinates are correlated iff their ancestor chains
meet, and then ``Cov = ρ^{2h}`` with ``h`` the level where they meet; so ``Σ`` (``TD × TD``) is block
diagonal over root coordinates, and the ``D`` coordinates of one token always lie in different blocks.
The exact conditional ``p(x_t | x_{<t})`` is therefore a diagonal Gaussian: per block, in time order,
``Σ_g = L_g L_gᵀ`` (Cholesky), innovation ``w = diag(L_g)·L_g⁻¹x_g``, ``μ = x − w``, ``var = diag(L_g)²``
(the LDL factorisation of the spec, per block).

Metrics (spec §6): the model outputs a diagonal Gaussian ``(μ̂_t, σ̂²_t)``;
``KL_t = ½ Σ_a [var/σ̂² + (μ̂−μ)²/σ̂² − 1 + log(σ̂²/var)]``; available information
``I*_t = H(x_t) − H(x_t | x_{<t}) = ½ Σ_a log((1+σ_n²)/var_{t,a})``; extracted ``Î_t = I*_t − KL_t``;
utilisation ``U = Σ_t Î_t / Σ_t I*_t`` (1: the exact conditional; 0: no better than the marginal;
negative: worse than the marginal).
"""

from __future__ import annotations

import math

import torch

__all__ = ["Conditional", "chains", "covariance", "gaussian_kl", "lcube_sample", "widths"]


def widths(levels: int, dim: int, c: float, beta: float) -> list[int]:
    """Node widths ``[d_0, ..., d_K]`` (``d_0 = D``, non-decreasing)."""
    d = [dim]
    for ell in range(1, levels + 1):
        d.append(max(d[-1], math.ceil(c * 2.0 ** (beta * ell) - 1e-9)))
    return d


def levels_for(length: int) -> int:
    return max(1, math.ceil(math.log2(length)))


def lcube_sample(batch: int, length: int, dim: int, c: float, beta: float, rho: float, sigma: float,
                 gen: torch.Generator) -> torch.Tensor:
    """Top-down sample ``x: [B, T, D]`` (float64) of the first ``T`` leaves of the ``2^K`` tree."""
    k = levels_for(length)
    d = widths(k, dim, c, beta)
    z = torch.randn(batch, 1, d[k], generator=gen, dtype=torch.float64)  # [B, nodes, d_K]
    noise = math.sqrt(1.0 - rho * rho)
    for ell in range(k, 0, -1):
        keep = -(-length // 2 ** (ell - 1))  # children needed to cover the first T leaves
        lo, hi = z[..., : d[ell - 1]], z[..., d[ell] - d[ell - 1] :]
        child = torch.stack([lo, hi], dim=2).flatten(1, 2)[:, :keep]  # [B, 2·nodes, d_{ℓ−1}]
        z = rho * child + noise * torch.randn(child.shape, generator=gen, dtype=torch.float64)
    return z + sigma * torch.randn(z.shape, generator=gen, dtype=torch.float64)


def chains(length: int, dim: int, c: float, beta: float) -> torch.Tensor:
    """``[T, D, K+1]``: the coordinate index, at each level ℓ, of leaf coordinate ``(t, a)``'s ancestor
    (``c_0 = a``, ``c_{ℓ+1} = c_ℓ + bit_ℓ(t)·(d_{ℓ+1} − d_ℓ)``; bit 1 = right child)."""
    k = levels_for(length)
    d = widths(k, dim, c, beta)
    t = torch.arange(length)
    out = torch.zeros(length, dim, k + 1, dtype=torch.long)
    out[:, :, 0] = torch.arange(dim)
    for ell in range(k):
        right = ((t >> ell) & 1)[:, None]
        out[:, :, ell + 1] = out[:, :, ell] + right * (d[ell + 1] - d[ell])
    return out


def _meet_level(t: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """Level where the ancestor chains of leaf coordinates meet: ``t: [n]`` tokens, ``path: [n, K+1]``
    -> ``[n, n]`` long (``K+1`` where they never meet)."""
    k1 = path.shape[1]
    shift = torch.arange(k1)
    node = t[:, None] >> shift[None, :]  # [n, K+1] node index per level
    same = (node[:, None, :] == node[None, :, :]) & (path[:, None, :] == path[None, :, :])  # [n, n, K+1]
    # once merged, chains stay merged: the meeting level is the number of levels before the first match
    return (~same).long().sum(-1)


def covariance(length: int, dim: int, c: float, beta: float, rho: float, sigma: float) -> torch.Tensor:
    """The full token covariance ``Σ: [T·D, T·D]`` (float64; index ``t·D + a``), for tests and small T."""
    path = chains(length, dim, c, beta).reshape(length * dim, -1)
    t = torch.arange(length).repeat_interleave(dim)
    h = _meet_level(t, path)
    cov = torch.where(h < path.shape[1], rho ** (2.0 * h.double()), torch.zeros((), dtype=torch.float64))
    return cov + sigma**2 * torch.eye(length * dim, dtype=torch.float64)


class Conditional:
    """Per-block Cholesky factors for one (length, configuration): ``cond(x)`` gives the exact
    conditional mean ``[B, T, D]`` and the (data-independent) conditional variance ``[T, D]``."""

    def __init__(self, length: int, dim: int, c: float, beta: float, rho: float, sigma: float) -> None:
        path = chains(length, dim, c, beta)  # [T, D, K+1]
        root = path[:, :, -1].reshape(-1)  # block of each leaf coordinate (t·D + a order)
        flat = path.reshape(length * dim, -1)
        t_of = torch.arange(length).repeat_interleave(dim)
        groups = [torch.nonzero(root == g, as_tuple=False)[:, 0] for g in torch.unique(root)]
        m = max(len(g) for g in groups)
        self.index = torch.full((len(groups), m), -1, dtype=torch.long)  # [G, m] flat indices, time order
        chol = torch.eye(m, dtype=torch.float64).repeat(len(groups), 1, 1)  # [G, m, m]
        for gi, idx in enumerate(groups):  # idx is ascending in t·D + a, so in time order
            h = _meet_level(t_of[idx], flat[idx])
            zero = torch.zeros((), dtype=torch.float64)
            cov = torch.where(h < flat.shape[1], rho ** (2.0 * h.double()), zero)
            cov = cov + sigma**2 * torch.eye(len(idx), dtype=torch.float64)
            chol[gi, : len(idx), : len(idx)] = torch.linalg.cholesky(cov)
            self.index[gi, : len(idx)] = idx
        self.chol = chol
        self.length, self.dim = length, dim
        diag = torch.diagonal(chol, dim1=-2, dim2=-1)  # [G, m]
        var = torch.empty(length * dim, dtype=torch.float64)
        valid = self.index >= 0
        var[self.index[valid]] = (diag**2)[valid]
        self.var = var.reshape(length, dim)  # [T, D]
        self.marginal = 1.0 + sigma**2

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, D]`` -> exact ``E[x_t | x_{<t}]``: ``[B, T, D]`` (float64)."""
        b = x.shape[0]
        flat = x.reshape(b, -1).double()
        valid = self.index >= 0
        xg = torch.zeros(b, *self.index.shape, dtype=torch.float64)
        xg[:, valid] = flat[:, self.index[valid]]  # [B, G, m] (padding 0)
        e = torch.linalg.solve_triangular(self.chol, xg.permute(1, 2, 0), upper=False)  # [G, m, B]
        w = torch.diagonal(self.chol, dim1=-2, dim2=-1)[..., None] * e  # innovations [G, m, B]
        inno = torch.zeros(b, flat.shape[1], dtype=torch.float64)
        inno[:, self.index[valid]] = w.permute(2, 0, 1)[:, valid]
        return (flat - inno).reshape(x.shape)

    def info(self) -> torch.Tensor:
        """``I*_t = ½ Σ_a log(marginal var / conditional var)`` per token ``[T]`` (nats)."""
        return 0.5 * torch.log(self.marginal / self.var).sum(-1)

    def window_info(self, window: int) -> torch.Tensor:
        """Information ``[T]`` the best predictor that sees only the last ``window`` tokens extracts:
        ``½ Σ_a log(marginal var / Var[x_{t,a} | x_{t−w..t−1}])``. (Its expected KL to the exact
        conditional is ``½ log(var_w / var)`` per coordinate, so this is ``I* − E[KL]``: the utilisation
        ceiling of a model whose context is ``window`` tokens.)"""
        t_of = torch.arange(self.length).repeat_interleave(self.dim)
        var_w = torch.empty(self.length * self.dim, dtype=torch.float64)
        for gi in range(self.index.shape[0]):
            idx = self.index[gi][self.index[gi] >= 0]
            n = len(idx)
            chol = self.chol[gi, :n, :n]
            cov = chol @ chol.T  # the block's covariance, time order
            ts = t_of[idx]
            for i in range(n):
                past = torch.nonzero((ts < ts[i]) & (ts >= ts[i] - window), as_tuple=False)[:, 0]
                if past.numel() == 0:
                    var_w[idx[i]] = cov[i, i]
                    continue
                c = cov[past][:, past]
                s = cov[past, i]
                var_w[idx[i]] = cov[i, i] - s @ torch.linalg.solve(c, s)
        return 0.5 * torch.log(self.marginal / var_w.reshape(self.length, self.dim)).sum(-1)


def gaussian_kl(
    mu: torch.Tensor, var: torch.Tensor, mu_hat: torch.Tensor, var_hat: torch.Tensor
) -> torch.Tensor:
    """``KL(N(μ, var) ‖ N(μ̂, var̂))`` summed over the last dim (diagonal Gaussians), in nats."""
    return 0.5 * (var / var_hat + (mu_hat - mu) ** 2 / var_hat - 1.0 + torch.log(var_hat / var)).sum(-1)
