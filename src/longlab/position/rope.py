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

from ..recipe import LonglabError, shorten
from ..registry import MAX_FACTOR, MAX_TOKENS, param
from .base import LayerRope, PositionMethod, check_factor, find_rotary, register_position

__all__ = [
    "PI",
    "NTK",
    "DynamicNTK",
    "rotate_keys",
    "YaRN",
    "LongRoPE",
    "with_rescale",
    "read_rescale",
    "yarn_paper_inv_freq",
    "ropeid_inv_freq",
]


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``θ_i = b^{-2i/D}``, ``[D/2]`` float32 (as transformers computes it)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@dataclass
class ScaledRope(PositionMethod):
    """Base of the methods whose only parameters are the scale ``factor`` s = L'/L (>= 1) and the layer
    types they change (``layers``: ``""``/``full`` the global layers, ``all`` every layer)."""

    factor: float = param(4.0, low=1, high=MAX_FACTOR)
    layers: str = param("", choices=("", "full", "all"))

    def validate(self) -> None:
        check_factor(self)


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
    current length ``ℓ > L`` the base is ``b·(s·ℓ/L - (s-1))^{D/(D-2)}``; at ``ℓ <= L`` plain RoPE. ``L``
    is the model's ``max_position_embeddings``; ``ℓ`` is the largest position of the forward pass + 1.

    A cache stores keys *after* rotation, so once the base grows (a chunked prefill crossing ``L``, every
    decode step past ``L``) the keys of earlier forward passes are rotated with an older base than the
    queries; transformers' dynamic rope keeps them so. With ``rerotate=true`` (default) every forward pass
    first re-rotates the cached keys to the new base (``k <- R(m·(θ'_new - θ'_old))·k``, the rotation by
    the difference of the two angles at each slot's position ``m``), so every query meets keys of one base:
    the attention a one-shot prefill of the same length computes (exactly so in the first layer; deeper
    layers differ because earlier chunks' hidden states were computed at their own length). The base of a
    pass depends on that pass's positions only (not on the longest sequence the model saw before).
    ``rerotate=false`` is transformers' behaviour through a cache."""

    paper = "arXiv 2309.00071 (dynamic NTK, emozilla 2023)"
    rerotate: bool = param(True, choices=(True, False))

    def layer_rope(self, params: dict[str, Any], head_dim: int, original: int) -> LayerRope:
        return LayerRope({**params, "rope_type": "dynamic", "factor": float(self.factor)})

    def attach(self, model: Any, base_model: str | None) -> None:
        if not self.rerotate:
            return
        decoder, attr, rotary = find_rotary(model)
        rp = rotary.config.rope_parameters
        if isinstance(rp, dict) and "dynamic" not in str(rp.get("rope_type", "")):  # per layer type
            types = [t for t, v in rp.items() if isinstance(v, dict) and v.get("rope_type") == "dynamic"]
        else:
            types = [None]
        layer_types = list(getattr(rotary.config, "layer_types", None) or [])
        handle = decoder.register_forward_pre_hook(
            _DynamicRerotate(attr, types, layer_types), with_kwargs=True
        )
        model.longlab_dynamic_hook = handle

    def detach(self, model: Any) -> None:
        handle = getattr(model, "longlab_dynamic_hook", None)
        if handle is not None:
            handle.remove()
            del model.longlab_dynamic_hook


def rotation_table(positions: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos φ, sin φ`` of ``φ = positions [B, H_kv, T] · delta [D_rot/2]``, each ``[B, H_kv, T, D_rot/2]``
    (float32): what :func:`rotate_keys` needs, computed once for every layer holding the same positions."""
    phi = positions.float()[..., None] * delta.float().to(positions.device)
    return phi.cos(), phi.sin()


def rotate_keys(
    keys: torch.Tensor, positions: torch.Tensor, delta: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotate RoPE'd ``keys [B, H_kv, T, D]`` (rotate-half layout, the first ``2·len(delta)`` channels
    rotated) further by ``positions [B, H_kv, T] · delta [D_rot/2]``: with ``k = (a, b)`` the two halves,
    ``(a cos φ − b sin φ, b cos φ + a sin φ)`` = ``k·cos φ + rotate_half(k)·sin φ``. ``table``: the
    :func:`rotation_table` of these positions, if already computed. Float32, returned in ``keys``' dtype."""
    half = delta.numel()
    k = keys.float()
    a, b, rest = k[..., :half], k[..., half : 2 * half], k[..., 2 * half :]
    cos, sin = table if table is not None else rotation_table(positions, delta)
    return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), -1).to(keys.dtype)


class _DynamicRerotate:
    """Forward pre-hook of the decoder for ``dynamic-ntk:rerotate=true``: set the rotary module's
    frequencies for this pass's length ``ℓ`` (transformers' own dynamic formula) and re-rotate the
    cache's keys, which hold the frequencies of the cache's length before this pass, to them."""

    def __init__(self, attr: str, types: list[str | None], layer_types: list[str]) -> None:
        self.attr, self.types, self.layer_types = attr, types, layer_types

    @staticmethod
    def inv_at(rotary: Any, layer_type: str | None, ell: int) -> torch.Tensor:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        orig = getattr(rotary, f"{layer_type}_original_inv_freq" if layer_type else "original_inv_freq")
        if ell <= rotary.original_max_seq_len:
            return orig
        extra = {"layer_type": layer_type} if layer_type else {}
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](rotary.config, orig.device, seq_len=ell, **extra)
        return inv.to(orig.device)

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        rotary = getattr(module, self.attr)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        pos = kwargs.get("position_ids")
        layers = list(getattr(cache, "layers", None) or [])
        past = _cache_length(cache, layers)
        if pos is not None:
            ell = int(pos.max()) + 1
        else:
            x = kwargs.get("input_ids", args[0] if args else None)
            x = x if x is not None else kwargs["inputs_embeds"]
            ell = past + x.shape[1]
        for lt in self.types:
            prefix = f"{lt}_" if lt else ""
            inv = self.inv_at(rotary, lt, ell)
            rotary.register_buffer(f"{prefix}inv_freq", inv.clone(), persistent=False)
            setattr(rotary, f"{prefix}max_seq_len_cached", max(ell, rotary.original_max_seq_len))
            if past == 0:
                continue
            old = self.inv_at(rotary, lt, past)
            if torch.equal(old, inv):
                continue
            tables: list = []  # (positions, cos/sin table): layers holding the same positions share one
            for i, layer in enumerate(layers):
                if lt is not None and (i >= len(self.layer_types) or self.layer_types[i] != lt):
                    continue
                _rerotate_layer(layer, inv - old, tables)


def _cache_length(cache: Any, layers: list) -> int:
    """Positions the cache has seen (its largest position + 1): 0 for no or an empty cache."""
    for layer in layers:
        if not getattr(layer, "is_initialized", False):
            continue
        n_real = getattr(layer, "n_real", None)
        if n_real is not None:
            return int(n_real.max()) if n_real.numel() else 0
        return int(layer.get_seq_length())
    return 0


def _rerotate_layer(layer: Any, delta: torch.Tensor, tables: list | None = None) -> None:
    """Re-rotate one cache layer's keys by ``delta [D_rot/2]`` at each slot's position. ``tables``: a list
    of ``(positions, (cos, sin))`` shared across the layers of one pass; a layer whose positions equal a
    listed one reuses its table (one trigonometric pass per pass, not per layer, without eviction)."""
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None or keys.shape[-2] == 0:
        return
    if not isinstance(keys, torch.Tensor) or not getattr(type(layer), "batchable", True):
        raise LonglabError(
            f"dynamic-ntk: re-rotating cached keys needs plain key storage, but the cache layer is "
            f"{type(layer).__name__}; use dynamic-ntk:rerotate=false (keys keep their own base)"
        )
    B, H, T, _ = keys.shape
    index = getattr(layer, "index", None)
    if isinstance(index, torch.Tensor) and index.shape == (B, H, T):
        positions = index.clamp(min=0)  # longlab's cache: each slot's position (-1: empty)
    else:  # transformers' layers: the last T of get_seq_length() positions (all of them, or a window)
        end = int(layer.get_seq_length())
        positions = torch.arange(end - T, end, device=keys.device).expand(B, H, T)
    table = None
    if tables is not None:
        table = next((t for p, t in tables if p.shape == positions.shape and torch.equal(p, positions)), None)
        if table is None:
            table = rotation_table(positions, delta)
            tables.append((positions, table))
    layer.keys = rotate_keys(keys, positions, delta, table)


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
    factor: float = param(4.0, low=1, high=MAX_FACTOR)
    original: int = param(0, low=0, high=MAX_TOKENS, integer=True)  # trained length L (0: the model's)
    beta_fast: float = param(32.0, low=0, high=1024, low_open=True)
    beta_slow: float = param(1.0, low=0, high=1024, low_open=True)
    ramp: str = param("code", choices=("code", "paper"))
    attention_factor: float = param(0.0, low=0, high=10)  # 0: 0.1 ln s + 1; logits scale by its square
    layers: str = param("", choices=("", "full", "all"))

    def validate(self) -> None:
        check_factor(self)
        if not self.beta_fast > self.beta_slow:
            raise LonglabError(
                f"yarn: beta_fast must be > beta_slow ({self.beta_slow:g}), got {self.beta_fast:g}"
            )

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

    ``init`` picks the search's starting points: ``"ntk"`` ``λ_i = s^{2i/(D-2)}`` (NTK-aware as per-pair
    factors; 1 for the fastest pair, ``s`` for the slowest) or ``"pi"`` ``λ_i = s``. ``factors=PATH`` reads
    searched factors instead (a JSON file with ``"rescale": [λ_0, ..., λ_{D/2-1}]``, as
    :func:`longlab.position.search.longrope_search` writes; each ``λ_i >= 1``). The search's other
    dimension, ``n̂`` initial positions left unscaled, is not implemented. The same factors are used at
    every length (transformers would switch from short to long factors once the input exceeds ``L``,
    which re-rotates nothing already cached), so a chunked prefill sees one table."""

    paper = "arXiv 2402.13753"
    factor: float = param(4.0, low=1, high=MAX_FACTOR)
    original: int = param(0, low=0, high=MAX_TOKENS, integer=True)
    init: str = param("ntk", choices=("ntk", "pi"))
    factors: str = ""
    layers: str = param("", choices=("", "full", "all"))

    def validate(self) -> None:
        check_factor(self)
        if self.factors:
            self._searched = read_rescale(self.factors)

    def rescale(self, head_dim: int) -> list[float]:
        half = head_dim // 2
        searched = getattr(self, "_searched", None)
        if searched is not None:
            if len(searched) != half:
                raise LonglabError(
                    f"longrope: factors={shorten(self.factors)} has {len(searched)} rescale factors, "
                    f"but this model's rotary dimension needs D/2 = {half}"
                )
            return list(searched)
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


def with_rescale(factor: float, rescale: list[float], **fields: Any) -> LongRoPE:
    """A :class:`LongRoPE` with the given per-pair factors (the search's candidates; not a spec string)."""
    method = LongRoPE(factor=factor, **fields)
    method._searched = check_rescale("longrope: rescale", rescale)
    return method


def check_rescale(name: str, values: Any) -> list[float]:
    if not isinstance(values, list) or not values:
        raise LonglabError(f"{name} must be a non-empty list of numbers >= 1, got {shorten(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
            raise LonglabError(f"{name}: every factor must be a finite number >= 1, got {shorten(v)}")
    return [float(v) for v in values]


def read_rescale(path: str) -> list[float]:
    """The ``"rescale"`` list of a LongRoPE factors file (JSON; never evaluated as code)."""
    import json
    from pathlib import Path

    shown = shorten(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LonglabError(f"longrope: factors={shown}: cannot read a JSON factors file: {exc}") from None
    if not isinstance(data, dict) or "rescale" not in data:
        raise LonglabError(f"longrope: factors={shown}: expected a JSON object with a 'rescale' list")
    return check_rescale(f"longrope: factors={shown}", data["rescale"])


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
