"""``blobs``: Gaussian-blob classification with the input repeated for T timesteps (direct encoding), the
static-input task of the TS-neuron spec (remaining-seeds §38) [recon].

``classes`` centres in ``R^dim`` (standard normal, from the task seed); a sample is a centre plus
``spread``·N(0, I). The input at every timestep is the same vector (``[B, T, dim]``, ``T = length``); the
class is read from the model's outputs averaged over all T timesteps (a rate readout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import IGNORE, ClassBatch, TimeClassTask, _check, register_task

__all__ = ["BlobsTask"]


@register_task("blobs")
@dataclass
class BlobsTask(TimeClassTask):
    """Repeated-input Gaussian blobs (see the module docstring)."""

    classes: int = 4
    dim: int = 8
    spread: float = 1.2

    def __post_init__(self) -> None:
        _check(self.name, "classes", self.classes, 2)
        _check(self.name, "dim", self.dim, 1)
        v = self.spread
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 100:
            raise LonglabError(f"task blobs: spread must be a number in [0, 100], got {v!r}")
        g = torch.Generator().manual_seed(60_000 + int(self.seed))
        self.centres = torch.randn(self.classes, self.dim, generator=g)  # [K, dim]

    @property
    def input_dim(self) -> int:
        return self.dim

    def min_length(self) -> int:
        return 1

    def sample(self, batch, length, gen, exact=True):
        self.check_length(length)
        label = torch.randint(0, self.classes, (batch,), generator=gen)
        x = self.centres[label] + float(self.spread) * torch.randn(batch, self.dim, generator=gen)
        tokens = x[:, None].expand(batch, length, self.dim).contiguous()  # [B, T, dim]
        answer = torch.ones(batch, length, dtype=torch.bool)
        return ClassBatch(tokens, torch.full((batch, length), IGNORE), answer, label=label)
