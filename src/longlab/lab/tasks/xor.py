"""``xor``: delayed XOR of two spike bursts, the event-stream task of the TS-neuron spec (remaining-seeds
§38) [recon].

Inputs are spike trains on four groups of ``channels`` neurons (``input_dim = 4·channels``): bit ``a`` is
a burst on group ``a`` (0 or 1) during steps ``[0, burst)``, bit ``b`` a burst on group ``2 + b`` during
steps ``[d, d + burst)``, ``d = min(T // 2, delay)``; in a burst a neuron fires with probability ``rate``,
elsewhere every neuron fires with probability ``noise``. The label is ``a XOR b``, read from the model's
outputs averaged over the steps from ``d`` on (after both bursts have begun). ``T = length`` ≥ 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import IGNORE, ClassBatch, TimeClassTask, _check, register_task

__all__ = ["XORTask"]


@register_task("xor")
@dataclass
class XORTask(TimeClassTask):
    """Delayed XOR of two spike bursts (see the module docstring)."""

    classes: int = 2
    channels: int = 4
    burst: int = 2
    delay: int = 4
    rate: float = 0.8
    noise: float = 0.02

    def __post_init__(self) -> None:
        if self.classes != 2:
            raise LonglabError(f"task xor: classes is 2 (a XOR b), got {self.classes!r}")
        for f in ("channels", "burst", "delay"):
            _check(self.name, f, getattr(self, f), 1)
        for f in ("rate", "noise"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise LonglabError(f"task xor: {f} must be a probability in [0, 1], got {v!r}")

    @property
    def input_dim(self) -> int:
        return 4 * self.channels

    def min_length(self) -> int:
        return 4

    def gap(self, length: int) -> int:
        """``d``: the steps between the two bursts' onsets."""
        return min(length // 2, self.delay)

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        c, d = self.channels, self.gap(length)
        bits = torch.randint(0, 2, (batch, 2), generator=gen)
        p = torch.full((batch, length, 4, c), float(self.noise))
        rows = torch.arange(batch)
        p[rows, : min(self.burst, length), bits[:, 0]] = float(self.rate)
        p[rows, d : min(d + self.burst, length), 2 + bits[:, 1]] = float(self.rate)
        tokens = (torch.rand(batch, length, 4, c, generator=gen) < p).float().flatten(2)  # [B, T, 4c]
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, d:] = True
        label = bits[:, 0] ^ bits[:, 1]
        return ClassBatch(tokens, torch.full((batch, length), IGNORE), answer, label=label)
