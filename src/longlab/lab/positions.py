"""Positions for the layers lab, chosen apart from the token mixer.

- ``rope``: rotary embedding (Su et al. 2021, arXiv 2104.09864) on q and k, base ``theta``.
- ``nope``: no positional signal (causality alone; Kazemnejad et al. 2023).
- ``alibi``: additive score bias ``-m_h·(i - j)`` with geometric slopes ``m_h = 2^{-8h/H}``
  (Press et al. 2022, arXiv 2108.12409).
- ``nape``: half the heads ALiBi with slopes ``1/h`` (h = 1, 2, ...), the other half NoPE
  (Vasylenko et al. 2025, ASEntmax, arXiv 2506.16640); length scaling acts on the NoPE heads only.
- ``ropeid``: RoPE-ID (Wertheimer et al., arXiv 2603.18017): the first ``P = D/4`` rotation pairs
  (channels ``0 .. 2P-1`` in the lab's interleaved layout; quarters 1 and 3 in rotate-half) rotate at
  ``ω_i = (2π·c/L_train)^{i/(P-1)}``, from 1 rad/token down to ``c = 1`` turn within the training length
  (:func:`longlab.position.rope.ropeid_inv_freq`); the other pairs are NoPE. No logit temperature.

Score-based mixers take the bias and RoPE-ID; kernel/recurrent mixers (linear, race, lact, mamba)
accept only ``rope``/``nope`` (an additive score bias has no place in their factorised forms).
"""

from __future__ import annotations

import torch

from ..position.rope import ropeid_inv_freq
from ..recipe import LonglabError

__all__ = ["LAB_POSITIONS", "Positions", "log_length"]

LAB_POSITIONS = ("rope", "nope", "alibi", "nape", "ropeid")


class Positions:
    """Position handling for ``n_heads`` heads of size ``head_dim``."""

    def __init__(self, kind: str, n_heads: int, head_dim: int, theta: float = 10000.0,
                 train_len: int = 0, cycles: float = 1.0) -> None:
        if kind not in LAB_POSITIONS:
            raise LonglabError(f"positions: unknown {kind!r}; choose one of {', '.join(LAB_POSITIONS)}")
        if kind in ("rope", "ropeid") and head_dim % 2:
            raise LonglabError(f"positions: {kind} needs an even head dim, got {head_dim}")
        if kind == "ropeid" and (head_dim < 4 or train_len < 2):
            raise LonglabError(
                f"positions: ropeid needs head dim >= 4 and the training length >= 2, "
                f"got {head_dim} and {train_len}"
            )
        self.kind = kind
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.theta = float(theta)
        self.inv_freq = None  # [D/2] RoPE-ID's per-pair frequencies (0 = NoPE pair)
        if kind == "ropeid":
            self.inv_freq = ropeid_inv_freq(head_dim, train_len, cycles)
        slopes = torch.zeros(n_heads)
        nope = torch.ones(n_heads, dtype=torch.bool)
        if kind == "alibi":
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])
            nope[:] = False
        elif kind == "nape":
            half = n_heads // 2
            slopes[:half] = torch.tensor([1.0 / (h + 1) for h in range(half)])
            nope[:half] = False
        self.slopes = slopes  # [H]
        self.nope_heads = nope  # [H] heads without a positional signal (length scaling applies here)

    @property
    def has_bias(self) -> bool:
        return self.kind in ("alibi", "nape")

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE on ``x: [B, H, T, D]`` at positions ``pos: [T]``: pair ``(2i, 2i+1)`` rotated by
        ``pos·ω_i`` with ``ω_i = θ^{-2i/D}`` (``rope``) or RoPE-ID's (``ropeid``; ``ω_i = 0`` leaves the
        pair as it is); the identity for the other kinds."""
        if self.kind not in ("rope", "ropeid"):
            return x
        d = x.shape[-1]
        if self.inv_freq is not None:
            inv = self.inv_freq.to(x.device)
        else:
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
        ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive score bias ``[1, H, Tq, Tk]`` (``None`` without one): ``-slope_h · (i - j)``."""
        if not self.has_bias:
            return None
        dist = (q_pos[:, None] - k_pos[None, :]).to(torch.float32).clamp_min(0)  # [Tq, Tk]
        return -(self.slopes.to(dist.device)[:, None, None] * dist)[None]

    def require(self, allowed: tuple[str, ...], mixer: str) -> None:
        if self.kind not in allowed:
            raise LonglabError(
                f"positions: mixer {mixer!r} takes {', '.join(allowed)}, not {self.kind!r}"
            )


def log_length(q_pos: torch.Tensor) -> torch.Tensor:
    """``log(pos + 2)`` per query row ``[Tq]`` (the official SSMax/ASEntmax length term; pos from 0)."""
    return torch.log(q_pos.to(torch.float32) + 2.0)

