"""``mqar``: multi-query (multi-token) associative recall, the MQMTAR form of Vasylenko et al. (ASEntmax,
arXiv 2506.16640) after Arora et al. (Zoology, arXiv 2312.04927): ``n`` pairs of a ``key_len``-token key
and a ``value_len``-token value (distinct keys), ``SEP``, then ``queries`` keys whose values are the
answers. ``n`` grows with the length; the number of queries does not. With ``pairs = n > 0`` the
number of pairs is fixed and a gap of random ``filler`` tokens between the pairs and the queries grows
with the length instead (Zoology's few-pairs setting; the test length then tests recall distance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import Task, _check, _randint, register_task


@register_task("mqar")
@dataclass
class MQARTask(Task):
    alphabet: int = 32
    key_len: int = 2
    value_len: int = 1
    queries: int = 8
    pairs: int = 0  # 0: as many pairs as fit the length; > 0: that many, then a gap of filler tokens
    filler: int = 8  # filler symbols of the gap (only when pairs > 0)

    def __post_init__(self) -> None:
        _check(self.name, "alphabet", self.alphabet, 2)
        for f in ("key_len", "value_len", "queries", "filler"):
            _check(self.name, f, getattr(self, f), 1)
        _check(self.name, "pairs", self.pairs, 0)

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 2 + (self.filler if self.pairs else 0)

    def min_length(self) -> int:
        per = self.key_len + self.value_len
        return 2 + ((self.pairs or self.queries) + self.queries) * per

    def n_pairs(self, length: int) -> int:
        """Key-value pairs in a sequence of ``length`` tokens (fixed when ``pairs > 0``)."""
        if self.pairs:
            return self.pairs
        per = self.key_len + self.value_len
        return (length - 2 - self.queries * per) // per

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if self.n_pairs(length) > self.alphabet**self.key_len:
            raise LonglabError(
                f"task mqar: length {length} needs {self.n_pairs(length)} distinct keys but "
                f"alphabet^key_len = "
                f"{self.alphabet ** self.key_len}; raise key_len or alphabet"
            )

    def _sample(self, length, gen):
        bos, sep = self.alphabet, self.alphabet + 1
        a, kl, vl = self.alphabet, self.key_len, self.value_len
        n = self.n_pairs(length)
        ids = torch.randperm(a**kl, generator=gen)[:n]
        keys = torch.stack([(ids // a**i) % a for i in range(kl)], dim=1)  # [n, key_len] distinct
        values = torch.randint(0, a, (n, vl), generator=gen)
        q = torch.randint(0, n, (self.queries,), generator=gen)
        ctx = torch.cat([keys, values], dim=1).flatten()
        qs = torch.cat([keys[q], values[q]], dim=1).flatten()
        used = 2 + ctx.numel() + qs.numel()
        if self.pairs:  # BOS, the pairs, a gap of random filler (grows with the length), SEP, the queries
            gap = a + 2 + _randint(self.filler, gen, length - used)
            seq = torch.cat([torch.tensor([bos]), ctx, gap, torch.tensor([sep]), qs])
        else:
            seq = torch.cat([torch.full((length - used + 1,), bos), ctx, torch.tensor([sep]), qs])
        ans = torch.zeros(length, dtype=torch.bool)
        start = length - qs.numel()
        for j in range(self.queries):  # the tokens before each value token predict it
            v0 = start + j * (kl + vl) + kl
            ans[v0 - 1 : v0 - 1 + vl] = True
        return seq, ans
