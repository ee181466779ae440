"""PCFG task: inside probabilities, the exact next-token oracle and length-conditioned sampling, each
against brute-force enumeration on a 3-nonterminal grammar."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from longlab.lab.pcfg import inside_chart, length_inside, next_token_probs, random_grammar, sample_string
from longlab.lab.tasks import task_config
from longlab.recipe import LonglabError


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


def test_oracle_cache_is_keyed_by_grammar_and_tokens(monkeypatch):
    """The evaluation's oracle cache: the same strings of the same grammar are computed once and give the
    same probabilities; another grammar (alpha, task seed) or other strings are computed anew."""
    import longlab.lab.pcfg as pcfg_mod
    from longlab.lab.tasks import pcfg as tasks_mod  # the module that holds the oracle cache

    calls = []
    real = pcfg_mod.next_token_probs

    def counting(g, x, root=0):
        calls.append(x.clone())
        return real(g, x, root)

    monkeypatch.setattr(pcfg_mod, "next_token_probs", counting)
    monkeypatch.setattr(tasks_mod, "_PCFG_ORACLE", {})
    spec = "pcfg:nonterminals=3,terminals=4,alpha=0.5,max_length=16"
    a = task_config(spec).sample(2, 10, torch.Generator().manual_seed(5))
    b = task_config(spec).sample(2, 10, torch.Generator().manual_seed(5))  # a fresh task object, same strings
    assert len(calls) == 1 and torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
    b.probs.zero_()  # callers get their own copy
    c = task_config(spec).sample(2, 10, torch.Generator().manual_seed(5))
    assert len(calls) == 1 and torch.equal(a.probs, c.probs)
    task_config(spec).sample(2, 10, torch.Generator().manual_seed(6))  # other strings
    task_config(spec.replace("alpha=0.5", "alpha=0.6")).sample(2, 10, torch.Generator().manual_seed(5))
    task_config(spec, seed=1).sample(2, 10, torch.Generator().manual_seed(5))  # another grammar
    assert len(calls) == 4
    d = task_config(spec, seed=1).sample(2, 10, torch.Generator().manual_seed(5))
    assert len(calls) == 4
    torch.testing.assert_close(d.probs, real(task_config(spec, seed=1).grammar, d.tokens).float())


def test_string_oracle_is_the_chain_rule_of_the_next_token_oracle():
    """``string_log_prob`` (two inside passes) = Σ_t log p(x_t | x_<t, L) of the per-prefix oracle, on the
    brute-force grammar (also against enumeration) and on the lab's parse-dependent grammar at 24 tokens."""
    from longlab.lab.pcfg import string_log_prob

    g = _grammar()
    x = torch.tensor([[0, 2, 1, 1, 0], [2, 2, 0, 1, 2]])
    chain = torch.log(next_token_probs(g, x)[:, :-1].gather(-1, x[:, 1:, None])[..., 0]).sum(-1)
    got = string_log_prob(g, x)
    torch.testing.assert_close(got, chain, rtol=0, atol=1e-9)
    for b in range(2):  # p(x | L) / p(x_0 | L) by enumeration of all strings of length 5
        s = tuple(x[b].tolist())
        first = sum(_chart_prob(g, (s[0], *rest)) for rest in itertools.product(range(g.t), repeat=4))
        assert abs(float(got[b]) - math.log(_chart_prob(g, s) / first)) < 1e-9
    task = task_config("pcfg:max_length=24,nonterminals=8,terminals=32,alpha=0.02")
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    y = torch.stack([sample_string(task.grammar, 24, task.beta, gen) for gen in gens])
    p = next_token_probs(task.grammar, y)
    chain = torch.log(p[:, :-1].gather(-1, y[:, 1:, None])[..., 0]).sum(-1)
    torch.testing.assert_close(string_log_prob(task.grammar, y), chain, rtol=0, atol=1e-6)


def test_string_oracle_score_estimates_the_prefix_kl_score():
    """``oracle=string``: the oracle itself scores exactly 1 per string (excess 0); for a wrong model the mean
    excess NLL over strings matches the mean per-prefix KL on the same strings within sampling error."""
    from longlab.lab.tasks import PCFGBatch, kl_per_position

    spec = "nonterminals=4,terminals=6,alpha=0.3,max_length=16"
    pre, stri = task_config(f"pcfg:{spec}"), task_config(f"pcfg:{spec},oracle=string")
    a = pre.sample(300, 10, torch.Generator().manual_seed(3))
    b = stri.sample(300, 10, torch.Generator().manual_seed(3))
    assert isinstance(b, PCFGBatch) and b.probs is None and torch.equal(a.tokens, b.tokens)
    exact = torch.log(a.probs.double().clamp_min(1e-300))  # the oracle as a model
    zero = torch.zeros(300, dtype=torch.float64)
    torch.testing.assert_close(stri.excess_nll(exact, b), zero, rtol=0, atol=1e-5)
    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(4))
    logits = table[a.tokens]  # a bigram-like wrong model: [B, L, V]
    kl = kl_per_position(logits, a).double()  # [300] the prefix score's per-string mean KL
    e = stri.excess_nll(logits, b)
    diff = e - kl  # zero-mean noise per string (the chain rule)
    se = float(diff.std()) / 300**0.5
    assert float(kl.mean()) > 0.1 and abs(float(diff.mean())) < 4 * se
    torch.testing.assert_close(stri.score(logits, b), torch.exp(-e).float())
    assert stri.metrics(logits[:1], stri.sample(1, 10, torch.Generator().manual_seed(3)))["excess_nll"] == \
        pytest.approx(float(e[0]), abs=1e-9)


def test_string_oracle_arguments():
    with pytest.raises(LonglabError, match="oracle"):
        task_config("pcfg:oracle=perfix")
    with pytest.raises(LonglabError, match="max_length"):
        task_config("pcfg:nonterminals=2,terminals=2,max_length=8").check_length(9)


@pytest.mark.slow
def test_string_oracle_at_256_tokens():
    """The long-length setting of the lab page: finite, and the per-token log-probability is plausible."""
    from longlab.lab.pcfg import string_log_prob

    task = task_config("pcfg:max_length=256,nonterminals=8,terminals=32,alpha=0.02,oracle=string")
    x = sample_string(task.grammar, 256, task.beta, torch.Generator().manual_seed(0))[None]
    lp = string_log_prob(task.grammar, x)
    assert bool(torch.isfinite(lp).all()) and -4.0 < float(lp[0]) / 255 < -0.5
