"""``passkey``: random filler with ``KEY d_1..d_k`` at a random depth, ending in ``QUERY``: the answers are
the digits (Mohtashami & Jaggi 2023, arXiv 2305.16300)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Task, _check, _randint, register_task


@register_task("passkey")
@dataclass
class PasskeyTask(Task):
    digits: int = 5
    filler: int = 8

    def __post_init__(self) -> None:
        _check(self.name, "digits", self.digits, 1)
        _check(self.name, "filler", self.filler, 1)

    @property
    def vocab_size(self) -> int:
        return 10 + self.filler + 3  # digits, filler, BOS, KEY, QUERY

    def min_length(self) -> int:
        return 2 * self.digits + 4

    def _sample(self, length, gen):
        bos, key, query = 10 + self.filler, 11 + self.filler, 12 + self.filler
        d = _randint(10, gen, self.digits)
        n_fill = length - 3 - 2 * self.digits
        fill = 10 + _randint(self.filler, gen, n_fill)
        at = int(_randint(n_fill + 1, gen)[0])
        t = torch.tensor
        seq = torch.cat([t([bos]), fill[:at], t([key]), d, fill[at:], t([query]), d])
        ans = torch.zeros(length, dtype=torch.bool)
        ans[length - self.digits - 1 : length - 1] = True
        return seq, ans
