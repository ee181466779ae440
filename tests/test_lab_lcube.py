"""L-CUBE (layers lab): the generator's covariance, the exact conditionals against brute force, the
utilisation metric's two ends, and the continuous model path (train, eval, recurrent = parallel)."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.lab import LabConfig, LabLM
from longlab.lab.evaluate import evaluate
from longlab.lab.lcube import Conditional, covariance, lcube_sample, widths
from longlab.lab.tasks import task_config
from longlab.lab.train import TrainConfig, train
from longlab.recipe import LonglabError

P = dict(dim=3, c=1.0, beta=0.75, rho=0.8, sigma=0.2)


def test_widths_grow_as_two_to_the_beta_level():
    d = widths(10, 8, 1.0, 0.75)
    assert d[0] == 8 and all(a <= b for a, b in zip(d, d[1:]))
    assert d[10] == math.ceil(2 ** 7.5)  # ⌈c·2^{βK}⌉ once above the leaf width


def test_generator_matches_the_analytic_covariance():
    t = 8
    cov = covariance(t, **P)
    x = lcube_sample(40_000, t, **P, gen=torch.Generator().manual_seed(0)).reshape(40_000, -1)
    emp = x.T @ x / x.shape[0]
    assert (emp - cov).abs().max() < 0.04
    assert torch.allclose(torch.diagonal(cov), torch.full((t * 3,), 1 + 0.2**2, dtype=torch.float64))
    # a prefix has the distribution of the shorter sequence (train short / test long see one process)
    assert torch.allclose(covariance(16, **P)[: t * 3, : t * 3], cov)


def test_conditionals_equal_brute_force_gaussian_conditioning():
    t = 12
    cov = covariance(t, **P)
    cond = Conditional(t, **P)
    x = lcube_sample(3, t, **P, gen=torch.Generator().manual_seed(1))
    mu = cond.mean(x)
    flat = x.reshape(3, -1)
    d = P["dim"]
    for i in range(1, t):
        past, now = slice(0, i * d), slice(i * d, (i + 1) * d)
        a = cov[now, past] @ torch.linalg.inv(cov[past, past])
        torch.testing.assert_close(mu[:, i], (a @ flat[:, past].T).T, rtol=0, atol=1e-9)
        v = cov[now, now] - a @ cov[past, now]
        torch.testing.assert_close(v, torch.diag(cond.var[i]), rtol=0, atol=1e-9)  # diagonal, as claimed
    torch.testing.assert_close(mu[:, 0], torch.zeros(3, d, dtype=torch.float64))  # no context: the mean 0
    # I*_t = H(x_t) - H(x_t | x_<t) from log-determinants
    for i in (1, 5, 11):
        sub = cov[: (i + 1) * d, : (i + 1) * d]
        h_joint = torch.logdet(sub) - torch.logdet(cov[: i * d, : i * d])
        want = 0.5 * (d * math.log(1 + P["sigma"] ** 2) - h_joint)
        assert float(cond.info()[i]) == pytest.approx(float(want), abs=1e-9)


def test_window_information_is_monotone_and_reaches_the_full_information():
    t = 16
    cond = Conditional(t, **P)
    full = cond.info()
    assert torch.allclose(cond.window_info(t), full, atol=1e-10)
    assert torch.allclose(cond.window_info(0), torch.zeros(t, dtype=torch.float64), atol=1e-12)
    prev = torch.zeros(t, dtype=torch.float64)
    for w in (1, 2, 4, 8):
        cur = cond.window_info(w)
        assert bool((cur >= prev - 1e-10).all()) and bool((cur <= full + 1e-10).all())
        prev = cur
    # brute force for one window: Gaussian conditioning on the last 3 tokens
    cov = covariance(t, **P)
    d, i = P["dim"], 10
    past, now = slice((i - 3) * d, i * d), slice(i * d, (i + 1) * d)
    v = cov[now, now] - cov[now, past] @ torch.linalg.solve(cov[past, past], cov[past, now])
    want = 0.5 * torch.log((1 + P["sigma"] ** 2) / torch.diagonal(v)).sum()
    assert float(cond.window_info(3)[i]) == pytest.approx(float(want), abs=1e-9)


def test_utilisation_is_one_for_the_exact_conditional_and_zero_for_the_marginal():
    task = task_config("lcube:dim=3,rho=0.8,sigma=0.2")
    b = task.sample(400, 32, torch.Generator().manual_seed(2))
    exact = torch.cat([b.cond_mean, torch.log(b.cond_var)[None].expand(400, -1, -1)], -1)
    assert torch.allclose(task.score(exact, b), torch.ones(400), atol=1e-5)
    marginal = torch.cat([torch.zeros_like(b.cond_mean),
                          torch.full_like(b.cond_mean, math.log(1 + 0.2**2))], -1)
    u = task.score(marginal, b)
    assert abs(float(u.mean())) < 0.05 and float(u.std()) > 0.01  # E[KL(cond ‖ marginal)] = I*


def test_continuous_model_recurrent_equals_parallel():
    torch.manual_seed(0)
    m = LabLM(LabConfig(vocab_size=0, input_dim=3, dim=16, n_layers=2, n_heads=2, mixer="softmax")).double()
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    full = m(x)
    assert full.shape == (2, 9, 6)
    st = m.init_state(2)
    steps = []
    for i in range(9):
        y, st = m.step(x[:, i : i + 1], st)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_lcube_trains_and_evaluates(tmp_path):
    cfg = TrainConfig(mixer="softmax", task="lcube:dim=3", train_len=16, steps=12, batch=8, dim=16,
                      n_layers=1, n_heads=2, lr=1e-2, ckpt_every=6)
    man = train(cfg, tmp_path / "ck", progress=False, log=None)
    assert man["history"][-1]["loss"] < man["history"][0]["loss"]
    rows = evaluate(tmp_path / "ck", [16, 32], out=tmp_path / "res", samples=2, batch=2, log=None)
    assert len(rows) == 4 and all(r["score"] <= 1.0 and r["info"] > 0 and r["kl"] >= 0 for r in rows)


@pytest.mark.parametrize("length", [64, 257])
def test_lcube_shapes_seeding_and_targets(length):
    task = task_config("lcube")
    a = task.sample(3, length, torch.Generator().manual_seed(5))
    b = task.sample(3, length, torch.Generator().manual_seed(5), exact=False)
    c = task.sample(3, length, torch.Generator().manual_seed(6), exact=False)
    assert a.tokens.shape == (3, length, 8) and a.tokens.dtype == torch.float32
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert torch.equal(a.values[:, :-1], a.tokens[:, 1:]) and not a.answer[:, -1].any()
    assert a.cond_var.shape == (length, 8) and bool((a.cond_var > 0).all())
    assert bool((a.cond_var[:-1] <= 1 + 0.1**2 + 1e-12).all())  # conditioning never adds variance


def test_bad_lcube_parameters():
    for spec in ("lcube:rho=1.5", "lcube:beta=0", "lcube:sigma=-1", "lcube:dim=0"):
        with pytest.raises(LonglabError, match="task lcube"):
            task_config(spec)
