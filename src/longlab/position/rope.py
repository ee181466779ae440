"""RoPE scaling and replacement methods (notation: scale ``s = L'/L``, base ``b``, head dimension ``D``,
pair ``i = 0..D/2-1`` with frequency ``θ_i = b^{-2i/D}``; HF rotate-half layout: channel ``i`` pairs with
``i + D/2``).

Each method: name, paper, how it reaches the model, formula.

- ``pi``: Chen et al. 2023, arXiv 2306.15595; transformers ``linear``; ``θ'_i = θ_i/s`` (``m -> m/s``).
- ``ntk``: bloc97 2023 ("NTK-aware scaled RoPE"), Peng et al. 2023 §3.1; ``rope_theta``;
  ``b' = b·s^{D/(D-2)}``.
- ``dynamic-ntk``: emozilla 2023, Peng et al. 2023 §3.3; transformers ``dynamic``;
  ``b' = b·(s·ℓ/L - (s-1))^{D/(D-2)}`` at current length ``ℓ > L``.
- ``yarn``: Peng et al. 2023, arXiv 2309.00071; transformers ``yarn`` (``ramp=code``) or own
  (``ramp=paper``); ``θ'_i = (1-γ_i)θ_i/s + γ_iθ_i``; cos, sin × ``0.1 ln s + 1``.
- ``longrope``: Ding et al. 2024, arXiv 2402.13753; transformers ``longrope``; ``θ'_i = θ_i/λ_i``;
  cos, sin × ``sqrt(1 + ln s / ln L)``.
- ``drope`` and ``ropeid`` (:mod:`longlab.position.variants`): own tables, then recalibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..recipe import LonglabError
from .base import LayerRope, PositionMethod, check_factor, register_position

__all__ = ["PI", "NTK", "DynamicNTK", "YaRN", "LongRoPE", "yarn_paper_inv_freq", "ropeid_inv_freq"]


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``θ_i = b^{-2i/D}``, ``[D/2]`` float32 (as transformers computes it)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _check_layers(method: PositionMethod) -> None:
    method.check("layers", choices=("", "full", "all"))


def _check_original(method: PositionMethod) -> None:
    method.check("original", 0, None, integer=True)


@dataclass
class ScaledRope(PositionMethod):
    """Base of the methods whose only parameters are the scale ``factor`` s = L'/L (>= 1) and the layer
    types they change (``layers``: ``""``/``full`` the global layers, ``all`` every layer)."""

    factor: float = 4.0
    layers: str = ""

    def validate(self) -> None:
        check_factor(self)
        _check_layers(self)


@register_position("pi")
@dataclass
class PI(ScaledRope):
    """Position interpolation (Chen et al. 2023, arXiv 2306.15595): position ``m`` is read as ``m/s``, i.e.
    every frequency ``θ_i -> θ_i/s``. transformers' ``rope_type="linear"``."""

    paper = "arXiv 2306.15595"

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        return LayerRope({**params, "rope_type": "linear", "factor": float(self.factor)})


@register_position("ntk")
@dataclass
class NTK(ScaledRope):
    """NTK-aware scaling (bloc97 2023; Peng et al. 2023, arXiv 2309.00071 §3.1): a larger base
    ``b' = b·s^{D/(D-2)}``, so the highest frequency is kept and the lowest is divided by ``s``. Plain
    RoPE with the new ``rope_theta``."""

    paper = "arXiv 2309.00071 (NTK-aware, bloc97 2023)"

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        theta = float(params["rope_theta"]) * self.factor ** (head_dim / (head_dim - 2))
        return LayerRope({**params, "rope_type": "default", "rope_theta": theta})


@register_position("dynamic-ntk")
@dataclass
class DynamicNTK(ScaledRope):
    """Dynamic NTK (emozilla 2023; Peng et al. 2023 §3.3), transformers' ``rope_type="dynamic"``: at a
    current length ``ℓ > L`` the base is ``b·(s·ℓ/L - (s-1))^{D/(D-2)}``, recomputed when ``ℓ`` grows; at
    ``ℓ <= L`` plain RoPE. ``L`` is the model's ``max_position_embeddings``. With chunked prefill the keys
    of earlier chunks keep the base of their own chunk (as in transformers' own cache)."""

    paper = "arXiv 2309.00071 (dynamic NTK, emozilla 2023)"

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        return LayerRope({**params, "rope_type": "dynamic", "factor": float(self.factor)})


def yarn_paper_inv_freq(
    base: float, dim: int, factor: float, original: int, alpha: float, beta: float
) -> torch.Tensor:
    """YaRN's frequencies ``[D/2]`` with the paper's ramp (Peng et al. 2023, eq. 18-20): ``r_i = L/λ_i``,
    ``λ_i = 2π/θ_i``; ``γ(r) = clip((r-α)/(β-α), 0, 1)``; ``θ'_i = (1-γ(r_i))·θ_i/s + γ(r_i)·θ_i``."""
    theta = _base_inv_freq(base, dim).double()
    ratio = original * theta / (2 * math.pi)
    gamma = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    return ((1 - gamma) * theta / factor + gamma * theta).float()


@register_position("yarn")
@dataclass
class YaRN(PositionMethod):
    """YaRN (Peng et al. 2023, arXiv 2309.00071): NTK-by-parts interpolation plus an attention temperature.

    Frequencies ``θ'_i = (1-γ_i)·θ_i/s + γ_i·θ_i``: pairs that turn more than ``beta_fast`` times within
    ``L`` keep their frequency, pairs that turn fewer than ``beta_slow`` times are interpolated by ``s``.
    ``ramp="code"`` (default) is transformers' ``rope_type="yarn"`` and the authors' code: ``γ`` linear in
    the pair index between the pairs where ``r_i = beta_fast`` and ``r_i = beta_slow`` (rounded outwards);
    ``ramp="paper"`` is the paper's ``γ(r) = clip((r-α)/(β-α), 0, 1)``, linear in the turn count ``r``. Both
    multiply cos and sin by ``mscale = 0.1·ln s + 1`` (logits by ``mscale²``, the paper's ``1/t``) unless
    ``attention_factor`` > 0 replaces it."""

    paper = "arXiv 2309.00071"
    factor: float = 4.0
    original: int = 0  # trained length L (0: the model's max_position_embeddings)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ramp: str = "code"
    attention_factor: float = 0.0  # 0: 0.1 ln s + 1
    layers: str = ""

    def validate(self) -> None:
        check_factor(self)
        _check_original(self)
        self.check("beta_slow", 0, None, low_open=True)
        if not self.beta_fast > self.beta_slow:
            raise LonglabError(
                f"yarn: beta_fast must be > beta_slow ({self.beta_slow:g}), got {self.beta_fast:g}"
            )
        self.check("ramp", choices=("code", "paper"))
        self.check("attention_factor", 0, None)
        _check_layers(self)

    @property
    def mscale(self) -> float:
        return self.attention_factor or (0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0)

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        if self.ramp == "paper":
            inv = yarn_paper_inv_freq(
                float(params["rope_theta"]), head_dim, self.factor, original, self.beta_slow, self.beta_fast
            )
            return LayerRope({**params, "rope_type": "default"}, inv, self.mscale)
        new = {
            **params,
            "rope_type": "yarn",
            "factor": float(self.factor),
            "original_max_position_embeddings": original,
            "beta_fast": float(self.beta_fast),
            "beta_slow": float(self.beta_slow),
        }
        if self.attention_factor:
            new["attention_factor"] = float(self.attention_factor)
        return LayerRope(new)


@register_position("longrope")
@dataclass
class LongRoPE(PositionMethod):
    """LongRoPE (Ding et al. 2024, arXiv 2402.13753): per-pair rescale factors ``λ_i`` (``θ'_i = θ_i/λ_i``)
    and cos, sin × ``sqrt(1 + ln s / ln L)``, through transformers' ``rope_type="longrope"``.

    The paper finds ``λ`` by evolutionary search; that search is not run here. ``init`` picks the search's
    starting points: ``"ntk"`` ``λ_i = s^{2i/(D-2)}`` (NTK-aware as per-pair factors; 1 for the fastest pair,
    ``s`` for the slowest) or ``"pi"`` ``λ_i = s``. The same factors are used at every length (transformers
    would switch from short to long factors once the input exceeds ``L``, which re-rotates nothing already
    cached), so a chunked prefill sees one table."""

    paper = "arXiv 2402.13753"
    factor: float = 4.0
    original: int = 0
    init: str = "ntk"
    layers: str = ""

    def validate(self) -> None:
        check_factor(self)
        _check_original(self)
        self.check("init", choices=("ntk", "pi"))
        _check_layers(self)

    def rescale(self, head_dim: int) -> list[float]:
        half = head_dim // 2
        if self.init == "pi":
            return [float(self.factor)] * half
        return [float(self.factor ** (2 * i / (head_dim - 2))) for i in range(half)]

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        lam = self.rescale(head_dim)
        return LayerRope(
            {
                **params,
                "rope_type": "longrope",
                "factor": float(self.factor),
                "original_max_position_embeddings": original,
                "short_factor": lam,
                "long_factor": lam,
            }
        )


def ropeid_inv_freq(dim: int, train_len: int, cycles: float, rotated: float = 0.5) -> torch.Tensor:
    """RoPE-ID frequencies ``[D/2]``: the first ``P = rotated·D/2`` pairs (quarters 1 and 3 of the head
    for ``rotated = 0.5``) get ``ω_i = ω_max·(ω_min/ω_max)^{i/(P-1)}`` with ``ω_max = 1`` and
    ``ω_min = 2π·c/L_train`` (so the slowest completes ``c`` turns within ``L_train``); the rest 0 (NoPE)."""
    half = dim // 2
    pairs = max(1, int(round(rotated * half)))
    w_min = 2 * math.pi * cycles / train_len
    i = torch.arange(pairs, dtype=torch.float64)
    omega = w_min ** (i / (pairs - 1)) if pairs > 1 else torch.ones(1, dtype=torch.float64)
    out = torch.zeros(half, dtype=torch.float64)
    out[:pairs] = omega
    return out.float()
