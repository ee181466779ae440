"""PCFG parsing probes: the span targets against brute-force enumeration, and the probe on hand-built
states whose information content is known exactly."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from longlab.lab.model import LabConfig, LabLM
from longlab.lab.pcfg import length_inside, random_grammar, sample_string, span_log_inside
from longlab.lab.probes import pcfg_probes, probe_r2
from longlab.recipe import LonglabError


def _grammar():
    return random_grammar(3, 3, 0.7, torch.Generator().manual_seed(0))


def _brute(g, s, a):
    @functools.cache
    def p(sym, i, j):
        if j - i == 1:
            return float(g.unary[sym, s[i]])
        return sum(float(g.binary[sym, b, c]) * p(b, i, k) * p(c, k, j)
                   for k in range(i + 1, j) for b in range(g.n) for c in range(g.n))

    return p(a, 0, len(s))


def _strings(g, n, length, seed):
    beta = length_inside(g, length)
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([sample_string(g, length, beta, gen) for _ in range(n)])


def test_span_targets_match_brute_force():
    g = _grammar()
    x = _strings(g, 3, 7, 1)
    y = span_log_inside(g, x, [1, 2, 4])
    assert y.shape == (3, 7, 3, 3)
    assert torch.isnan(y[:, :3, 2]).all() and not torch.isnan(y[:, 3:, 2]).any()
    for b in range(3):
        s = tuple(x[b].tolist())
        for j, w in enumerate((1, 2, 4)):
            for t in range(w - 1, 7):
                for a in range(3):
                    assert math.isclose(float(y[b, t, j, a]), math.log(_brute(g, s[t - w + 1 : t + 1], a)),
                                        rel_tol=1e-9)


def test_probe_r2_exact_and_chance():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=gen)
    y = x @ torch.randn(5, 3, generator=gen) + 2.0
    assert probe_r2(x[:300], y[:300], x[300:], y[300:], ridge=1e-9) == pytest.approx(1.0, abs=1e-9)
    noise = torch.randn(400, 5, generator=gen)
    assert probe_r2(noise[:300], y[:300], noise[300:], y[300:]) < 0.1


def test_probes_on_hand_built_states():
    """Layer 0 sees only x_t (one-hot), layer 1 the pair (x_{t−1}, x_t): log β of width 1 is a function of
    x_t (R² = 1 at both), of width 2 a function of the pair (R² = 1 at layer 1 only), so the best layer
    rises with the width; width 4 is not a function of either (R² < 1)."""
    g = _grammar()
    tr, te = _strings(g, 60, 12, 2), _strings(g, 30, 12, 3)

    def states(tokens):
        one = torch.nn.functional.one_hot(tokens, 3).double()  # [B, L, 3]
        prev = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], 1)
        pair = torch.nn.functional.one_hot(prev * 3 + tokens, 9).double()
        return torch.stack([torch.cat([one, torch.zeros_like(pair)], -1), torch.cat([one, pair], -1)])

    out = pcfg_probes(states, g, tr, te, widths=[1, 2, 4], ridge=1e-9)
    r2 = out["r2"]
    assert r2[0][1] == pytest.approx(1.0, abs=1e-6) and r2[1][1] == pytest.approx(1.0, abs=1e-6)
    assert r2[1][2] == pytest.approx(1.0, abs=1e-6) and r2[0][2] < 0.6  # measured 0.34
    assert r2[1][4] < 0.5  # measured 0.20
    assert out["best_layer"][2] == 1
    with pytest.raises(LonglabError, match="widths"):
        pcfg_probes(states, g, tr, te, widths=[13])


def test_hidden_states_feed_the_head():
    model = LabLM(LabConfig(vocab_size=11, dim=16, n_layers=2, n_heads=2)).eval()
    tokens = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        h = model.hidden_states(tokens)
        assert h.shape == (3, 2, 9, 16)
        assert torch.allclose(model._head(h[-1]), model(tokens), atol=1e-6)
