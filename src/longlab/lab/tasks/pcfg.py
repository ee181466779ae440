"""``pcfg``: strings of a random binary PCFG with the exact next-token distribution by the inside
algorithm (:mod:`longlab.lab.pcfg`; "How Transformers Represent Hierarchies", ICML 2026) [recon];
lengths up to ``max_length`` (the oracle is cubic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipe import LonglabError
from .base import IGNORE, Batch, Task, _check, register_task

__all__ = ["PCFGBatch", "PCFGTask"]

# exact PCFG next-token distributions by (grammar fields, task seed, length, tokens): the evaluation draws
# the same test strings for every mixer, and the inside-algorithm oracle is O(L⁴·N³) per string
_PCFG_ORACLE: dict[tuple, torch.Tensor] = {}
_PCFG_ORACLE_MAX = 4096
_PCFG_ORACLES = ("prefix", "string")


@dataclass
class PCFGBatch(Batch):
    """A PCFG batch scored by the string oracle: ``log_oracle: [B]`` float64, ``log p(x_{1:} | x_0, |x| = L)``
    (:func:`longlab.lab.pcfg.string_log_prob`), in place of the per-prefix ``probs``."""

    log_oracle: torch.Tensor | None = None


@register_task("pcfg")
@dataclass
class PCFGTask(Task):
    """Strings of a random binary PCFG (grammar from the task seed) with the exact next-token
    distribution (:mod:`longlab.lab.pcfg`); every position's prediction is scored.

    ``oracle="prefix"`` (default): per string ``exp(−mean_t KL(p*_t ‖ q_t))`` from the per-prefix oracle,
    ``O(L⁴ N³)``. ``oracle="string"`` (long lengths): per string ``exp(−e)`` with the excess NLL per scored
    token ``e = (log p*(x_{1:} | x_0, L) − Σ_t log q(x_t | x_{<t})) / (L − 1)``, ``O(L³ N³)``. By the chain
    rule ``log p*(x_{1:} | x_0, L) = Σ_t log p*(x_t | x_{<t})``, so ``E[e] = E[mean_t KL(p*_t ‖ q_t)]``
    over strings: an unbiased estimate of the same per-token KL, noisier per string (``e`` can be < 0 and
    the per-string score > 1 on one string). Aggregate it as ``exp(−mean e)`` over strings
    (``bench/lab.py pcfg-long``); the metric ``excess_nll`` holds ``e``."""

    nonterminals: int = 16
    terminals: int = 32
    alpha: float = 0.3
    max_length: int = 128
    oracle: str = "prefix"

    def __post_init__(self) -> None:
        from ..pcfg import length_inside, random_grammar

        _check(self.name, "nonterminals", self.nonterminals, 1)
        _check(self.name, "terminals", self.terminals, 1)
        _check(self.name, "max_length", self.max_length, 2)
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LonglabError(f"task pcfg: alpha must be a number > 0, got {self.alpha!r}")
        if self.oracle not in _PCFG_ORACLES:
            raise LonglabError(f"task pcfg: oracle must be one of {list(_PCFG_ORACLES)}, got {self.oracle!r}")
        if self.max_length > 1024:
            raise LonglabError(f"task pcfg: max_length must be <= 1024, got {self.max_length}")
        g = torch.Generator().manual_seed(20_000 + int(self.seed))
        self.grammar = random_grammar(self.nonterminals, self.terminals, float(self.alpha), g)
        self.beta = length_inside(self.grammar, self.max_length)

    @property
    def vocab_size(self) -> int:
        return self.terminals

    def min_length(self) -> int:
        return 2

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length > self.max_length:
            raise LonglabError(
                f"task pcfg: length {length} > max_length {self.max_length} (the exact oracle costs O(L³·N³) "
                "per prefix, or per string with oracle=string); raise max_length or test shorter"
            )
        if not float(self.beta[length, 0]) > 0:
            raise LonglabError(f"task pcfg: the grammar derives no string of length {length}")

    def sample(self, batch, length, gen, exact=True):
        from ..pcfg import next_token_probs, sample_string, string_log_prob

        self.check_length(length)
        x = torch.stack([sample_string(self.grammar, length, self.beta, gen) for _ in range(batch)])
        targets = torch.full_like(x, IGNORE)
        targets[:, :-1] = x[:, 1:]
        probs = None
        key = (self.nonterminals, self.terminals, float(self.alpha), int(self.seed), length,
               x.numpy().tobytes())
        if exact and self.oracle == "string":
            skey = ("string", *key)
            lp = _PCFG_ORACLE.get(skey)
            if lp is None:
                lp = string_log_prob(self.grammar, x)
                if len(_PCFG_ORACLE) >= _PCFG_ORACLE_MAX:
                    _PCFG_ORACLE.pop(next(iter(_PCFG_ORACLE)))
                _PCFG_ORACLE[skey] = lp
            if not bool(torch.isfinite(lp).all()):
                raise LonglabError(f"task pcfg: the string oracle is not finite at length {length}")
            return PCFGBatch(x, targets, targets != IGNORE, log_oracle=lp.clone())
        if exact:  # the oracle is a function of (grammar, x): cached, so the mixers of one sweep share it
            probs = _PCFG_ORACLE.get(key)
            if probs is None:
                probs = next_token_probs(self.grammar, x).float()
                if len(_PCFG_ORACLE) >= _PCFG_ORACLE_MAX:
                    _PCFG_ORACLE.pop(next(iter(_PCFG_ORACLE)))
                _PCFG_ORACLE[key] = probs
            probs = probs.clone()
        return Batch(x, targets, targets != IGNORE, probs)

    def excess_nll(self, logits: torch.Tensor, batch: PCFGBatch) -> torch.Tensor:
        """``[B]`` float64: ``(log p*(x_{1:} | x_0, L) − Σ_t log q(x_t | x_{<t})) / (L − 1)`` (logits
        ``[B, L, V]``; the scored positions are all but the last)."""
        assert batch.log_oracle is not None
        logq = torch.log_softmax(logits.double(), -1)  # [B, L, V]
        m = batch.answer
        got = logq.gather(-1, batch.targets.clamp_min(0)[..., None])[..., 0]  # [B, L]
        return (batch.log_oracle - (got * m).sum(-1)) / m.sum(-1).clamp_min(1)

    def score(self, logits, batch):
        if isinstance(batch, PCFGBatch) and batch.log_oracle is not None:
            return torch.exp(-self.excess_nll(logits, batch)).float()
        return super().score(logits, batch)

    def metrics(self, out, batch):
        if isinstance(batch, PCFGBatch) and batch.log_oracle is not None:
            return {"excess_nll": float(self.excess_nll(out, batch)[0])}
        return super().metrics(out, batch)
