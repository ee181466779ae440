"""PCFG task: inside probabilities, the exact next-token oracle and length-conditioned sampling, each
against brute-force enumeration on a 3-nonterminal grammar."""

from __future__ import annotations

import functools
import itertools

import torch

from longlab.lab.pcfg import inside_chart, length_inside, next_token_probs, random_grammar, sample_string
from longlab.lab.tasks import task_config


def _grammar():
    return random_grammar(3, 3, 0.7, torch.Generator().manual_seed(0))


def _brute_inside(g, s: tuple[int, ...], a: int = 0) -> float:
    @functools.cache
    def p(sym: int, i: int, j: int) -> float:  # recursive derivation sum over s[i:j]
        if j - i == 1:
            return float(g.unary[sym, s[i]])
        return sum(
            float(g.binary[sym, b, c]) * p(b, i, k) * p(c, k, j)
            for k in range(i + 1, j) for b in range(g.n) for c in range(g.n)
        )

    return p(a, 0, len(s))


def _chart_prob(g, s):
    return float(inside_chart(g, g.unary.T[torch.tensor(s)][None])[0, 0])


def test_inside_matches_recursive_enumeration_and_length_inside():
    g = _grammar()
    beta = length_inside(g, 5)
    for n in range(1, 6):
        total = 0.0
        for s in itertools.product(range(g.t), repeat=n):
            p = _chart_prob(g, s)
            if n <= 4:
                assert abs(p - _brute_inside(g, s)) < 1e-12
            total += p
        assert abs(total - float(beta[n, 0])) < 1e-12  # Σ over strings of length n = β(S, n)


def test_next_token_oracle_equals_brute_force_prefix_ratios():
    g = _grammar()
    length = 5
    x = torch.tensor([[0, 2, 1, 1, 0], [2, 2, 0, 1, 2]])
    probs = next_token_probs(g, x)
    torch.testing.assert_close(probs[:, :-1].sum(-1), torch.ones(2, length - 1, dtype=torch.float64))
    for b in range(2):
        for t in range(length - 1):
            prefix = tuple(x[b, : t + 1].tolist())
            mass = torch.zeros(g.t, dtype=torch.float64)
            for rest in itertools.product(range(g.t), repeat=length - t - 1):
                mass[rest[0]] += _chart_prob(g, prefix + rest)
            torch.testing.assert_close(probs[b, t], mass / mass.sum())


def test_samples_follow_the_length_conditioned_distribution():
    g = _grammar()
    beta = length_inside(g, 3)
    gen = torch.Generator().manual_seed(1)
    counts: dict[tuple[int, ...], int] = {}
    n = 3000
    for _ in range(n):
        s = tuple(sample_string(g, 3, beta, gen).tolist())
        counts[s] = counts.get(s, 0) + 1
    tv = 0.5 * sum(
        abs(counts.get(s, 0) / n - _chart_prob(g, s) / float(beta[3, 0]))
        for s in itertools.product(range(g.t), repeat=3)
    )
    assert tv < 0.05


def test_pcfg_task_batch():
    task = task_config("pcfg:nonterminals=4,terminals=6,max_length=16")
    b = task.sample(2, 12, torch.Generator().manual_seed(0))
    assert b.tokens.shape == (2, 12) and b.probs is not None
    torch.testing.assert_close(b.probs[:, :-1].sum(-1), torch.ones(2, 11))
    # a model that outputs the oracle's log-probabilities scores exp(−0) = 1
    logits = torch.log(b.probs.clamp_min(1e-12))
    assert torch.allclose(task.score(logits, b), torch.ones(2), atol=1e-4)
    assert task.sample(2, 12, torch.Generator().manual_seed(0), exact=False).probs is None


def test_next_token_oracle_under_no_grad():
    """Evaluation runs under torch.no_grad(); the oracle (an outside pass by autograd) must still work."""
    g = _grammar()
    x = torch.tensor([[0, 1, 2, 1, 0]])
    ref = next_token_probs(g, x)
    with torch.no_grad():
        got = next_token_probs(g, x)
    assert torch.equal(ref, got) and torch.allclose(got[0, :-1].sum(-1), torch.ones(4, dtype=got.dtype))
