"""The token-mixer extension point of the layers lab.

A mixer is a registered dataclass (its hyper-parameters, validated on construction) whose
``build(dim, n_heads, positions)`` makes the ``nn.Module``. Every module has

- ``forward(x: [B, T, D]) -> [B, T, D]``: the causal full-sequence form;
- ``init_state(B)`` / ``step(x: [B, 1, D], state) -> (y: [B, 1, D], state)``: the recurrent/decode
  form (a KV cache for attention-type mixers, a fixed-size state for RACE, linear attention, LaCT
  and Mamba); ``init_state`` returns ``None`` where a mixer has no such form;
- ``aux_loss``: a scalar the trainer adds to the task loss (L2A's gate-rate term), else ``None``;
- ``parallel_ffn``: a module run on the MLP's input and added to its output (UltraMemV2), else
  ``None``.

Capabilities are declared on the config class: ``block`` (``"prenorm"``: the LM block; ``"plain"``: the
mixer alone, no norm, MLP or residual: the spiking layers) and ``causal`` (``False``: an encoder mixer,
the criss-cross block of masked pretraining).

Score-based attention mixers subclass :class:`AttnMixer` and implement only ``weights(...)``: the map
from scores ``[B, H, Tq, Tk]`` to attention weights. Query rows are processed in chunks of
``row_chunk``, so no ``T × T`` matrix is built (memory ``row_chunk × T`` per head).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ...recipe import LonglabError
from ...registry import REGISTRY, Registered
from ..positions import LAB_POSITIONS, Positions

__all__ = [
    "MIXERS",
    "AttnMixer",
    "MixerConfig",
    "MixerModule",
    "mixer_config",
    "register_mixer",
]

#: The mixer family of the one registry (a live view ``name -> class``).
MIXERS = REGISTRY.view("mixer")

NEG = -1e30  # masked score (finite, so fully masked rows never make NaN)


def register_mixer(name: str):
    """Class decorator: put a :class:`MixerConfig` subclass in the one registry (family ``mixer``)."""
    return REGISTRY.register(name, "mixer")


@dataclass
class MixerConfig(Registered):
    """Hyper-parameters of one mixer (family ``mixer``). Subclasses add fields and implement
    :meth:`build`."""

    family: ClassVar[str] = "mixer"
    positions_allowed: ClassVar[tuple[str, ...]] = LAB_POSITIONS
    default_positions: ClassVar[str] = "rope"
    # capabilities: "prenorm" blocks are RMSNorm → mixer + RMSNorm → MLP with residuals; "plain" blocks are
    # the mixer alone (a spiking layer stack); causal = False: an encoder mixer (masked pretraining)
    block: ClassVar[str] = "prenorm"
    causal: ClassVar[bool] = True

    def build(self, dim: int, n_heads: int, positions: Positions) -> MixerModule:
        raise NotImplementedError

    def spec(self) -> str:  # type: ignore[override]  (a method here, the lab calls cfg.spec())
        """``name:k=v,...`` with the fields that differ from their defaults (round-trips)."""
        return REGISTRY.format(self)


def _check_int(name: str, field: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise LonglabError(f"mixer {name}: {field} must be an integer >= {lo}, got {value!r}")


def _check_float(name: str, field: str, value: Any, lo: float, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (strict and value <= lo):
        rel = ">" if strict else ">="
        raise LonglabError(f"mixer {name}: {field} must be a finite number {rel} {lo}, got {value!r}")


def mixer_config(spec: str | MixerConfig, **overrides: Any) -> MixerConfig:
    """A mixer config from ``"name"`` or ``"name:k=v,k2=v2"``, parsed by the one parameter parser of
    every registry (:func:`longlab.recipe.build_method`: literals, never evaluated, type-checked)."""
    if isinstance(spec, MixerConfig):
        return dataclasses.replace(spec, **overrides) if overrides else spec
    if not isinstance(spec, str) or not spec.strip():
        raise LonglabError(f"--mixer: expected a mixer name, got {spec!r}; choose one of {', '.join(MIXERS)}")
    try:
        cfg = REGISTRY.parse("mixer", spec)
    except LonglabError as exc:
        raise LonglabError(f"--mixer: {exc}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


class MixerModule(nn.Module):
    """Base of every mixer module (see the module docstring for the interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_loss: torch.Tensor | None = None
        self.parallel_ffn: nn.Module | None = None

    def init_state(self, batch: int) -> Any:
        return None

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        raise LonglabError(f"mixer {type(self).__name__} has no recurrent/decode form")


class AttnMixer(MixerModule):
    """Multi-head attention whose score-to-weight map is :meth:`weights`.

    ``q, k, v = W_q x, W_k x, W_v x`` split into H heads of size d; positions rotate q/k (RoPE) or
    add a bias; ``scores_ij = (q_i · k_j)/√d + bias_ij`` for ``j ≤ i``; ``out_i = Σ_j w_ij v_j``.
    """

    def __init__(self, dim: int, n_heads: int, positions: Positions, row_chunk: int = 256) -> None:
        super().__init__()
        if dim % n_heads:
            raise LonglabError(f"dim {dim} is not a multiple of n_heads {n_heads}")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.positions = positions
        self.row_chunk = int(row_chunk)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    # -- pieces subclasses override ------------------------------------------------------------
    def prepare(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, xq: torch.Tensor):
        """Hook after positions, before scores (normalise or rescale q/k). ``q: [B, H, Tq, d]``."""
        return q, k

    def score_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def weights(
        self, scores: torch.Tensor, valid: torch.Tensor, q_pos: torch.Tensor, xq: torch.Tensor
    ) -> torch.Tensor:
        """``scores: [B, H, Tq, Tk]`` (masked entries hold ``NEG``), ``valid: [Tq, Tk]`` bool -> weights."""
        raise NotImplementedError

    # -- shared machinery ----------------------------------------------------------------------
    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """``x: [B, T, D]`` -> q, k, v ``[B, H, T, d]`` with positions applied to q and k."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.positions.rotate(q, pos), self.positions.rotate(k, pos), v

    @staticmethod
    def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """``[Tq, Tk]`` bool: key j is visible to query i (causal; within ``window`` when given)."""
        ok = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        return ok

    def key_range(self, qp: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> tuple[int, int]:
        """Slice ``[lo, hi)`` of the (sorted) keys any query of the chunk ``qp`` can see."""
        hi = int((k_pos <= qp.max()).sum().item())
        lo = 0 if window is None else int((k_pos <= qp.min() - window).sum().item())
        return lo, hi

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
        xq: torch.Tensor, window: int | None = None,
    ) -> torch.Tensor:
        """Row-chunked attention: q ``[B, H, Tq, d]``, k/v ``[B, H, Tk, d]``, xq ``[B, Tq, D]``
        -> ``[B, H, Tq, d]``; ``window``: sliding-window attention (keys ``i − window < j ≤ i``)."""
        q, k = self.prepare(q, k, q_pos, xq)
        outs = []
        for s in range(0, q.shape[2], self.row_chunk):
            e = min(s + self.row_chunk, q.shape[2])
            qp = q_pos[s:e]
            lo, hi = self.key_range(qp, k_pos, window)
            kk, vv, kp = k[:, :, lo:hi], v[:, :, lo:hi], k_pos[lo:hi]  # keys the chunk cannot see: skipped
            scores = torch.matmul(q[:, :, s:e], kk.transpose(-1, -2)) * self.score_scale()
            bias = self.positions.bias(qp, kp)
            if bias is not None:
                scores = scores + bias
            valid = self.visible(qp, kp, window)
            scores = scores.masked_fill(~valid, NEG)
            w = self.weights(scores, valid, qp, xq[:, s:e])
            outs.append(torch.matmul(w.to(vv.dtype), vv))
        return torch.cat(outs, dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        q, k, v = self.project(x, pos)
        out = self.attend(q, k, v, pos, pos, x)  # [B, H, T, d]
        return self.o(out.transpose(1, 2).reshape(b, t, self.dim))

    def init_state(self, batch: int) -> dict[str, Any]:
        return {"k": None, "v": None, "t": 0}

    def step(self, x: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Decode one token ``x: [B, 1, D]`` against the KV cache in ``state``."""
        t = state["t"]
        pos = torch.tensor([t], device=x.device)
        q, k, v = self.project(x, pos)
        kc = k if state["k"] is None else torch.cat([state["k"], k], dim=2)
        vc = v if state["v"] is None else torch.cat([state["v"], v], dim=2)
        k_pos = torch.arange(t + 1, device=x.device)
        out = self.attend(q, kc, vc, pos, k_pos, x)
        y = self.o(out.transpose(1, 2).reshape(x.shape[0], 1, self.dim))
        return y, {"k": kc, "v": vc, "t": t + 1}
