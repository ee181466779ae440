"""``flipflop``: flip-flop language modelling (Liu et al. 2023, arXiv 2306.00946): pairs
(instruction, bit) with instructions w/r/i drawn with probabilities (p_w, p_r, p_i), the first a write;
the bit after ``r`` is the last written bit (answers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import Task, _check_p, _randint, register_task


@register_task("flipflop")
@dataclass
class FlipFlopTask(Task):
    p_write: float = 0.1
    p_read: float = 0.1

    def __post_init__(self) -> None:
        _check_p(self.name, "p_write", self.p_write)
        _check_p(self.name, "p_read", self.p_read)
        if self.p_write + self.p_read > 1 or self.p_write <= 0:
            raise LonglabError("task flipflop: need p_write > 0 and p_write + p_read <= 1")

    @property
    def vocab_size(self) -> int:
        return 5  # 0, 1, w, r, i

    def min_length(self) -> int:
        return 4

    def _sample(self, length, gen):
        w, r, i = 2, 3, 4
        n = length // 2
        u = torch.rand(n, generator=gen)
        instr = torch.where(u < self.p_write, w, torch.where(u < self.p_write + self.p_read, r, i))
        instr[0] = w
        bits = _randint(2, gen, n)
        last = 0
        for j in range(n):
            if instr[j] == w:
                last = int(bits[j])
            elif instr[j] == r:
                bits[j] = last
        seq = torch.stack([instr, bits], dim=1).flatten()
        if seq.numel() < length:
            seq = torch.cat([torch.tensor([i]), seq])
        off = length - 2 * n
        ans = torch.zeros(length, dtype=torch.bool)
        ans[off : off + 2 * n : 2] = instr == r  # the instruction r predicts the bit
        return seq, ans
