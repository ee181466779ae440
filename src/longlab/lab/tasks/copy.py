"""``copy``: ``BOS x_1..x_n SEP x_1..x_n`` over ``alphabet`` symbols; answers: the second copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Task, _check, _randint, register_task


@register_task("copy")
@dataclass
class CopyTask(Task):
    alphabet: int = 16

    def __post_init__(self) -> None:
        _check(self.name, "alphabet", self.alphabet, 2)

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 2  # + BOS, SEP

    def _sample(self, length, gen):
        bos, sep = self.alphabet, self.alphabet + 1
        n = (length - 2) // 2
        x = _randint(self.alphabet, gen, n)
        pad = torch.full((length - 2 - 2 * n,), bos)
        seq = torch.cat([pad, torch.tensor([bos]), x, torch.tensor([sep]), x])
        ans = torch.zeros(length, dtype=torch.bool)
        ans[length - n - 1 : length - 1] = True  # SEP predicts x_1, ..., x_{n-1} predicts x_n
        return seq, ans
